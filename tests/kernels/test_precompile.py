"""The parallel compile of a CUDA build's Triton kernels (kiln/builder/precompile.py,
kiln/kernels/cuda/triton/precompile.py), checked for sm_90 without a GPU (tests/kernels/compile_sm90.py's
stand-in driver): the candidates of an FP8 ResNet block's layers at opt level 3 (every QConv tile, the fused
residual, the stem, Q/DQ) are recorded as the search would prepare them, compiled by worker processes, and then
every launch's own compile through Triton's JIT finds its kernel in the disk cache: the workers made the very
kernels the launches need (same source, signature, constants, options and target), and none compiles twice.

    python -m tests.kernels.test_precompile      (the real compiler: TRITON_INTERPRET unset)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


SHAPE = (2, 3, 32, 32)


def _fp8_block_program(tmp: Path):
    """The bottleneck in FP8 QDQ (onnxruntime's quantize_static), lowered for CUDA at opt level 3."""
    import dataclasses

    import numpy as np
    import torch

    from kiln.builder.build import pass_options
    from kiln.builder.config import BuildConfig
    from kiln.builder.padding_free import lower_precision_of, optimize_and_lower
    from kiln.frontend import onnx as onnx_frontend
    from tests.calibration import quantize_fp8
    from tests.resnet_block import Bottleneck

    torch.manual_seed(0)
    fp32, qdq = tmp / "block.onnx", tmp / "block_fp8.onnx"
    # ResNet-50's layer kinds at 64 channels (the Triton tiles' smallest), 8x8 after the stem and the pool: the
    # stem, 1x1 and 3x3 convolutions, the expanding 1x1 with the shortcut's residual add fused (opt level 3)
    block = Bottleneck(stem=64, width=64, out=256).eval()
    torch.onnx.export(block, (torch.randn(SHAPE),), str(fp32), dynamo=True, input_names=["x"],
                      output_names=["y"])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal(SHAPE, dtype=np.float32)} for _ in range(2)]
    quantize_fp8(str(fp32), str(qdq), feeds)
    config = BuildConfig(device="cuda", opt_level=3)
    options = dataclasses.replace(pass_options(config), cuda_rules=True)
    _, lowered = optimize_and_lower(onnx_frontend.load(str(qdq)), options)
    lower_precision_of(lowered, "fp16", set())
    return lowered


def _compiles_counted(calls: list[tuple[str, bool]]):
    """triton.compile, counting each call's kernel and whether it was a disk-cache miss (it wrote a new entry)."""
    import triton.compiler
    from triton import knobs

    compile = triton.compiler.compile

    def counted(src, *args, **kwargs):
        before = set(os.listdir(knobs.cache.dir)) if os.path.isdir(knobs.cache.dir) else set()
        kernel = compile(src, *args, **kwargs)
        calls.append((getattr(src, "fn", src).__name__, bool(set(os.listdir(knobs.cache.dir)) - before)))
        return kernel

    triton.compiler.compile = counted  # the JIT binds triton.compiler.compile when a kernel first runs


def main() -> None:
    import torch

    calls: list[tuple[str, bool]] = []
    _compiles_counted(calls)

    from triton.runtime.jit import KernelInterface

    from kiln.builder.autotune import _candidates, _record_candidate_kernels, _usable
    from kiln.builder.layer_records import record_layers
    from kiln.builder.precompile import CandidateKernels
    from kiln.builder.timing_cache import TimingCache
    from kiln.runtime.engine import place_weight
    from kiln.runtime.program import Program
    from kiln.tactics.tactic import InputMeta
    from tests.kernels.compile_sm90 import sm90_driver

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")  # a fresh cache: every kernel compiled here
        lowered = _fp8_block_program(Path(tmp))
        program = lowered.program
        tunable = {i: found for i, step in enumerate(program.steps)
                   if (found := _candidates(step, torch.device("cuda"), 3, []))}
        placed = {k: place_weight(v, torch.device("cpu")) for k, v in lowered.weights.items()}
        reference = Program(program, placed, torch.device("cpu"))
        examples = [torch.randn(SHAPE).half()]

        def constants_of(step):
            return [placed[program.constants[name]] if name in program.constants else None for name in step.inputs]

        kernels = CandidateKernels(workers=2)  # what CandidateKernels.start gives a CUDA build
        # the candidates prepared on the CPU (this machine's tensors), their kernels specialized as on sm_90
        with sm90_driver():
            _record_candidate_kernels(kernels, program, tunable, reference, constants_of, examples,
                                      TimingCache(None), {"device_type": "cuda"}, torch.device("cpu"), print)
            for i in list(kernels.pending):
                for future in kernels.pending[i]:
                    assert future.exception() is None, future.exception()
                kernels.wait(i)
        kernels.close()
        compiled_by_workers = kernels.kernels
        igemm = sum(k.name == "_qconv_kernel" for k in kernels.pool.submitted)
        assert igemm >= 8 and not calls, (igemm, calls)  # the tiles' kernels among them; none compiled in here
        print(f"ok  {compiled_by_workers} kernels ({igemm} implicit-GEMM convolutions) compiled by 2 workers, "
              f"none here ({kernels.pool.seconds:.1f} s summed)", flush=True)

        # every candidate's launch, as the search makes it: the JIT compiles (then launches nothing: warm-up)
        KernelInterface.__getitem__ = lambda self, grid: lambda *a, **k: self.run(*a, grid=grid, warmup=True, **k)
        records, _ = record_layers(reference, set(tunable), examples)
        launched = 0
        with sm90_driver():
            for i, record in records.items():
                step, bound = program.steps[i], reference.steps[i]
                metas = [InputMeta.of(a, c is not None) for a, c in zip(record.args, constants_of(step))]
                for tactic in _usable(tunable[i], step, [metas])[0]:
                    launch = tactic.prepare(step, constants_of(step), torch.device("cpu"))
                    with torch.inference_mode():
                        launch(bound.ctx, *[tactic.to_layout(a) for a in record.args], **bound.attributes)
                    launched += 1
        missed = [name for name, miss in calls if miss]
        assert calls and not missed, f"compiled again by the launch (not what the workers made): {missed}"
        print(f"ok  {launched} candidate launches: {len(calls)} JIT compiles, every one a disk-cache hit", flush=True)


