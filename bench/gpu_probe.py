"""Where does the time go on the H200? One call, printed as short tables (a development probe).

    python3 bench/gpu_probe.py [--sections sdpa,gemm,engines] [--out DIR]

- sdpa:    torch SDPA per backend at the attention shapes of the benchmark rows, on the packed
           [B, S, 3·H·D] layout kiln's attention reads (strided q/k/v views) and on contiguous q/k/v.
- gemm:    cuBLAS (mm, addmm, _addmm_activation GELU) and kiln's Triton GEMM configs at BERT-base
           batch 64 seq 384 GEMM shapes, in TFLOP/s.
- engines: builds kiln engines for the large-batch rows and prints, for the costliest layers, every
           candidate tactic the autotuner timed (or why it dropped it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu as bench_gpu  # noqa: E402  bench/gpu.py: the models, the wrapper, CUDA-event timing


def time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    return statistics.median(bench_gpu.time_cuda(fn, warmup, iters))


def sdpa(log) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    cases = [("bert_b64", 64, 12, 384, 64, False, False), ("bert_b64+mask", 64, 12, 384, 64, False, True),
             ("vit_b64", 64, 12, 197, 64, False, False), ("gpt2_b8 causal", 8, 12, 512, 64, True, False),
             ("bert_b1", 1, 12, 128, 64, False, False)]
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    log("| case | layout | " + " | ".join(backends) + " |  (ms; TFLOP/s of the best)")
    for name, b, h, s, d, causal, masked in cases:
        qkv = torch.randn(b, s, 3 * h * d, device="cuda", dtype=torch.float16)
        q, k, v = (t.unflatten(-1, (h, d)).permute(0, 2, 1, 3) for t in qkv.split(h * d, dim=-1))
        mask = None
        if masked:
            mask = torch.zeros(b, 1, 1, s, device="cuda", dtype=torch.float16)
            mask[:, :, :, s - 7:] = -10000.0
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        for layout, (qq, kk, vv) in (("packed", (q, k, v)), ("contig", (q.contiguous(), k.contiguous(), v.contiguous()))):
            cells = []
            best = float("inf")
            for backend in backends.values():
                def run(qq=qq, kk=kk, vv=vv, backend=backend):
                    if backend is None:
                        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal)
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal)
                try:
                    ms = time_ms(run)
                    best = min(best, ms)
                    cells.append(f"{ms:.3f}")
                except Exception as e:  # noqa: BLE001
                    cells.append("n/a")
            log(f"| {name} | {layout} | " + " | ".join(cells) + f" | {flops / best / 1e9:.0f} |")


def gemm(log) -> None:
    import torch.nn.functional as F

    from kiln.kernels.cuda.triton import GEMM_CONFIGS, gemm as triton_gemm

    m = 64 * 384
    shapes = [("qkv", 2304, 768), ("attn out", 768, 768), ("ffn1 +gelu", 3072, 768), ("ffn2", 768, 3072)]
    log("| gemm (M=24576) | F.linear | addmm | addmm+gelu | " + " | ".join(str(c) for c in GEMM_CONFIGS) + " |")
    for name, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        flops = 2 * m * n * k
        wt = w.t()
        runs = [lambda: F.linear(x, w), lambda: torch.addmm(bias, x, wt),
                lambda: torch._addmm_activation(bias, x, wt, use_gelu=True)]
        for config in GEMM_CONFIGS:
            runs.append(lambda config=config: triton_gemm(x, w, bias, None, activation="Gelu", config=config))
        cells = []
        for fn in runs:
            try:
                ms = time_ms(fn)
                cells.append(f"{flops / ms / 1e9:.0f}")
            except Exception as e:  # noqa: BLE001
                cells.append(f"err {type(e).__name__}")
        log(f"| {name} {n}x{k} | " + " | ".join(cells) + " |")


def cudnn_smoke(log) -> None:
    """Does nvidia-cudnn-frontend import beside this torch, and does one fused conv graph run?"""
    import cudnn

    log(f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()}")
    handle = cudnn.create_handle()
    n, c, k, hw = 256, 64, 256, 56
    x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(k, c, 1, 1, device="cuda", dtype=torch.float16) * 0.1).contiguous(memory_format=torch.channels_last)
    b = torch.randn(1, k, 1, 1, device="cuda", dtype=torch.float16)
    r = torch.randn(n, k, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    X, W, B, R = (graph.tensor_like(t) for t in (x, w, b, r))
    conv = graph.conv_fprop(image=X, weight=W, padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    y = graph.relu(input=graph.add(a=graph.add(a=conv, b=B), b=R))
    y.set_output(True).set_data_type(cudnn.data_type.HALF)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    ws = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    out = torch.empty(n, k, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute({X: x, W: w, B: b, R: r, y: out}, ws, handle=handle)

    run()
    ref = torch.relu(torch.conv2d(x.float(), w.float()) + b.float() + r.float())
    log(f"cudnn fused conv max err {(out.float() - ref).abs().max().item():.3g} (|ref| {ref.abs().max().item():.3g})")
    fused = time_ms(run)
    torch_ms = time_ms(lambda: torch.relu_(torch.conv2d(x, w) + b + r))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
        with torch.cuda.graph(g, stream=s):
            run()
    torch.cuda.current_stream().wait_stream(s)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    log(f"cudnn fused conv 64->256 1x1 b256: {fused:.3f} ms vs torch conv+add+add+relu {torch_ms:.3f} ms; "
        f"after CUDA-graph replay max err {(out.float() - ref).abs().max().item():.3g}")


def build_engine(name: str):
    """-> (kiln fp16 CUDA engine of bench/gpu.py's row `name`, its example inputs), as bench/gpu.py builds it."""
    import tempfile

    import kiln

    module, inputs, _desc = bench_gpu.make(name)
    module = bench_gpu.FirstOutput(module).float().cpu()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        torch.onnx.export(module, inputs, path, dynamo=True, input_names=["x"], output_names=["y"])
        return kiln.build(path, device="cuda", precision="fp16"), inputs


def engines(log, names: list[str]) -> None:
    for name in names:
        engine, _inputs = build_engine(name)
        layers = engine.plan.header.get("tactics", {}).get("layers", {})
        steps = {s.name: s for s in engine.plan.program.steps}
        seen: set[str] = set()
        log(f"{name}: {len(steps)} layers")
        for layer, tuned in sorted(layers.items(), key=lambda kv: -(kv[1].get("time_ms") or 0)):
            step = steps.get(layer)
            kind = f"{step.op_type}" if step else "?"
            if kind in seen and len(seen) > 6:
                continue
            seen.add(kind)
            cands = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}: {str(v)[:70]}"
                              for k, v in tuned.get("candidates", {}).items())
            log(f"  {layer} {kind} -> {tuned.get('tactic')} | {cands}")
        del engine
        torch.cuda.empty_cache()


