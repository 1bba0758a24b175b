"""kiln on onnxruntime's QDQ transformer, before and after the token-id drift (issue 12, CPU): A/B in one process.

    python bench/quant_token_drift_ab.py --models minilm,bert_tiny --threads 1 --rounds 5

A quantized engine is judged as a whole against the default engine's own drift under a sub-step nudge
(kiln/builder/accuracy.py quantized_drift). An engine fed token ids had nothing to nudge before, so only the fixed
10% of the output's scale was allowed, and onnxruntime's QDQ all-MiniLM-L6-v2 (which amplifies flipped ties) had
40 layers sent back to reference kernels. Now the floats it makes from integer activations (the embedding gather,
each dequantized 8-bit activation) are nudged.

Peers, timed in interleaved rounds (each round: every peer's block once; median of every run, ratios per round):

    kiln fp32                    kiln.build of the float ONNX file
    kiln QDQ, before             kiln.build of onnxruntime's QDQ model with the drift of token-id engines off
                                 (quantized_drift returns None for them, as before this change)
    kiln QDQ, after              the same model, this tree's rule
    onnxruntime int8             the QDQ model, ORT_ENABLE_ALL

Also per model: the reverted layers of each build, and how far kiln's engines and onnxruntime's are apart on the
held-out inputs (cosine of the first output), with onnxruntime's own drift (its word embeddings scaled by
1 + 2^-20) beside it: the noise floor of any two implementations of a network that amplifies ties.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: models, inputs, the onnxruntime QDQ model

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder import accuracy  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

PEERS = ("kiln fp32", "kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8")


def build_before(path: Path):
    """The QDQ engine as the old rule built it: no drift for an engine without float inputs."""
    original = accuracy.quantized_drift

    def old_rule(default, default_outputs, inputs):
        if not any(hasattr(x, "is_floating_point") and x.is_floating_point() for x in inputs):
            return None
        return original(default, default_outputs, inputs)

    accuracy.quantized_drift = old_rule
    try:
        return kiln.build(str(path))
    finally:
        accuracy.quantized_drift = original


def nudged_embeddings(qdq: Path, out: Path) -> Path:
    """onnxruntime's QDQ model with its largest float initializer (the word embeddings) scaled by 1 + 2^-20."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(qdq))
    floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    biggest = max(floats, key=lambda t: np.prod(t.dims))
    value = numpy_helper.to_array(biggest) * np.float32(1 + accuracy.INPUT_NUDGE)
    biggest.CopyFrom(numpy_helper.from_array(value.astype(np.float32), biggest.name))
    onnx.save(model, str(out))
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b))


def run_model(name: str, args) -> list[str]:
    import torch

    label, seq = quant.MODELS[name]
    exported = zoo.export(name, seq=seq)
    torch.set_num_threads(args.threads)
    calibration = quant.inputs_for(exported, 8, seed=1)
    held_out = quant.inputs_for(exported, args.held_out, seed=2)
    work = Path(tempfile.mkdtemp(prefix="kiln-tokdrift-"))
    qdq = work / "qdq.onnx"
    quant.ort_qdq(exported.path, calibration, qdq, True)
    engines = {"kiln fp32": kiln.build(str(exported.path)), "kiln QDQ, before": build_before(qdq),
               "kiln QDQ, after": kiln.build(str(qdq))}
    sessions = {"onnxruntime int8": quant.session(qdq, args.threads),
                "onnxruntime int8, nudged": quant.session(nudged_embeddings(qdq, work / "nudged.onnx"), args.threads)}
    runs = {**{p: (lambda f, e=e: quant.first_output(e.run(f))) for p, e in engines.items()},
            **{p: (lambda f, s=s: quant.first_output(s.run(None, f))) for p, s in sessions.items()}}
    lines = [f"### {label} (seq {seq}), {args.threads} thread(s)", ""]
    for peer in ("kiln QDQ, before", "kiln QDQ, after"):
        tactics = engines[peer].plan.header.get("tactics") or {}
        layers = (engines[peer].plan.header.get("quantization") or {}).get("layers") or {}
        ran = [v["precision"] for v in layers.values()]
        lines.append(f"- {peer}: {len(tactics.get('reverted_layers') or {})} layers reverted to reference kernels; "
                     f"quantized layers " + ", ".join(f"{ran.count(p)} {p}" for p in sorted(set(ran)))
                     + f"; judged against {(tactics.get('accuracy') or {}).get('reference', '?')}")
    ort_out = [runs["onnxruntime int8"](f) for f in held_out]
    for peer in ("kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8, nudged", "kiln fp32"):
        cos = [cosine(runs[peer](f), o) for f, o in zip(held_out, ort_out)]
        lines.append(f"- cosine to onnxruntime int8 on {len(held_out)} held-out inputs, {peer}: min {min(cos):.4f}, "
                     f"median {np.median(cos):.4f}")
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    samples = {p: [] for p in PEERS}
    by_round = []
    feeds = held_out[0]
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        medians = {}
        for peer in PEERS:
            block = time_samples(lambda: runs[peer](feeds), iterations=args.iterations, warmup=3, budget_s=3.0,
                                 min_runs=5, clock=clock, settle_s=0.25)
            samples[peer] += block
            medians[peer] = float(np.median(block))
        by_round.append(medians)
        load.append(os.getloadavg()[0])
        print(f"  {label}: " + ", ".join(f"{p} {m:.2f}" for p, m in medians.items()), flush=True)
    ms = {p: float(np.median(v)) for p, v in samples.items()}

    def ratio(a: str, b: str) -> str:
        return f"**{ms[a] / ms[b]:.2f}** (" + ", ".join(f"{r[a] / r[b]:.2f}" for r in by_round) + ")"

    lines += ["", f"1-min load {min(load):.1f}-{max(load):.1f}; {'thread CPU' if args.threads == 1 else 'wall'} "
              f"clock, median of every run of {args.rounds} interleaved rounds", "",
              "| " + " | ".join(f"{p} ms" for p in PEERS) + " | after / before | before / ORT int8 | after / ORT int8 "
              "| after / kiln fp32 |", "|" + "---|" * (len(PEERS) + 4),
              "| " + " | ".join(f"{ms[p]:.2f}" for p in PEERS) + f" | {ratio('kiln QDQ, after', 'kiln QDQ, before')} | "
              f"{ratio('kiln QDQ, before', 'onnxruntime int8')} | {ratio('kiln QDQ, after', 'onnxruntime int8')} | "
              f"{ratio('kiln QDQ, after', 'kiln fp32')} |", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="minilm,bert_tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--held-out", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"{cpu_name()} ({cpu_features.describe()}), {args.threads} thread(s), load {os.getloadavg()[0]:.2f}",
          flush=True)
    lines = []
    for name in args.models.split(","):
        lines += run_model(name, args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
