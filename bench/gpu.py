"""kiln vs PyTorch on one GPU, side by side in one run (fp16, same inputs).

    python bench/gpu.py [--models resnet50_b1,bert_b1,...] [--no-compile] [--out DIR]

For each row: torch eager, torch.compile (default), torch.compile(mode="reduce-overhead"),
and kiln (ONNX export of the same fp32 module -> kiln.build(device="cuda", precision="fp16")).
Correctness first: kiln's output is compared with eager fp16 (and eager fp32) before timing.
Latency: CUDA events around each call, warm-up, median of the timed calls. The speed-up is
against the fastest PyTorch mode on the row. Prints a table last; writes a markdown copy.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kiln  # noqa: E402


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def make(name: str):
    """-> (fp32 CPU module, example inputs tuple (fp32 / int64 on CPU), description)."""
    tf = _transformers()
    g = torch.Generator().manual_seed(0)
    if name.startswith("resnet50"):
        b = 1 if name.endswith("b1") else 256
        m = tf.ResNetForImageClassification(tf.ResNetConfig())
        return m, (torch.randn(b, 3, 224, 224, generator=g),), f"ResNet-50 batch {b}"
    if name.startswith("mobilenetv2"):
        m = tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config())
        for module in m.modules():  # HF's std-0.02 init makes the logits ~1e-21: useless for error checks
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                module.reset_parameters()
        return m, (torch.randn(1, 3, 224, 224, generator=g),), "MobileNetV2 batch 1"
    if name.startswith("bert"):
        b, s = (1, 128) if name.endswith("b1") else (64, 384)
        m = tf.BertModel(tf.BertConfig(), add_pooling_layer=False)
        ids = torch.randint(0, 30000, (b, s), generator=g)
        return m, (ids, padding_mask(b, s, g)), f"BERT-base batch {b} seq {s}"
    if name.startswith("vit"):
        m = tf.ViTModel(tf.ViTConfig(), add_pooling_layer=False)
        return m, (torch.randn(64, 3, 224, 224, generator=g),), "ViT-B/16 batch 64"
    if name.startswith("gpt2"):
        m = tf.GPT2Model(tf.GPT2Config(use_cache=False))
        ids = torch.randint(0, 50000, (8, 512), generator=g)
        return m, (ids, padding_mask(8, 512, g)), "GPT-2 small prefill batch 8 seq 512"
    raise ValueError(name)


def padding_mask(batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """The attention_mask users feed: ones, and for rows after the first a padded tail (a batch of
    sentences of different lengths); int64, as tokenizers give it."""
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(1, batch):
        mask[row, int(torch.randint(seq // 2, seq + 1, (1,), generator=g)):] = 0
    return mask


class FirstOutput(torch.nn.Module):
    """Wraps a HF model so that it returns one tensor (logits or last hidden state); text models
    take the attention mask as users pass it."""

    def __init__(self, m):
        super().__init__()
        self.m = m.eval()

    def forward(self, x, mask=None):
        out = self.m(x) if mask is None else self.m(x, attention_mask=mask)
        return out[0] if isinstance(out, (tuple, list)) else (getattr(out, "logits", None) if getattr(out, "logits", None) is not None else out.last_hidden_state)


def time_cuda(fn, warmup: int = 10, iters: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_ms(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Milliseconds per call: `calls` calls captured in one CUDA graph, median over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()  # Triton compiles, cuDNN plans, workspaces are allocated outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def bench_row(name: str, compile_peers: bool, log, profile: bool = False) -> dict:
    module, inputs, desc = make(name)
    module = FirstOutput(module)
    row: dict = {"name": name, "desc": desc}
    dev_inputs16 = tuple(x.cuda().half() if x.is_floating_point() else x.cuda() for x in inputs)
    dev_inputs32 = tuple(x.cuda() for x in inputs)
    with torch.inference_mode():
        ref32 = module.cuda()(*dev_inputs32).float()
    m16 = module.half()

    with torch.inference_mode():
        ref16 = m16(*dev_inputs16).float()
        row["eager"] = statistics.median(time_cuda(lambda: m16(*dev_inputs16)))
    log(f"{name}: eager {row['eager']:.3f} ms")
    if compile_peers:
        for mode, key in ((None, "compile"), ("reduce-overhead", "reduce_overhead")):
            torch._dynamo.reset()
            t0 = time.perf_counter()
            try:
                cm = torch.compile(m16, mode=mode) if mode else torch.compile(m16)
                with torch.inference_mode():
                    cm(*dev_inputs16)
                    torch.cuda.synchronize()
                    row[key + "_build_s"] = time.perf_counter() - t0
                    row[key] = statistics.median(time_cuda(lambda: cm(*dev_inputs16)))
                log(f"{name}: {key} {row[key]:.3f} ms (compile {row[key + '_build_s']:.1f} s)")
            except Exception as e:  # noqa: BLE001  a failing peer is reported, not fatal
                row[key] = None
                log(f"{name}: {key} failed: {type(e).__name__}: {e}")
    # kiln: export the fp32 module, build for this GPU in fp16, run with CUDA graphs.
    m32 = module.float().cpu()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        t0 = time.perf_counter()
        names = ["x", "mask"][:len(inputs)]
        torch.onnx.export(m32, inputs, path, dynamo=True, input_names=names, output_names=["y"], verbose=False)
        row["export_s"] = time.perf_counter() - t0
        cache = os.path.join(tmp, "timing.cache")
        t0 = time.perf_counter()
        engine = kiln.build(path, device="cuda", precision="fp16", timing_cache=cache)
        row["kiln_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rebuilt = kiln.build(path, device="cuda", precision="fp16", timing_cache=cache)
        row["kiln_rebuild_s"] = time.perf_counter() - t0
        same = [s.tactic for s in rebuilt.plan.program.steps] == [s.tactic for s in engine.plan.program.steps]
        log(f"{name}: rebuild with the warm timing cache {row['kiln_rebuild_s']:.1f} s, same tactics: {same}")
        del rebuilt
    log(f"{name}: exported in {row['export_s']:.1f} s, kiln build {row['kiln_build_s']:.1f} s, "
        f"{len(engine.plan.program.steps)} layers")
    ctx = engine.create_execution_context()
    feeds = dict(zip(["x", "mask"], dev_inputs32))
    out = ctx.run(feeds)["y"].float()
    err16 = (out - ref16).abs().max().item()
    err32 = (out - ref32).abs().max().item()
    scale = ref32.abs().max().item()
    row["max_err_vs_fp16"], row["max_err_vs_fp32"], row["ref_scale"] = err16, err32, scale
    log(f"{name}: kiln max |err| vs eager fp16 {err16:.3g}, vs fp32 {err32:.3g} (|ref| max {scale:.3g})")
    reasons = {str(k): e.reason for k, e in ctx.runner.entries.items() if e.reason}
    if reasons:
        log(f"{name}: CUDA graph not used: {reasons}")
    row["kiln"] = statistics.median(time_cuda(lambda: ctx.run(feeds)))
    if name in ("resnet50_b1", "bert_b1"):  # the worst call matters for a control loop: p99/p50 over 2,000
        calls = sorted(time_cuda(lambda: ctx.run(feeds), warmup=50, iters=2000))
        row["p99_p50"] = calls[int(0.99 * (len(calls) - 1))] / calls[len(calls) // 2]
        log(f"{name}: kiln p50 {calls[len(calls) // 2]:.3f} ms, p99 {calls[int(0.99 * (len(calls) - 1))]:.3f} ms, "
            f"p99/p50 {row['p99_p50']:.2f} over {len(calls)} calls")
    if profile:
        from kiln.runtime.profiler import profile_layers

        layers = profile_layers(engine.program, engine.program_inputs(feeds))
        by_op: dict[str, float] = {}
        for layer in layers:
            key = f"{layer['op_type']} [{layer['tactic']}]"
            by_op[key] = by_op.get(key, 0.0) + layer["ms"]
        log(f"{name}: per-layer profile (eager, no graph): total {sum(l['ms'] for l in layers):.3f} ms")
        for key, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:10]:
            log(f"    {ms:8.3f} ms  {key}")
        for layer in sorted(layers, key=lambda l: -l["ms"])[:6]:
            log(f"    top layer {layer['ms']:7.3f} ms  {layer['name']} {layer['op_type']} [{layer['tactic']}]")
    peers = [row.get(k) for k in ("eager", "compile", "reduce_overhead") if row.get(k)]
    row["speedup"] = min(peers) / row["kiln"]
    log(f"{name}: kiln {row['kiln']:.3f} ms, {row['speedup']:.2f}x the fastest PyTorch mode")
    del engine, ctx, m16, module
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50_b1,mobilenetv2_b1,bert_b1,resnet50_b256,bert_b64,vit_b64,gpt2_b8")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also print kiln's per-layer time by op and tactic")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    logf = open(os.path.join(args.out, "gpu_bench.log"), "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    rows = []
    for name in args.models.split(","):
        try:
            rows.append(bench_row(name, not args.no_compile, log, args.profile))
        except Exception as e:  # noqa: BLE001  one failing row must not hide the others
            log(f"{name}: FAILED {type(e).__name__}: {e}")
            logf.write(traceback.format_exc())
            rows.append({"name": name, "desc": name, "error": f"{type(e).__name__}: {str(e)[:80]}"})
    commit = os.environ.get("KILN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        f"# kiln vs PyTorch, {torch.cuda.get_device_name()}, torch {torch.__version__}, fp16",
        f"commit {commit or '?'}, {datetime.date.today().isoformat()}; median latency in ms (CUDA events)",
        "",
        "| workload | eager | compile | reduce-overhead | kiln | kiln vs fastest | max err vs fp32 (|ref|) | kiln build s (warm cache) | compile s (reduce-overhead) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['desc']} | failed: {r['error']} |||||||")
            continue
        lines.append(
            f"| {r['desc']} | {fmt(r.get('eager'))} | {fmt(r.get('compile'))} | {fmt(r.get('reduce_overhead'))} | "
            f"{fmt(r['kiln'])} | {r['speedup']:.2f}× | {r['max_err_vs_fp32']:.2g} ({r['ref_scale']:.2g}) | "
            f"{r['kiln_build_s']:.1f} ({r['kiln_rebuild_s']:.1f}) | {r.get('compile_build_s', 0):.1f} "
            f"({r.get('reduce_overhead_build_s', 0):.1f}) |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
