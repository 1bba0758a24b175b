"""INT8 on the CPU: kiln fp32 / kiln int8 / onnxruntime fp32 / onnxruntime int8, side by side.

    python bench/quant.py                         # ResNet-50, MobileNetV2 (batch 1), BERT-base, MiniLM-L6, BERT-tiny (seq 128)
    python bench/quant.py --models mobilenet_v2 --rounds 3 --no-write
    python bench/quant.py --models bert_base --batch 8     # every model at batch 8
    python bench/quant.py --models mobilenet_v2 --threads 1 --clock thread --avx2   # every peer capped to AVX2

Per model (kiln.zoo; MobileNetV2 and MiniLM-L6 have their real weights, ResNet-50 and the BERTs random ones):

    kiln fp32          kiln.build of the fp32 ONNX file
    kiln int8          kiln.build(precision="int8", calibration=...): kiln's own post-training quantization
                       (entropy calibrator), each quantized layer on the int8 kernel or its float layer,
                       whichever the autotuner timed faster
    kiln int8 (ORT QDQ) kiln.build of onnxruntime's QDQ model below: the same quantized graph onnxruntime runs
    onnxruntime fp32   ORT_ENABLE_ALL
    onnxruntime int8   onnxruntime's quantize_static QDQ model (MinMax, uint8 activations, per-channel int8
                       weights with reduce_range: 7-bit, as onnxruntime advises for AVX2 without VNNI; BERT: its
                       MatMul/Gemm layers), ORT_ENABLE_ALL (its QLinear*/integer kernels)

Calibration: image models on 8 crops/flips of scikit-image's photographs, held-out crops for the accuracy
column (top-1 agreement with kiln fp32); BERT on random token sequences, accuracy = the smallest cosine of
the last hidden state to kiln fp32's over the held-out ones. Timing: interleaved rounds of blocks (every
peer once per round, same thread count), the latency is the median over every round's runs; the ratios are
given per round, with the machine's load, because this CPU is shared. Writes
bench/results/quant-cpu-<date>.md (appended when it exists).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # every peer on an AVX2-only CPU (bench/zoo_avx2.py's caps), set before any library loads
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from cpu import commit, cpu_busy  # noqa: E402  bench/cpu.py

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402
from kiln.quant.data import imagenet  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}  # thread: one thread's CPU time (--threads 1)
PEERS = ("kiln fp32", "kiln int8", "kiln int8 (ORT QDQ)", "onnxruntime fp32", "onnxruntime int8")
MODELS = {"resnet50": ("ResNet-50", None), "mobilenet_v2": ("MobileNetV2", None), "bert_base": ("BERT-base", 128),
          "minilm": ("MiniLM-L6", 128), "bert_tiny": ("BERT-tiny", 128)}
PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "cat", "camera", "hubble_deep_field", "immunohistochemistry",
          "retina", "colorwheel", "brick", "grass", "gravel", "clock", "coins", "moon"]


@dataclass
class Row:
    label: str
    name: str
    samples: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PEERS})
    by_round: list[dict[str, float]] = field(default_factory=list)
    accuracy: dict[str, str] = field(default_factory=dict)
    build_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    error: str | None = None


def photographs(count: int, seed: int) -> list[np.ndarray]:
    """Crops (half to all of each side) and flips of scikit-image's photographs, ImageNet-preprocessed."""
    import skimage.data

    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        image = getattr(skimage.data, PHOTOS[len(out) % len(PHOTOS)])()
        h, w = image.shape[:2]
        s = rng.uniform(0.5, 1.0)
        ch, cw = int(h * s), int(w * s)
        y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        crop = image[y:y + ch, x:x + cw][:, ::-1 if len(out) % 2 else 1]
        out.append(imagenet(np.ascontiguousarray(crop)))
    return out


