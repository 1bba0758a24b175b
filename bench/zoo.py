"""The model zoo timed: kiln vs onnxruntime vs torch eager on the CPU, or kiln fp16 vs PyTorch on CUDA.

    python bench/zoo.py                          # every architecture's CI variant, CPU, 2 threads
    python bench/zoo.py --full                   # the full sizes (minutes per model to export, once)
    python bench/zoo.py --models bert_tiny,dcn_tiny --rounds 5 --no-write
    python bench/zoo.py --device cuda [--full] [--batch 32]   # kiln fp16 vs eager / compile / reduce-overhead

CPU (fp32): each model comes from the zoo (exported once, cached) with its example input; kiln and
onnxruntime get the same thread count (onnxruntime with all graph optimisations), torch eager runs
the module the ONNX file was exported from. kiln's outputs are compared with onnxruntime's before
anything is timed. The three are timed in interleaved rounds of blocks (kiln, onnxruntime, torch,
kiln, ...; see bench/cpu.py for why blocks): the latency is the median over every round's runs, and
kiln / onnxruntime is given per round too. Prints one table with the CPU model and its ISA, and
writes bench/results/zoo-cpu-<date>.md (appended when it exists).

CUDA (fp16, as bench/gpu.py): kiln builds the same ONNX file for the GPU in fp16; torch runs the
module in fp16 eager, under torch.compile and under torch.compile(mode="reduce-overhead"); kiln's
outputs are compared with eager fp32 and fp16 first; CUDA-event latency, median. The speed-up is
against the fastest PyTorch mode. Writes bench/results/zoo-cuda-<date>.md.

A model that fails (to export, build or run) is a row that says how, not the end of the run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from cpu import commit, tactic_summary, wait_for_quiet  # noqa: E402  bench/cpu.py

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.zoo.timing import SETTLE_S, Latency, peer_runners, time_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CPU_PEERS = ("kiln", "onnxruntime", "torch eager")
CUDA_PEERS = ("torch eager", "torch.compile", "reduce-overhead", "kiln")


@dataclass(frozen=True)
class Architecture:
    label: str
    ci: str  # zoo name of the small variant
    full: str  # zoo name of the full size (the same name when the model is small enough for CI)


ARCHITECTURES = [
    Architecture("MobileNetV2", "mobilenet_v2", "mobilenet_v2"),
    Architecture("ResNet", "resnet_tiny", "resnet50"),
    Architecture("EfficientNet", "efficientnet_tiny", "efficientnet_b0"),
    Architecture("ConvNeXt", "convnext_tiny", "convnext_t"),
    Architecture("RegNetY", "regnet_tiny", "regnet_y_040"),
    Architecture("ViT", "vit_tiny", "vit_b16"),
    Architecture("DeiT", "deit_tiny", "deit_small"),
    Architecture("Swin", "swin_tiny", "swin_t"),
    Architecture("MobileViT", "mobilevit_tiny", "mobilevit_s"),
    Architecture("YOLOS", "yolos_tiny", "yolos_ti"),
    Architecture("DETR", "detr_tiny", "detr_r50"),
    Architecture("BERT", "bert_tiny", "bert_base"),
    Architecture("MiniLM-L6", "minilm", "minilm"),
    Architecture("DistilBERT", "distilbert_tiny", "distilbert_base"),
    Architecture("RoBERTa", "roberta_tiny", "roberta_base"),
    Architecture("ALBERT", "albert_tiny", "albert_base"),
    Architecture("T5 encoder", "t5_encoder_tiny", "t5_small_encoder"),
    Architecture("T5 enc + dec prefill", "t5_tiny", "t5_small"),
    Architecture("GPT-2", "gpt2_tiny", "gpt2"),
    Architecture("Llama", "llama_tiny", "llama_small"),
    Architecture("Qwen2", "qwen2_tiny", "qwen2_small"),
    Architecture("Mistral", "mistral_tiny", "mistral_small"),
    Architecture("Phi-3", "phi3_tiny", "phi3_small"),
    Architecture("Whisper encoder", "whisper_encoder_tiny", "whisper_base_encoder"),
    Architecture("Wav2Vec2", "wav2vec2_tiny", "wav2vec2_base"),
    Architecture("LSTM forecaster", "lstm_forecaster", "lstm_forecaster"),
    Architecture("BiLSTM forecaster", "bilstm_forecaster", "bilstm_forecaster"),
    Architecture("GRU forecaster", "gru_forecaster", "gru_forecaster"),
    Architecture("1D-CNN", "cnn1d", "cnn1d"),
    Architecture("Causal TCN", "tcn", "tcn"),
    Architecture("DCN recommender", "dcn_tiny", "dcn"),
]


def selected(full: bool, names: str | None) -> list[tuple[str, str]]:
    """(label, zoo name) of each model to run: every architecture's CI variant or full size, or the
    zoo names asked for (which may mix both)."""
    if names:
        labels = {n: a.label for a in ARCHITECTURES for n in (a.ci, a.full)}
        rows = []
        for name in names.split(","):
            name = name.strip()
            zoo.get(name)  # a KeyError listing the zoo's names when it is not one
            rows.append((labels.get(name, name), name))
        return rows
    return [(a.label, a.full if full else a.ci) for a in ARCHITECTURES]


def input_text(exported: zoo.Export) -> str:
    return ", ".join(f"{k} {'x'.join(map(str, v['shape']))}" for k, v in exported.meta["inputs"].items())


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The largest |got - want| over every output, each relative to max(1, its |want| max)."""
    return max(float(np.abs(g.astype(np.float64) - w).max()) / max(1.0, float(np.abs(w).max()))
               for g, w in zip(got, want))


