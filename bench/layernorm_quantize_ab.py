"""kiln::LayerNormQuantize on the CPU (h-lnq8) against the separate DequantizeLinear -> LayerNorm -> QuantizeLinear
steps, in engines of a small QDQ model of two pre-quantized norms (QDQ BERT's pattern), A/B in one process.

    python bench/layernorm_quantize_ab.py --widths 128,768 --rows 128 --rounds 15

The model: y1 = Q(LN(x + DQ(Q(r)))), y = DQ(Q(LN(a + DQ(y1)))) (tests/unit/test_int8_layernorm_fusion.py's, at
[1, rows, width]): fused, 2 LayerNormQuantize steps reading 8-bit residuals; separate, 2 DQ + 2 LN + 2 Q of their
own. Both engines share every other step (r's Q, y's DQ). Interleaved rounds, order alternated; at 1 thread the
calling thread's CPU time (--clock thread, loaded machines). Prints per-round ratios, medians, the load, the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.passes import fusion  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402
from tests.unit.test_int8_layernorm_fusion import _qdq_model  # noqa: E402  the test's model, one definition

RULES = ("fuse_int8_layer_norm_quantize", "fuse_int8_dequantize_into_layer_norm_quantize")


def qdq_model(path: Path, rows: int, width: int) -> None:
    """The test's model (tests/unit/test_int8_layernorm_fusion.py _qdq_model) at [1, rows, width]."""
    _qdq_model(path, np.random.default_rng(zlib.crc32(f"lnq8 bench {rows} {width}".encode())), width, rows)


def main() -> None:
    import torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="128,768")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=0.4)
    parser.add_argument("--clock", choices=("wall", "thread"), default="thread")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" and args.threads == 1 else time.perf_counter
    rows_out = []
    for width in (int(w) for w in args.widths.split(",")):
        path = Path(tempfile.mkdtemp(prefix="kiln-lnq8-")) / "norms.onnx"
        qdq_model(path, args.rows, width)
        saved = list(fusion.RULES)
        fusion.RULES[:] = [rule for rule in saved if rule[0] not in RULES]
        try:
            separate = kiln.build(str(path))
        finally:
            fusion.RULES[:] = saved
        fused = kiln.build(str(path))
        rng = np.random.default_rng(zlib.crc32(f"lnq8 feed {width}".encode()))
        feed = {k: (rng.standard_normal((1, args.rows, width)) * 2).astype(np.float32) for k in ("x", "r", "a")}
        assert np.array_equal(np.asarray(fused.run(feed)["y"]), np.asarray(separate.run(feed)["y"]))
        engines = {"separate": separate, "fused": fused}
        ms = {k: [] for k in engines}
        loads = []
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in (("separate", "fused") if r % 2 == 0 else ("fused", "separate")):
                block = time_samples(lambda e=engines[name]: e.run(feed), iterations=200, warmup=10,
                                     budget_s=args.budget, min_runs=20, clock=clock)
                ms[name].append(float(np.median(block)) * 1000)
        per = [f / s for f, s in zip(ms["fused"], ms["separate"])]
        steps = f"{len(separate.program.steps)} -> {len(fused.program.steps)}"
        print(f"  width {width}: per-round fused/separate {', '.join(f'{v:.2f}' for v in per)}", flush=True)
        rows_out.append(f"| [1, {args.rows}, {width}] | {args.threads} | {args.clock} | {min(loads):.1f}-{max(loads):.1f} "
                        f"| {steps} | {np.median(ms['separate']):.1f} | {np.median(ms['fused']):.1f} | "
                        f"**{np.median(per):.2f}** |")
    print(f"\nQDQ two-norm model, µs a run, medians of {args.rounds} interleaved rounds, CPU {cpu_name()}\n")
    print("| input | threads | clock | load (1-min) | steps | separate | fused | fused / separate |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