def inputs_for(exported: zoo.Export, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    example = exported.inputs()
    if "pixel_values" in example:
        batch = example["pixel_values"].shape[0]
        crops = photographs(count * batch, seed)
        return [{"pixel_values": np.concatenate(crops[i * batch:(i + 1) * batch])} for i in range(count)]
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        feed = {}
        for name, value in example.items():
            if name == "input_ids":  # within the vocabulary (BERT-tiny's is 1,024 tokens)
                spec = zoo.get(exported.name)
                vocab = spec.vocab_size or spec.config.get("vocab_size") or 20000
                feed[name] = rng.integers(min(100, vocab // 10), min(20000, vocab), value.shape).astype(value.dtype)
            elif name == "token_type_ids":
                feed[name] = np.zeros_like(value)
            else:
                feed[name] = np.ones_like(value)
        feeds.append(feed)
    return feeds


class _Reader:
    def __init__(self, batches):
        self._items = iter(batches)

    def get_next(self):
        return next(self._items, None)


def ort_qdq(path: Path, calibration: list[dict], out: Path, text: bool) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    reader = type("Reader", (_Reader, CalibrationDataReader), {})(calibration)
    quantize_static(str(path), str(out), reader, quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                    calibrate_method=CalibrationMethod.MinMax,
                    op_types_to_quantize=["MatMul", "Gemm"] if text else None)


def onnxruntime_qdq(model: str, prefix: str) -> tuple[str, zoo.Export, Path]:
    """(label, the zoo's float export at batch 1, onnxruntime's QDQ model of it calibrated on 8 inputs) for the A/B
    benches of one MODELS entry; the QDQ file in a fresh temporary folder named `prefix`."""
    label, seq = MODELS[model]
    exported = zoo.export(model, batch=1, seq=seq) if seq else zoo.export(model, batch=1)
    qdq = Path(tempfile.mkdtemp(prefix=prefix)) / f"{model}-qdq.onnx"
    ort_qdq(exported.path, inputs_for(exported, 8, seed=1), qdq, seq is not None)
    return label, exported, qdq


def first_output(outputs) -> np.ndarray:
    """A run's first output as an array: kiln's dict or onnxruntime's list."""
    return np.asarray(next(iter(outputs.values())) if isinstance(outputs, dict) else outputs[0])


def ratio_cells(medians: dict[str, list[float]], *pairs: tuple[str, str]) -> str:
    """A table's cells, one per (a, b) pair: a / b in each round of rotated_rounds' medians, the median ratio in bold,
    then every round's."""
    cells = []
    for a, b in pairs:
        per = [x / y for x, y in zip(medians[a], medians[b])]
        cells.append(f"**{np.median(per):.2f}** ({', '.join(f'{v:.2f}' for v in per)})")
    return " | ".join(cells)


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def accuracy(runs: dict, reference, held_out: list[dict], text: bool) -> dict[str, str]:
    """Top-1 agreement (images) or the smallest cosine (text) of each int8 peer with kiln fp32."""
    want = [reference(f) for f in held_out]
    found = {}
    for peer, fn in runs.items():
        got = [fn(f) for f in held_out]
        if text:
            cos = [float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(got, want)]
            found[peer] = f"cos {min(cos):.4f}"
        else:
            agree = np.mean([a.argmax() == b.argmax() for a, b in zip(got, want)])
            found[peer] = f"top-1 {agree * 100:.0f}% of {len(want)}"
    return found


def rotated_rounds(runs: dict, peers: tuple[str, ...], feed, *, rounds: int, iterations: int, budget: float,
                   clock=time.perf_counter, label: str = "") -> tuple[dict[str, list[float]], list[float]]:
    """Interleaved A/B rounds (bench/quant_threads_ab.py, quant_fuse_ab.py): each round times every peer on `feed`,
    the order rotated by one a round, and prints the round. Returns each peer's median ms per round and the 1-min load
    at each round's start."""
    medians: dict[str, list[float]] = {p: [] for p in peers}
    loads: list[float] = []
    for r in range(rounds):
        order = peers[r % len(peers):] + peers[:r % len(peers)]
        loads.append(os.getloadavg()[0])
        for peer in order:
            block = time_samples(lambda: runs[peer](feed), iterations=iterations, warmup=5, budget_s=budget,
                                 min_runs=10, clock=clock)
            medians[peer].append(float(np.median(block)))
        print(f"  {label}round {r}: load {loads[-1]:.1f}, " + ", ".join(f"{p} {medians[p][-1]:.3f}" for p in peers),
              flush=True)
    return medians, loads


def run_model(name: str, args) -> Row:
    import torch

    label, seq = MODELS[name]
    row = Row(label if args.batch == 1 else f"{label} batch {args.batch}", name)
    exported = zoo.export(name, batch=args.batch, seq=seq) if seq else zoo.export(name, batch=args.batch)
    text = seq is not None
    torch.set_num_threads(args.threads)
    calibration = inputs_for(exported, args.calibration, seed=1)
    held_out = inputs_for(exported, args.held_out, seed=2)
    work = Path(tempfile.mkdtemp(prefix="kiln-quant-"))
    qdq = work / f"{name}-qdq.onnx"
    start = time.perf_counter()
    ort_qdq(exported.path, calibration, qdq, text)
    row.build_s["onnxruntime quantize_static"] = time.perf_counter() - start
    engines = {}
    for peer, build in (("kiln fp32", lambda: kiln.build(str(exported.path))),
                        ("kiln int8", lambda: kiln.build(str(exported.path), precision="int8", calibration=calibration,
                                                         calibrator=args.calibrator)),
                        ("kiln int8 (ORT QDQ)", lambda: kiln.build(str(qdq)))):
        start = time.perf_counter()
        engines[peer] = build()
        row.build_s[peer] = time.perf_counter() - start
        layers = (engines[peer].plan.header.get("quantization") or {}).get("layers") or {}
        if layers:
            ran = [v["precision"] for v in layers.values()]
            row.notes.append(f"{peer}: {len(ran)} quantized layers, " + ", ".join(
                f"{ran.count(p)} {p}" for p in sorted(set(ran))) + "".join(
                f"; {name}: {v['precision']} on {v['tactic']} ({v['why']})" for name, v in layers.items()
                if v["precision"] != "int8"))
    sessions = {"onnxruntime fp32": session(exported.path, args.threads),
                "onnxruntime int8": session(qdq, args.threads)}
    runs = {**{p: (lambda f, e=e: first_output(e.run(f))) for p, e in engines.items()},
            **{p: (lambda f, s=s: first_output(s.run(None, f))) for p, s in sessions.items()}}
    row.accuracy = accuracy({p: runs[p] for p in PEERS if p != "kiln fp32"}, runs["kiln fp32"], held_out, text)
    feeds = held_out[0]
    for _ in range(args.rounds):
        medians = {}
        for peer in PEERS:
            row.busy.append(cpu_busy(0.5))
            block = time_samples(lambda: runs[peer](feeds), iterations=args.iterations, warmup=args.warmup,
                                 budget_s=args.budget, min_runs=5, clock=CLOCKS[args.clock])
            row.samples[peer] += block
            medians[peer] = float(np.median(block))
        row.by_round.append(medians)
        print(f"  {label}: round " + ", ".join(f"{p} {m:.2f}" for p, m in medians.items()), flush=True)
    return row


def table(rows: list[Row]) -> list[str]:
    header = ["model", *(f"{p} ms" for p in PEERS), "kiln int8 / kiln fp32", "kiln int8 / ORT int8",
              "kiln on ORT's QDQ / ORT int8"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if r.error:
            lines.append(f"| {r.label} | failed: {r.error} |" + " |" * (len(header) - 2))
            continue
        ms = {p: float(np.median(v)) for p, v in r.samples.items()}

        def ratio(a: str, b: str) -> str:
            rounds = ", ".join(f"{m[a] / m[b]:.2f}" for m in r.by_round)
            return f"**{ms[a] / ms[b]:.2f}** ({rounds})"

        lines.append("| " + " | ".join([r.label, *(f"{ms[p]:.2f}" for p in PEERS),
                                         ratio("kiln int8", "kiln fp32"), ratio("kiln int8", "onnxruntime int8"),
                                         ratio("kiln int8 (ORT QDQ)", "onnxruntime int8")]) + " |")
    lines += ["", "| model | " + " | ".join(p for p in PEERS if p != "kiln fp32") + " |",
              "|" + "---|" * len(PEERS)]
    for r in rows:
        if not r.error:
            lines.append(f"| {r.label} (vs kiln fp32) | " + " | ".join(r.accuracy[p] for p in PEERS
                                                                      if p != "kiln fp32") + " |")
    return lines


# ResNet-50 (C, O, H, kernel, stride, groups), MobileNetV2's depthwise and 1x1 layers, BERT-base's GEMMs (M, K, N)
LAYER_CONVS = [(64, 64, 56, 3, 1, 1), (64, 256, 56, 1, 1, 1), (256, 64, 56, 1, 1, 1), (128, 128, 28, 3, 1, 1),
               (512, 128, 28, 1, 1, 1), (256, 256, 14, 3, 1, 1), (1024, 256, 14, 1, 1, 1), (512, 512, 7, 3, 1, 1),
               (2048, 512, 7, 1, 1, 1), (3, 64, 224, 7, 2, 1), (32, 32, 112, 3, 1, 32), (144, 144, 56, 3, 1, 144),
               (960, 960, 7, 3, 1, 960), (16, 96, 112, 1, 1, 1), (96, 24, 56, 1, 1, 1), (160, 960, 7, 1, 1, 1)]
LAYER_GEMMS = [(128, 768, 768), (128, 768, 3072), (128, 3072, 768), (1, 2048, 1000)]


def layer_table(rounds: int) -> list[str]:
    """Each layer alone: oneDNN's float32 primitive (kiln's fp32 tactic) against its int8 one (u8 source, s8
    7-bit weights, quantized output), the 10th percentile of interleaved calls: what the kernels give
    before any engine overhead."""
    import torch

    from kiln.kernels.cpu import onednn_primitives
    from kiln.kernels.cpu.onednn_int8 import QConv2d, QMatMul

    def pair(f32, i8) -> tuple[float, float]:
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(3):
            f32(), i8()
        for _ in range(rounds):
            for k, fn in enumerate((f32, i8)):
                start = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - start) * 1e3)
        return tuple(float(np.percentile(times[k], 10)) for k in (0, 1))

    lines = ["| layer | fp32 ms | int8 ms | int8 / fp32 | int8 kernel |", "|---|---|---|---|---|"]
    for c, o, h, k, s, g in LAYER_CONVS:
        x = torch.randn(1, c, h, h).contiguous(memory_format=torch.channels_last)
        w, p = torch.randn(o, c // g, k, k) * 0.1, k // 2
        conv = onednn_primitives.Conv2d(w, torch.randn(o), [1, c, h, h], [s, s], [p] * 4, [1, 1], g, None, False, False)
        xq = torch.randint(0, 256, x.shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        qconv = QConv2d(torch.randint(-64, 65, w.shape, dtype=torch.int8), torch.rand(o) * 0.01,
                        torch.zeros(o, dtype=torch.int32), [1, c, h, h], [s, s], [p] * 4, [1, 1], g, torch.uint8,
                        0.02, 0, (torch.uint8, 0.5, 0))
        f, q = pair(lambda: conv(x), lambda: qconv(xq))
        lines.append(f"| conv {c}->{o} {h}x{h} k{k} s{s}" + (f" g{g}" if g > 1 else "") +
                     f" | {f:.3f} | {q:.3f} | {q / f:.2f} | {qconv.implementation} |")
    for m, k, n in LAYER_GEMMS:
        ip = onednn_primitives.InnerProduct(torch.randn(n, k), torch.randn(n), m, None, False, False)
        x, xq = torch.randn(m, k), torch.randint(0, 256, (m, k), dtype=torch.uint8)
        qm = QMatMul(torch.randint(-64, 65, (n, k), dtype=torch.int8), torch.rand(n) * 0.01,
                     torch.zeros(n, dtype=torch.int32), m, torch.uint8, 0.02, 128, (torch.uint8, 0.5, 3))
        f, q = pair(lambda: ip(x), lambda: qm(xq))
        lines.append(f"| gemm {m}x{k}x{n} | {f:.3f} | {q:.3f} | {q / f:.2f} | {qm.implementation} |")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="thread: CPU time of the calling thread, for --threads 1 on a loaded machine")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20, help="runs per block at most")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per block at most (after 5 runs)")
    parser.add_argument("--calibration", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=24)
    parser.add_argument("--calibrator", default="entropy")
    parser.add_argument("--layers", type=int, default=40, help="per-layer kernel table: calls per layer (0: none)")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--avx2", action="store_true", help="kiln (KILN_CPU_ISA=avx2) and every library "
                        "(onnxruntime's MLAS by bench/cpuid_avx2.py's cpuid mask) capped to AVX2")
    parser.add_argument("--without", default="", help="tactics left out of every kiln build (comma-separated "
                        "names): the engines as they were before a tactic came")
    args = parser.parse_args(argv)
    for name in [t for t in args.without.split(",") if t]:
        from kiln.tactics import registry

        registry.load_device("cpu")
        if registry.get(name) is None:
            parser.error(f"--without {name}: no such tactic")
        registry.unregister(name)
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts the calling thread only: give --threads 1 (the other threads' work "
                     "would not be counted)")

    load_before = os.getloadavg()[0]
    print(f"kiln {kiln.__version__} INT8 CPU benchmark: {cpu_name()} ({cpu_features.describe()}), {args.threads} "
          f"thread(s); load average {load_before:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        try:
            rows.append(run_model(name, args))
        except Exception as e:  # noqa: BLE001  one failing model must not hide the others
            import traceback

            traceback.print_exc()
            rows.append(Row(MODELS.get(name, (name,))[0], name, error=f"{type(e).__name__}: {str(e)[:160]}"))
        gc.collect()
    layers = []
    if args.layers:
        import torch

        torch.set_num_threads(args.threads)
        layers = layer_table(args.layers)
        print("\n".join(layers), flush=True)
    load_after = os.getloadavg()[0]
    lines = table(rows) + [""]
    for r in rows:
        if r.error:
            continue
        busy = np.median(r.busy) if r.busy else 0.0
        lines.append(f"- {r.label}: build s " + ", ".join(f"{k} {v:.0f}" for k, v in r.build_s.items())
                     + f"; machine busy before blocks (median) {busy * 100:.0f}%")
        lines += [f"  - {n}" for n in r.notes]
    print("\n" + "\n".join(lines))
    if args.no_write:
        return lines
    now = datetime.datetime.now(datetime.timezone.utc)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "onnxruntime", "onnx")}
    contended = max(load_before, load_after) > args.threads + 0.5
    path = args.results / f"quant-cpu-{now:%Y-%m-%d}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = path.read_text() if path.exists() else ""
    body = [
        ("## " if earlier else "# ") + f"kiln INT8 CPU benchmark, {now:%Y-%m-%d %H:%M} UTC",
        "",
        *(["**Contended run**: other processes shared the 2 cores (load below); latencies are inflated and the "
           "per-round ratios scatter.", ""] if contended else []),
        f"- device: {cpu_name()} ({platform.machine()}; {cpu_features.describe()}), {args.threads} thread(s) for "
        "every runtime",
        f"- commit: {commit()}; kiln {kiln.__version__}; " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- batch {args.batch} (BERT-base: seq 128); latency in ms ({args.clock} clock), median of every run of {args.rounds} interleaved rounds "
        f"of blocks ({args.warmup} warm-up runs, then up to {args.iterations} runs or {args.budget:.0f} s); "
        "ratios: overall median, then per round",
        f"- machine load (1-min load average) {load_before:.2f} before, {load_after:.2f} after, on "
        f"{os.cpu_count()} cores",
        f"- kiln int8: {args.calibrator} calibrator on {args.calibration} inputs; onnxruntime int8: quantize_static "
        "QDQ, MinMax, U8S8 per-channel, reduce_range (BERT: MatMul/Gemm only); accuracy on "
        f"{args.held_out} held-out inputs against kiln fp32",
        "",
        *lines,
        "",
        *(["Each layer alone (oneDNN float32 vs int8 primitive, batch 1, 10th percentile of "
           f"{args.layers} interleaved calls, {args.threads} thread(s)):", "", *layers, ""] if layers else []),
        "Ratios < 1: the first is faster.",
        "",
    ]
    path.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join(body))
    print(f"\nwrote {path}")
    return lines


if __name__ == "__main__":
    main()