def quick() -> None:
    """Recording alone (no compile): a QConv tactic's launch on sm_90 gives the kernel Triton would compile, once; a
    compile a worker cannot do fails its future and the pool goes on."""
    import dataclasses
    import pickle
    import threading

    import torch

    from kiln.kernels.cuda.triton.precompile import CompilePool, recorded_launches
    from kiln.tactics import registry
    from tests.kernels.compile_sm90 import sm90_driver
    from tests.kernels.qlayers import FP8, conv_layer

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # this process's compiles (another thread's) go there
    layer = conv_layer(FP8, FP8, cin=64, cout=128, size=(16, 16))
    tactic = registry.get("cuda.qconv.triton_igemm.128x64x64w4s4")
    launch = tactic.prepare(layer.step, [None, *layer.args[1:]], torch.device("cpu"))
    x = tactic.to_layout(layer.args[0])
    with sm90_driver(), recorded_launches() as kernels:
        for _ in range(2):  # the same kernel twice: recorded once
            assert launch(layer.ctx, x, *layer.args[1:], **layer.attributes) is not None
    (kernel,) = kernels
    failed = []

    def launch_elsewhere():
        try:
            launch(layer.ctx, x, *layer.args[1:], **layer.attributes)
        except Exception as e:  # noqa: BLE001  the stand-in driver cannot launch what Triton compiled
            failed.append(e)

    with sm90_driver(), recorded_launches() as elsewhere:  # another thread's launch is not recorded: it compiles
        thread = threading.Thread(target=launch_elsewhere)
        thread.start()
        thread.join()
    assert not elsewhere and "launcher" in str(failed), failed  # compiled, then failed to launch: not skipped
    constants = {fn_path: value for fn_path, value in kernel.constexprs.items() if isinstance(value, (str, bool))}
    assert kernel.name == "_qconv_kernel" and "taps" in constants.values(), kernel
    assert (kernel.options["num_warps"], kernel.options["num_stages"]) == (4, 4), kernel.options
    assert pickle.loads(pickle.dumps(kernel)).key == kernel.key
    print(f"ok  recorded {kernel.name} ({len(kernel.constexprs)} constants, {len(kernel.attrs)} specialized)")

    pool = CompilePool(workers=1)
    missing = dataclasses.replace(kernel, name="_no_such_kernel")
    failed, = pool.submit([missing])
    assert "AttributeError" in str(failed.exception(timeout=120))
    again, = pool.submit([missing])  # submitted before: the same future, not compiled twice
    assert again is failed and len(pool.submitted) == 1
    pool.close()
    print("ok  a failed compile fails its future only")


def test_a_launch_records_the_kernel_it_would_compile():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_precompile", "--quick"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 2, result.stdout


@pytest.mark.slow
def test_the_workers_compile_the_kernels_the_candidates_launch():
    pytest.importorskip("triton")
    pytest.importorskip("onnxruntime")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_precompile"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 2, result.stdout


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        sys.exit("the sm_90 compile needs the real compiler: unset TRITON_INTERPRET")
    quick() if "--quick" in sys.argv else main()