def kernels(log, names: list[str]) -> None:
    """GPU time by kernel while the engine replays its CUDA graph (torch.profiler / CUPTI): what the
    replayed engine really spends, free of the per-layer profiler's host overhead."""
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        engine, inputs = build_engine(name)
        ctx = engine.create_execution_context()
        x = inputs[0].cuda()
        for _ in range(3):
            ctx.run({"x": x})
        torch.cuda.synchronize()
        replays = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                ctx.run({"x": x})
            torch.cuda.synchronize()
        by_kernel: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                by_kernel.setdefault(event.name[:90], []).append(event.device_time / 1e3)
        total = sum(sum(v) for v in by_kernel.values()) / replays
        ms = statistics.median(bench_gpu.time_cuda(lambda: ctx.run({"x": x})))
        log(f"{name}: {ms:.3f} ms per run; kernels sum {total:.3f} ms per run")
        for kernel, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:14]:
            log(f"  {sum(times) / replays:7.3f} ms  x{len(times) // replays:<3d} {kernel}")
        del engine, ctx
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="cudnn,sdpa,gemm,engines")
    ap.add_argument("--models", default="bert_b64,vit_b64,resnet50_b256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    logf = open(os.path.join(args.out, "gpu_probe.log"), "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} cudnn {torch.backends.cudnn.version()}")
    for section in args.sections.split(","):
        try:
            if section == "engines":
                engines(log, args.models.split(","))
            elif section == "kernels":
                kernels(log, args.models.split(","))
            else:
                {"sdpa": sdpa, "gemm": gemm, "cudnn": cudnn_smoke}[section](log)
        except Exception:  # noqa: BLE001  one failing section must not hide the others
            log(f"{section}: FAILED\n{traceback.format_exc()}")


if __name__ == "__main__":
    main()