# --------------------------------------------------------------------------------------------- CPU

@dataclass
class CpuRow:
    label: str
    name: str
    input: str = ""
    latency: dict[str, Latency] = field(default_factory=dict)
    kiln_over_ort_by_round: list[float] = field(default_factory=list)
    max_error: float = 0.0  # kiln vs onnxruntime, relative to max(1, |onnxruntime|)
    build_s: float = 0.0
    tactics: str = ""
    error: str | None = None


def run_cpu(label: str, name: str, args) -> CpuRow:
    import torch

    row = CpuRow(label, name)
    exported = zoo.export(name, batch=args.batch)
    row.input = input_text(exported)
    feeds = exported.inputs()
    torch.set_num_threads(args.threads)  # tactics are tuned at the thread count they will run with
    wait_for_quiet(args.quiet_wait)
    start = time.perf_counter()
    engine = kiln.build(str(exported.path), timing_cache=args.timing_cache or None)
    row.build_s = time.perf_counter() - start
    row.tactics = tactic_summary(engine.plan.header)
    runners = peer_runners(name, exported.path, feeds, threads=args.threads, engine=engine)
    got = runners["kiln"]()
    row.max_error = relative_error([got[n] for n in engine.output_names], runners["onnxruntime"]())

    samples: dict[str, list[float]] = {p: [] for p in CPU_PEERS}
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    for _ in range(args.rounds):
        medians = {}
        for peer in CPU_PEERS:
            wait_for_quiet(args.quiet_wait)
            block = time_samples(runners[peer], iterations=max(1, args.iterations // args.rounds),
                                 warmup=args.warmup, budget_s=args.budget / len(CPU_PEERS) / args.rounds, min_runs=5,
                                 clock=clock, settle_s=SETTLE_S)  # onnxruntime's worker stops spinning first
            samples[peer] += block
            medians[peer] = float(np.median(block))
        row.kiln_over_ort_by_round.append(medians["kiln"] / medians["onnxruntime"])
    row.latency = {p: Latency(float(np.median(v)), float(np.percentile(v, 90)), len(v)) for p, v in samples.items()}
    return row


def cpu_table(rows: list[CpuRow]) -> list[str]:
    header = ["model", "zoo name", "input", *(f"{p} ms" for p in CPU_PEERS), "kiln / ort", "kiln / torch",
              "kiln / ort by round", "max err vs ort", "kiln build s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | {r.name} | {r.input} | failed: {r.error} |" + " |" * (len(header) - 4))
            continue
        kiln_ms = r.latency["kiln"].median_ms
        cells = [r.label, r.name, r.input, *(f"{r.latency[p].median_ms:.3g}" for p in CPU_PEERS),
                 f"**{kiln_ms / r.latency['onnxruntime'].median_ms:.2f}x**",
                 f"{kiln_ms / r.latency['torch eager'].median_ms:.2f}x",
                 ", ".join(f"{x:.2f}" for x in r.kiln_over_ort_by_round), f"{r.max_error:.1e}", f"{r.build_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cpu_summary(rows: list[CpuRow]) -> str:
    timed = [r for r in rows if not r.error]
    ratios = [r.latency["kiln"].median_ms / r.latency["onnxruntime"].median_ms for r in timed]
    if not ratios:
        return "no model was timed"
    behind = [r.label for r, x in zip(timed, ratios) if x > 1.0]
    return (f"kiln / onnxruntime over {len(ratios)} models: geometric mean {np.exp(np.mean(np.log(ratios))):.2f}x, "
            f"best {min(ratios):.2f}x, worst {max(ratios):.2f}x; kiln slower on {len(behind)}: "
            + (", ".join(behind) or "none") + f"; failed: {', '.join(r.name for r in rows if r.error) or 'none'}")


def main_cpu(args) -> list[str]:
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    load_before = os.getloadavg()[0]
    print(f"kiln {kiln.__version__} zoo CPU benchmark: {cpu_name()} ({isa}), {args.threads} thread(s), fp32; "
          f"load average {load_before:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for label, name in selected(args.full, args.models):
        try:
            row = run_cpu(label, name, args)
        except Exception as e:  # noqa: BLE001  one failing model must not hide the others
            traceback.print_exc()
            row = CpuRow(label, name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        rows.append(row)
        if row.error:
            print(f"  {label:<20} {name:<22} FAILED {row.error}", flush=True)
        else:
            lat = row.latency
            print(f"  {label:<20} {name:<22} kiln {lat['kiln'].median_ms:8.3f} ms, onnxruntime "
                  f"{lat['onnxruntime'].median_ms:8.3f}, torch {lat['torch eager'].median_ms:8.3f}: kiln / ort "
                  f"{lat['kiln'].median_ms / lat['onnxruntime'].median_ms:.2f} (by round "
                  f"{', '.join(f'{x:.2f}' for x in row.kiln_over_ort_by_round)}), max err {row.max_error:.1e}",
                  flush=True)
        gc.collect()
    load_after = os.getloadavg()[0]
    lines = cpu_table(rows) + ["", cpu_summary(rows), ""]
    lines += [f"- {r.label} ({r.name}) tactics: {r.tactics}" for r in rows if not r.error]
    print("\n" + "\n".join(lines))
    if args.no_write:
        return lines
    now = datetime.datetime.now(datetime.timezone.utc)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "onnxruntime", "onnx", "transformers")}
    contended = max(load_before, load_after) > args.threads + 0.5
    warning = (["**Contended run**: other processes shared the CPU (see the load below); every latency is "
                "inflated, torch's OpenMP threads (kiln, torch eager) more than onnxruntime's pool, and the "
                "per-round ratios scatter. Re-run on an idle machine before drawing conclusions.", ""]
               if contended else [])
    write_results(results_file(args, "cpu", now), [
        f"kiln zoo CPU benchmark, {now:%Y-%m-%d %H:%M} UTC ({'models ' + args.models if args.models else 'full sizes' if args.full else 'CI variants'})",
        "",
        *warning,
        f"- device: {cpu_name()} ({platform.machine()}, {isa}), {args.threads} thread(s) for every runtime",
        f"- commit: {commit()}; kiln {kiln.__version__}; " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- fp32, latency in ms ({'CPU time of the calling thread' if args.clock == 'thread' else 'wall time'}): median of every run of {args.rounds} interleaved rounds of blocks (kiln, "
        f"onnxruntime, torch eager, kiln, ...), each block {args.warmup} warm-up runs then up to "
        f"{max(1, args.iterations // args.rounds)} runs ({args.budget:.0f} s per model at most); 'by round': kiln / "
        "onnxruntime of each round's block medians",
        f"- machine load (1-min load average) {load_before:.2f} before, {load_after:.2f} after, on "
        f"{os.cpu_count()} cores",
        "- onnxruntime: CPUExecutionProvider, ORT_ENABLE_ALL; torch eager: inference_mode; kiln: kiln.build "
        f"defaults, timing cache {args.timing_cache or 'none'}",
        "- models: kiln.zoo (kiln/zoo/models.py), random weights except MobileNetV2 and MiniLM; 'max err vs ort': "
        "kiln's largest output difference from onnxruntime's on the example input, relative to max(1, |output|)",
        "",
        *lines,
        "",
        "Ratios < 1: kiln is faster.",
        "",
    ])
    return lines


def results_file(args, device: str, when: datetime.datetime) -> Path:
    """bench/results/zoo-<device>[-<tag>]-<date>.md (--tag names a variant of the run, e.g. avx2)."""
    return args.results / f"zoo-{device}{'-' + args.tag if args.tag else ''}-{when:%Y-%m-%d}.md"


def write_results(path: Path, lines: list[str]) -> None:
    """One file per day; a later run of the same day is appended as its own section."""
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = path.read_text() if path.exists() else ""
    title = ("## " if earlier else "# ") + lines[0]
    path.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join([title, *lines[1:]]))
    print(f"\nwrote {path}")


# -------------------------------------------------------------------------------------------- CUDA

@dataclass
class CudaRow:
    label: str
    name: str
    input: str = ""
    ms: dict[str, float | None] = field(default_factory=dict)  # CUDA_PEERS -> median ms (None: failed)
    error_vs_fp32: float = 0.0  # kiln fp16 vs torch eager fp32, relative to max(1, |fp32|)
    torch_fp16_vs_fp32: float = 0.0  # what fp16 itself costs, for scale
    build_s: float = 0.0
    error: str | None = None

    def speedup(self) -> float | None:
        torch_ms = [v for k, v in self.ms.items() if k != "kiln" and v]
        return min(torch_ms) / self.ms["kiln"] if torch_ms and self.ms.get("kiln") else None


def tensors(feeds: dict[str, np.ndarray], device: str, half: bool) -> dict:
    """numpy feeds -> torch tensors on `device`; floating ones in fp16 when `half` (ids stay int64)."""
    import torch

    out = {}
    for k, v in feeds.items():
        t = torch.from_numpy(v).to(device)
        out[k] = t.half() if half and t.is_floating_point() else t
    return out


def as_list(outputs) -> list:
    """A zoo module's outputs (one tensor or a tuple) as a list of fp32 tensors."""
    return [o.float() for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]


def relative_error_torch(got: list, want: list) -> float:
    return max(float((g - w).abs().max()) / max(1.0, float(w.abs().max())) for g, w in zip(got, want))


def run_cuda(label: str, name: str, args) -> CudaRow:
    import torch
    from gpu import time_cuda  # bench/gpu.py: CUDA events around each call, after warm-up

    row = CudaRow(label, name)
    exported = zoo.export(name, batch=args.batch, seq=args.seq)
    row.input = input_text(exported)
    feeds = exported.inputs()
    module = zoo.torch_model(name).cuda()
    inputs32, inputs16 = tensors(feeds, "cuda", half=False), tensors(feeds, "cuda", half=True)
    with torch.inference_mode():
        ref32 = as_list(module(**inputs32))
    module = module.half()  # outside inference mode: its weights stay usable by torch.compile
    with torch.inference_mode():
        ref16 = as_list(module(**inputs16))
        row.torch_fp16_vs_fp32 = relative_error_torch(ref16, ref32)
        row.ms["torch eager"] = statistics.median(time_cuda(lambda: module(**inputs16)))
    for peer, mode in (("torch.compile", None), ("reduce-overhead", "reduce-overhead")):
        if args.no_compile or (mode or "default") not in args.torch_modes.split(","):
            continue
        torch._dynamo.reset()
        try:
            compiled = torch.compile(module, mode=mode) if mode else torch.compile(module)
            with torch.inference_mode():
                row.ms[peer] = statistics.median(time_cuda(lambda: compiled(**inputs16)))
        except Exception as e:  # noqa: BLE001  a failing peer is reported, not fatal
            print(f"  {name}: {peer} failed: {type(e).__name__}: {e}", flush=True)
            row.ms[peer] = None
    start = time.perf_counter()
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16")
    row.build_s = time.perf_counter() - start
    context = engine.create_execution_context()
    got = context.run(inputs32)  # the engine casts its fp32 inputs to fp16 itself
    row.error_vs_fp32 = relative_error_torch(as_list([got[n] for n in engine.output_names]), ref32)
    row.ms["kiln"] = statistics.median(time_cuda(lambda: context.run(inputs32)))
    return row  # the engine and the module go with this frame; main_cuda empties the CUDA cache


def cuda_table(rows: list[CudaRow]) -> list[str]:
    header = ["model", "zoo name", "input", *(f"{p} ms" for p in CUDA_PEERS), "kiln vs fastest torch",
              "kiln err vs fp32", "torch fp16 err vs fp32", "kiln build s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | {r.name} | {r.input} | failed: {r.error} |" + " |" * (len(header) - 4))
            continue
        speedup = r.speedup()
        cells = [r.label, r.name, r.input, *("—" if r.ms.get(p) is None else f"{r.ms[p]:.3f}" for p in CUDA_PEERS),
                 "—" if speedup is None else f"**{speedup:.2f}x**", f"{r.error_vs_fp32:.1e}",
                 f"{r.torch_fp16_vs_fp32:.1e}", f"{r.build_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main_cuda(args) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/zoo.py --device cuda needs a CUDA GPU (torch.cuda.is_available() is False); "
                         "run the CPU benchmark without --device")
    device = torch.cuda.get_device_name()
    print(f"kiln {kiln.__version__} zoo CUDA benchmark: {device}, fp16", flush=True)
    rows = []
    for label, name in selected(args.full, args.models):
        try:
            row = run_cuda(label, name, args)
        except Exception as e:  # noqa: BLE001  one failing model must not hide the others
            traceback.print_exc()
            row = CudaRow(label, name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row)
        if args.jsonl:
            with open(args.jsonl, "a") as f:  # a row at a time: a run cut short keeps what it measured
                f.write(json.dumps({**asdict(row), "batch": args.batch, "seq": args.seq, "commit": commit(),
                                    "device": device}) + "\n")
        speedup = row.speedup()
        print(f"  {label:<20} {name:<22} " + (f"FAILED {row.error}" if row.error else
              ", ".join(f"{p} {'—' if row.ms.get(p) is None else f'{row.ms[p]:.3f}'}" for p in CUDA_PEERS)
              + (f": {speedup:.2f}x the fastest PyTorch mode" if speedup else "")), flush=True)
    lines = cuda_table(rows)
    print("\n" + "\n".join(lines))
    if not args.no_write:
        now = datetime.datetime.now(datetime.timezone.utc)
        write_results(results_file(args, "cuda", now), [
            f"kiln zoo CUDA benchmark, {now:%Y-%m-%d %H:%M} UTC ({'models ' + args.models if args.models else 'full sizes' if args.full else 'CI variants'})",
            "",
            f"- device: {device}; commit {commit()}; kiln {kiln.__version__}; torch {torch.__version__}",
            "- fp16; median latency in ms (CUDA events, after warm-up); kiln: kiln.build(device='cuda', "
            "precision='fp16') of the zoo's ONNX export; torch: the same module in fp16; errors relative to "
            "max(1, |torch eager fp32|)",
            "",
            *lines,
            "",
        ])
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--full", action="store_true", help="the full sizes instead of the CI variants")
    parser.add_argument("--models", help="comma-separated zoo names (overrides --full)")
    parser.add_argument("--batch", type=int, help="batch of every model (default: each zoo model's own)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every runtime")
    parser.add_argument("--rounds", type=int, default=3, help="CPU: interleaved rounds of blocks per model")
    parser.add_argument("--iterations", type=int, default=60, help="CPU: timed runs per runtime over all rounds")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget", type=float, default=30.0, help="CPU: seconds of timed blocks per model at most")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="CPU: 'thread' times the calling thread's CPU time (with --threads 1 every runtime "
                             "runs there: what each costs on a machine others load, without the time it waits)")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="CPU: before each block, wait up to this many seconds for the machine to go idle")
    parser.add_argument("--timing-cache", default=str(zoo.cache_dir().parent / "timing-cache-cpu.json"),
                        help="CPU: kiln's tactic timing cache; '' for none")
    parser.add_argument("--seq", type=int, help="CUDA: sequence length of every text model (default: each one's own)")
    parser.add_argument("--no-compile", action="store_true", help="CUDA: skip the torch.compile peers")
    parser.add_argument("--torch-modes", default="default,reduce-overhead",
                        help="CUDA: which torch.compile modes run as peers (eager always does); at batch 1 "
                             "reduce-overhead is the fastest PyTorch mode, at large batch eager or default")
    parser.add_argument("--jsonl", help="CUDA: append each model's row to this JSON-lines file as it is measured")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the results file")
    parser.add_argument("--no-write", action="store_true", help="print only, write no results file")
    parser.add_argument("--tag", default="", help="results file zoo-<device>-<tag>-<date>.md (a variant of the run)")
    args = parser.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1: at more threads the calling thread's CPU time leaves out "
                     "the workers' share")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    return main_cuda(args) if args.device == "cuda" else main_cpu(args)


if __name__ == "__main__":
    main()
