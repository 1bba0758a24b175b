"""BERT-base's attention layer on the GPU: kiln's fp16 flash attention against its FP8 forms and cuDNN's FP8 SDPA
(issue 12).

    python3 bench/fp8_attention.py [--batch 64] [--seq 384] [--half-padded] [--configs all|default]

The layer as the engines hand it over: q, k and v column slices of the QKV GEMM's [B, S, 3·768] output (12 heads,
d 64), key lengths (kiln::KeyLengths, all S, or from S/2 up with --half-padded), the output written as [B, S, 768].
Rows:

- kiln fp16: the fp16 engine's layer (cuda.attention.triton.*), per tile;
- torch SDPA (flash, cuDNN) on contiguous fp16 [B, H, S, D] with no mask: peers, layout copies not counted;
- kiln FP8 (flash_attention's Float8Scales): E4M3 q/k/v slices of an E4M3 QKV output (what a QKV GEMM writing
  E4M3 in its epilogue hands over), the output fp16 or E4M3 (what the attention-out GEMM reads); fp16 q/k/v
  quantized as they are loaded (no QKV change); E4M3 with v stored transposed ([B, H, D, T] memory: the layout
  Hopper's E4M3 wgmma wants for p·v); q·kᵀ alone in E4M3 from fp16 q/k (p·v in fp16: cuda.attention.triton_fp8qk);
- cuDNN's FP8 SDPA (nvidia-cudnn-frontend's graph sdpa_fp8) on the E4M3 slices, E4M3 out: a peer.

Accuracy: each output against torch in fp32 on the fp16 inputs (the layer's exact result; the FP8 rows' input
rounding counted): the largest error over the largest |reference|, and the mean error over the mean |reference|.
Timing: 20 calls in one CUDA graph, median of 10 replays (bench/gpu.py graph_ms); TFLOP/s counts 4·B·H·S²·D.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import graph_ms  # noqa: E402  bench/gpu.py
from kiln.kernels.cuda.triton.attention import (  # noqa: E402
    ATTENTION_CONFIGS,
    FP8_DTYPE,
    P_SCALE,
    AttentionConfig,
    Float8Scales,
    flash_attention,
)

HEADS, HEAD_DIM = 12, 64
FP8_MAX = 448.0


def heads_of(qkv: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v as [B, H, S, D] views of a [B, S, 3·H·D] buffer (the engine's layout: no copies)."""
    return [t.unflatten(-1, (HEADS, HEAD_DIM)).permute(0, 2, 1, 3) for t in qkv.split(HEADS * HEAD_DIM, dim=-1)]


def scale_of(x: torch.Tensor) -> float:
    return x.abs().amax().float().item() / FP8_MAX  # per tensor, as kiln's min-max calibration sets it


def errors(out: torch.Tensor, reference: torch.Tensor) -> str:
    """max error / max |reference| and mean error / mean |reference|."""
    error = (out.float() - reference).abs()
    return f"{error.max().item() / reference.abs().max().item():.2e} / " \
           f"{error.mean().item() / reference.abs().mean().item():.2e}"


