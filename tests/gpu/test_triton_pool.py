"""kiln's NHWC pooling kernels on CUDA at ResNet-50 / MobileNetV2 sizes: correctness against torch, replay
in a CUDA graph through the tactics, and a timing table against torch and against kiln's default ops.

    python -m tests.gpu.test_triton_pool          one call on the H200: PASS/FAIL lines + timing table,
                                                   exit status 1 on any wrong result
    pytest tests/gpu/test_triton_pool.py -s       the same checks as tests (timings printed, never asserted)

Run it on its own, not in one pytest session with tests/kernels (whose conftest sets TRITON_INTERPRET=1).
Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.common import capture, median_ms

CUDA_OK = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (tests/kernels ran in this session): run tests/gpu alone"),
]

CL = torch.channels_last
TOLERANCE = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3), torch.float32: (1e-5, 1e-5)}


def _nhwc(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype).contiguous(memory_format=CL)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> str | None:
    if got.shape != want.shape or got.dtype != dtype:
        return f"gave {got.dtype}{list(got.shape)}, expected {dtype}{list(want.shape)}"
    rtol, atol = (0.0, 0.0) if exact else TOLERANCE[dtype]  # a max is exact: each output is one of the inputs
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None


# ---- the cases -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    name: str
    kiln: object  # () -> tensor
    torch_ref: object  # () -> tensor, the fp32 (or exact) oracle
    torch_fast: object  # () -> tensor, what torch runs in the storage dtype (timed against)
    kiln_default: object | None  # () -> tensor, kiln's registered op (the engine's default tactic)
    dtype: torch.dtype
    exact: bool
    bytes_moved: int


def _cases() -> list[Case]:
    from kiln.kernels.cuda.triton import pool
    from kiln.ops.registry import OpContext, lookup

    max_ref = lookup("MaxPool", "").fn
    avg_ref = lookup("AveragePool", "").fn
    mean_ref = lookup("ReduceMean", "").fn
    gap_ref = lookup("GlobalAveragePool", "").fn
    ctx = OpContext("layer", "op")
    cases = []
    for batch, dtype in ((256, torch.float16), (1, torch.float16), (256, torch.bfloat16), (32, torch.float32)):
        x = _nhwc((batch, 64, 112, 112), dtype)  # ResNet-50's stem pool: 3x3, stride 2, pad 1
        nbytes = x.numel() * x.element_size() * 5 // 4  # input once + the quarter-size output
        cases.append(Case(
            f"MaxPool 3x3/2 [{batch},64,112,112] {str(dtype)[6:]}",
            lambda x=x: pool.max_pool2d(x, (3, 3), (2, 2), [1, 1, 1, 1]),
            lambda x=x: F.max_pool2d(x.float(), 3, 2, 1), lambda x=x: F.max_pool2d(x, 3, 2, 1),
            lambda x=x: max_ref(ctx, x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
            dtype, True, nbytes))
    x = _nhwc((256, 64, 112, 112), torch.float16, seed=1)
    x[1, 5, 7, 9] = float("nan")  # torch's NaN rule at full size
    cases.append(Case("MaxPool 3x3/2 b256 fp16 with a NaN", lambda: pool.max_pool2d(x, (3, 3), (2, 2), [1, 1, 1, 1]),
                      lambda: F.max_pool2d(x.float(), 3, 2, 1), lambda: F.max_pool2d(x, 3, 2, 1), None,
                      torch.float16, True, x.numel() * 2 * 5 // 4))
    for shape, k, s, p, ceil, include in (((64, 256, 28, 28), 3, 1, 1, False, False),  # Inception-style
                                          ((32, 96, 55, 55), 3, 2, 0, True, True)):
        x = _nhwc(shape, torch.float16, seed=2)
        cases.append(Case(
            f"AveragePool {k}x{k}/{s} {list(shape)} fp16{' ceil' if ceil else ''}{' incl' if include else ''}",
            lambda x=x, k=k, s=s, p=p, ceil=ceil, include=include: pool.avg_pool2d(
                x, (k, k), (s, s), [p] * 4, ceil_mode=ceil, count_include_pad=include),
            lambda x=x, k=k, s=s, p=p, ceil=ceil, include=include: F.avg_pool2d(
                x.float(), k, s, p, ceil_mode=ceil, count_include_pad=include),
            lambda x=x, k=k, s=s, p=p, ceil=ceil, include=include: F.avg_pool2d(
                x, k, s, p, ceil_mode=ceil, count_include_pad=include),
            lambda x=x, k=k, s=s, p=p, ceil=ceil, include=include: avg_ref(
                ctx, x, kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, ceil_mode=int(ceil),
                count_include_pad=int(include)),
            torch.float16, False, x.numel() * 2 * 5 // 4))
    axes = torch.tensor([2, 3], device="cuda")
    for label, shape, dtype in (("ResNet-50 b1", (1, 2048, 7, 7), torch.float16),
                                ("MobileNetV2 b1", (1, 1280, 7, 7), torch.float16),
                                ("ResNet-50 b256", (256, 2048, 7, 7), torch.float16),
                                ("ResNet-50 b1", (1, 2048, 7, 7), torch.bfloat16),
                                ("ResNet-50 b32", (32, 2048, 7, 7), torch.float32)):
        x = _nhwc(shape, dtype, seed=3, scale=3.0)
        cases.append(Case(
            f"ReduceMean(2,3) {label} {list(shape)} {str(dtype)[6:]}", lambda x=x: pool.mean_hw(x, True),
            lambda x=x: x.float().mean((2, 3), keepdim=True), lambda x=x: x.mean((2, 3), keepdim=True),
            lambda x=x: mean_ref(ctx, x, axes, keepdims=1), dtype, False, x.numel() * x.element_size()))
    x = _nhwc((1, 1280, 7, 7), torch.float16, seed=4)
    cases.append(Case("GlobalAveragePool MobileNetV2 b1 fp16", lambda: pool.mean_hw(x, True),
                      lambda: x.float().mean((2, 3), keepdim=True), lambda: F.adaptive_avg_pool2d(x, 1),
                      lambda: gap_ref(ctx, x), torch.float16, False, x.numel() * 2))
    return cases


def _tactic_graph_replay() -> list[tuple[str, str | None]]:
    """Each pool tactic as the engine runs it: prepared, launched inside a captured CUDA graph, replayed."""
    from kiln.ops.registry import OpContext, lookup
    from kiln.plan.spec import StepSpec
    from kiln.tactics import registry
    from kiln.tactics.tactic import InputMeta

    def step(op, n_in, **attrs):
        return StepSpec(op_type=op, name=op.lower(), inputs=[f"i{k}" for k in range(n_in)], outputs=["y"],
                        attributes=attrs, opset=18)

    x = _nhwc((8, 64, 56, 56), torch.float16, seed=5)
    axes = torch.tensor([2, 3], device="cuda")
    layers = [("cuda.pool.max.triton", step("MaxPool", 1, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
               [x], [None]),
              ("cuda.pool.avg.triton", step("AveragePool", 1, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                            ceil_mode=1), [x], [None]),
              ("cuda.reduce_mean_hw.triton", step("ReduceMean", 2, keepdims=0), [x, axes], [None, axes]),
              ("cuda.reduce_mean_hw.triton.global_average_pool", step("GlobalAveragePool", 1), [x], [None])]
    results = []
    for name, s, args, constants in layers:
        tactic = registry.get(name)
        ctx = OpContext(s.name, s.op_type, opset=18, num_inputs=len(args))
        try:
            ok = tactic.check(s, [InputMeta.of(a, c is not None) for a, c in zip(args, constants)])
            if ok is not True:
                results.append((name, f"refused: {ok}"))
                continue
            launch = tactic.prepare(dataclasses.replace(s, tactic=name), constants, torch.device("cuda"))
            expected = lookup(s.op_type, "").fn(ctx, *args, **s.attributes)
            graph, out = capture(lambda: launch(ctx, *args, **s.attributes))
            args[0].mul_(-1.0)  # new data in the same buffer: the replay must see it
            expected = lookup(s.op_type, "").fn(ctx, *args, **s.attributes)
            graph.replay()
            torch.cuda.synchronize()
            args[0].mul_(-1.0)
            results.append((name, _close(out, expected, torch.float16, exact=s.op_type == "MaxPool")))
        except Exception as e:  # noqa: BLE001  reported as a failure with its cause
            results.append((name, f"{type(e).__name__}: {e}"))
    return results


def _config_sweep() -> list[str]:
    """ResNet-50 b256 MaxPool under a few tile shapes (the default heuristic first)."""
    from kiln.kernels.cuda.triton import pool

    x = _nhwc((256, 64, 112, 112), torch.float16)
    expected = F.max_pool2d(x, 3, 2, 1)
    lines = []
    for config in (pool.PoolConfig(), pool.PoolConfig(16, 64), pool.PoolConfig(64, 64), pool.PoolConfig(128, 64, 8),
                   pool.PoolConfig(32, 32), pool.PoolConfig(64, 32), pool.PoolConfig(32, 64, 2)):
        fn = lambda config=config: pool.max_pool2d(x, (3, 3), (2, 2), [1, 1, 1, 1], config=config)  # noqa: E731
        ok = torch.equal(fn(), expected)
        ms = median_ms(fn)
        lines.append(f"  {str(config):60s} {ms:8.4f} ms  {x.numel() * 2 * 1.25 / ms / 1e6:7.0f} GB/s"
                     f"  {'ok' if ok else 'WRONG'}")
    return lines


def run_all(print_fn=print) -> bool:
    ok = True
    print_fn(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print_fn(f"{'case':58s} {'result':6s} {'kiln ms':>9s} {'torch ms':>9s} {'default':>9s} {'vs torch':>8s} "
             f"{'vs dflt':>8s} {'GB/s':>6s}")
    for case in _cases():
        start = time.perf_counter()
        try:
            got = case.kiln()
            problem = _close(got, case.torch_ref(), case.dtype, case.exact)
            if problem is None and got.dim() == 4 and got.shape[2] * got.shape[3] > 1:
                problem = None if got.is_contiguous(memory_format=CL) else "output is not channels-last"
        except Exception as e:  # noqa: BLE001
            problem = f"{type(e).__name__}: {e}"
        if problem:
            ok = False
            print_fn(f"{case.name:58s} FAIL   {problem}")
            continue
        kiln_ms = median_ms(case.kiln)
        torch_ms = median_ms(case.torch_fast)
        default_ms = median_ms(case.kiln_default) if case.kiln_default else float("nan")
        print_fn(f"{case.name:58s} PASS   {kiln_ms:9.4f} {torch_ms:9.4f} {default_ms:9.4f} {torch_ms / kiln_ms:7.2f}x "
                 f"{default_ms / kiln_ms:7.2f}x {case.bytes_moved / kiln_ms / 1e6:6.0f}"
                 f"   ({time.perf_counter() - start:.1f} s)")
    for name, problem in _tactic_graph_replay():
        ok = ok and problem is None
        print_fn(f"tactic {name:51s} {'PASS' if problem is None else 'FAIL'}   CUDA graph capture + replay"
                 + (f": {problem}" if problem else ""))
    print_fn("MaxPool [256,64,112,112] fp16 tile sweep (BLOCK_P x BLOCK_C, warps):")
    sweep = _config_sweep()
    ok = ok and not any("WRONG" in line for line in sweep)
    for line in sweep:
        print_fn(line)
    print_fn("PASS" if ok else "FAIL")
    return ok


def test_pool_kernels_on_cuda_match_torch_and_replay_in_graphs():
    assert run_all(lambda line: print(line, flush=True))


if __name__ == "__main__":
    if not CUDA_OK:
        print("SKIP: needs CUDA and TRITON_INTERPRET unset")
        sys.exit(0)
    sys.exit(0 if run_all(lambda line: print(line, flush=True)) else 1)