def print_table(columns: list[str], rows: list[tuple[str, Callable[[], list[str]] | str]]) -> None:
    """A markdown table, each row printed as it is measured and the whole table last (shared with
    bench/fp8_attention_chain.py). A row: its name and what measures its other cells, or a string saying why it was
    not run; a measure that raises is a row saying why it failed (a variant that does not run stays in the table)."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    blank = [""] * (len(columns) - 2)
    table = [line(columns), "|" + "---|" * len(columns)]
    for name, measure in rows:
        if isinstance(measure, str):
            table.append(line([name, f"not run: {measure}", *blank]))
        else:
            try:
                table.append(line([name, *measure()]))
            except Exception as e:  # noqa: BLE001  a variant that fails is a row saying why
                table.append(line([name, f"failed: {type(e).__name__}: {str(e)[:120]}", *blank]))
        print(table[-1], flush=True)
    print("\n".join(table))


def cudnn_fp8_sdpa(q8: list[torch.Tensor], fp8: Float8Scales, scale: float) -> Callable[[], torch.Tensor] | str:
    """cuDNN's FP8 SDPA on the strided E4M3 q/k/v views, E4M3 output [B, H, S, D] at fp8.out (a graph built once)."""
    try:
        torch.backends.cudnn.version()  # torch's libcudnn first: the frontend's dlopen finds it
        import cudnn
    except (ImportError, OSError, RuntimeError, AssertionError) as e:
        return f"import cudnn: {type(e).__name__}: {str(e)[:80]}"
    q, k, v = q8
    b, h, s, d = q.shape
    out = torch.empty(b, h, s, d, dtype=FP8_DTYPE, device=q.device)
    handle = cudnn.create_handle()
    try:
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        made = {name: graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()),
                                   data_type=cudnn.data_type.FP8_E4M3) for name, t in (("q", q), ("k", k), ("v", v))}
        values = {"descale_q": fp8.q, "descale_k": fp8.k, "descale_v": fp8.v, "descale_s": P_SCALE,
                  "scale_s": 1.0 / P_SCALE, "scale_o": 1.0 / fp8.out}
        scalars = {name: graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                                      data_type=cudnn.data_type.FLOAT) for name in values}
        o, _stats, amax_s, amax_o = graph.sdpa_fp8(q=made["q"], k=made["k"], v=made["v"], **scalars,
                                                   generate_stats=False, attn_scale=scale, use_causal_mask=False,
                                                   name="sdpa_fp8")
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(
            cudnn.data_type.FP8_E4M3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as e:  # noqa: BLE001  a peer that does not build is a row saying why
        return f"cuDNN: {type(e).__name__}: {str(e)[:160]}"
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=q.device)
    device_values = {name: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=q.device)
                     for name, value in values.items()}
    amaxes = [torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device) for _ in range(2)]
    pack = {made["q"]: q, made["k"]: k, made["v"]: v, o: out, amax_s: amaxes[0], amax_o: amaxes[1],
            **{scalars[name]: t for name, t in device_values.items()}}

    def run() -> torch.Tensor:
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        graph.execute(pack, workspace, handle=handle)
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--half-padded", action="store_true", help="key lengths from S/2 to S, not all S")
    parser.add_argument("--configs", default="all", choices=("all", "default", "one"),
                        help="tiles: all, the default build's three, or the first only")
    parser.add_argument("--rows", default="", help="only the rows whose names contain one of these (comma-separated)")
    args = parser.parse_args()
    device = torch.device("cuda")
    b, s = args.batch, args.seq
    g = torch.Generator(device=device).manual_seed(0)
    width = HEADS * HEAD_DIM
    # q, k spread as a trained layer's are (scores of a few units: peaked rows), v ~ N(0, 1)
    qkv = torch.cat([torch.randn(b, s, 2 * width, device=device, generator=g) * 1.6,
                     torch.randn(b, s, width, device=device, generator=g)], -1).half()
    q, k, v = heads_of(qkv)
    low = s // 2 if args.half_padded else s
    lengths = torch.randint(low, s + 1, (b,), device=device, generator=g, dtype=torch.int32)
    keep = torch.arange(s, device=device) < lengths.view(-1, 1, 1, 1)  # [B, 1, 1, S]
    mask = torch.where(keep, 0.0, -10000.0).half()
    scale = HEAD_DIM ** -0.5
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep, scale=scale)
    flops = 4 * b * HEADS * s * s * HEAD_DIM * (lengths.float().mean().item() / s)

    fp8 = Float8Scales(scale_of(q), scale_of(k), scale_of(v))
    out_scale = scale_of(reference)
    fp8_out = Float8Scales(fp8.q, fp8.k, fp8.v, out=out_scale)
    qkv8 = torch.cat([(t / sc).to(FP8_DTYPE) for t, sc in zip(qkv.float().split(width, -1), (fp8.q, fp8.k, fp8.v))],
                     -1)  # the E4M3 QKV output: [B, S, 3·768]
    q8, k8, v8 = heads_of(qkv8)
    v8_transposed = v8.transpose(-1, -2).contiguous().transpose(-1, -2)  # [B, H, S, D] view of [B, H, D, S] memory
    buffer16 = torch.empty(b, s, HEADS, HEAD_DIM, dtype=torch.float16, device=device)
    buffer8 = torch.empty(b, s, HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=device)
    as_bhsd = [0, 2, 1, 3]

    def kiln(qi, ki, vi, config: AttentionConfig, scales: Float8Scales | None, buffer: torch.Tensor):
        return lambda: flash_attention(qi, ki, vi, mask, lengths, scale=scale, out=buffer.permute(as_bhsd),
                                       config=config, fp8=scales)

    def dequantized(out: torch.Tensor, scales: Float8Scales) -> torch.Tensor:
        return out.float() * scales.out if out.dtype == FP8_DTYPE else out.float()

    configs = {"all": ATTENTION_CONFIGS, "default": ATTENTION_CONFIGS[:3], "one": ATTENTION_CONFIGS[:1]}[args.configs]
    rows: list[tuple[str, Callable[[], torch.Tensor] | str, Float8Scales | None]] = []
    for config in configs:
        rows.append((f"kiln fp16 {config.name}", kiln(q, k, v, config, None, buffer16), None))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        def sdpa(backend=getattr(torch.nn.attention.SDPBackend, backend)):
            with torch.nn.attention.sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qc, kc, vc, scale=scale)
        rows.append((f"torch SDPA {backend.split('_')[0].lower()} fp16, no mask, contiguous", sdpa, None))
    for config in configs:
        rows.append((f"kiln FP8 E4M3 -> fp16 {config.name}", kiln(q8, k8, v8, config, fp8, buffer16), fp8))
        rows.append((f"kiln FP8 E4M3, v transposed -> fp16 {config.name}",
                     kiln(q8, k8, v8_transposed, config, fp8, buffer16), fp8))
        rows.append((f"kiln FP8 E4M3, v transposed -> E4M3 {config.name}",
                     kiln(q8, k8, v8_transposed, config, fp8_out, buffer8), fp8_out))
    # the forms an FP8 engine's attention can take today (fp16 QKV GEMM output): all E4M3 (run 1: slowest, 0.172 ms),
    # q·kᵀ alone in E4M3 (p·v in fp16, v as it is)
    rows.append((f"kiln FP8 fp16 in (quantized on load) -> fp16 {configs[0].name}",
                 kiln(q, k, v, configs[0], fp8, buffer16), fp8))
    for config in configs:
        rows.append((f"kiln FP8 q·kᵀ only, fp16 in (q, k quantized on load), p·v fp16 {config.name}",
                     kiln(q, k, v, config, Float8Scales(fp8.q, fp8.k, 1.0, pv=False), buffer16), None))
    rows.append(("cuDNN SDPA FP8 E4M3 -> E4M3, no mask (all keys)", cudnn_fp8_sdpa([q8, k8, v8], fp8_out, scale),
                 fp8_out))

    wanted = [w for w in args.rows.split(",") if w]
    rows = [row for row in rows if not wanted or any(w in row[0] for w in wanted)]
    print(f"BERT-base attention, batch {b}, seq {s}, 12 heads, d 64, key lengths {lengths.min().item()}.."
          f"{lengths.max().item()}; scales q {fp8.q:.4g} k {fp8.k:.4g} v {fp8.v:.4g} out {out_scale:.4g}")

    def measure(name: str, fn: Callable[[], torch.Tensor], scales: Float8Scales | None) -> Callable[[], list[str]]:
        def cells() -> list[str]:  # ms, TFLOP/s, errors
            out = fn()
            torch.cuda.synchronize()
            got = dequantized(out, scales) if scales is not None else out.float()
            if got.shape != reference.shape:  # the engine's [B, S, H, D] buffer
                got = got.permute(as_bhsd)
            check = reference if "no mask" not in name else \
                F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)
            accuracy = errors(got, check)
            ms = graph_ms(fn)
            return [f"{ms:.4f}", f"{flops / ms / 1e9:.0f}", accuracy]
        return cells

    print_table(["layer", "ms", "TFLOP/s", "error vs fp32: max / mean (relative)"],
                [(name, fn if isinstance(fn, str) else measure(name, fn, scales)) for name, fn, scales in rows])


if __name__ == "__main__":
    main()
