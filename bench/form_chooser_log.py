"""Why DenseNet-121's largest segment runs its serial form at 2 threads on a near-quiet machine (issue 11): every
call of a segment with a FormChooser logged as (form, seconds, both estimates, what the chooser picks next).

    python bench/form_chooser_log.py --model densenet121@1 --calls 200 [--engine PATH] [--ort-every 8]

Settings (--settings, comma-separated), a fresh chooser each: "alone" (kiln's calls back to back) and "interleaved"
(--ort-calls onnxruntime calls every --ort-every kiln calls, no settle: onnxruntime's workers may still spin on the
other core when kiln's next call starts). Printed per segment with a chooser: the runs of each form and their median
times, the serial runs made as the incumbent (the rest are start runs and probes), and the calls whose record switched
the incumbent, with each form's window then. --dump: every call of the slowest segment.
"paired" and "paired-interleaved": no chooser; every segment's forms forced call by call (P S S P ...), each pair's two
times taken as both forms' at that moment (medians printed; -interleaved also the pair right after each onnxruntime
block); --trace writes the pairs for bench/form_chooser_replay.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class FixedForm:
    """Stands in for a segment's chooser: runs `form` (set between calls) and keeps each run's time."""

    def __init__(self):
        self.form, self.times = "parallel", []

    def choose(self):
        return self.form

    def record(self, form, seconds):
        self.times.append((form, seconds))


class LoggedChooser:
    """Wraps a FormChooser: each record() is logged with the state it leaves."""

    def __init__(self, chooser, log: list):
        self.chooser, self.log = chooser, log

    def choose(self):
        return self.chooser.choose()

    def record(self, form, seconds):
        c = self.chooser
        best_before = c.best()
        c.record(form, seconds)
        self.log.append({"form": form, "ms": seconds * 1e3, "best_before": best_before, "best": c.best(),
                         "next": c.choose(), "started": c._started, "windows": {f: [round(t * 1e3, 1) for t in
                                                                                  c._times[f]] for f in c.forms}})


def summary(name: str, log: list) -> None:
    serial = [e for e in log if e["form"] == "serial"]
    parallel = [e for e in log if e["form"] == "parallel"]
    as_incumbent = sum(1 for e in serial if e["started"] and e["best_before"] == "serial")
    par, ser = (statistics.median([e["ms"] for e in runs]) if runs else 0.0 for runs in (parallel, serial))
    print(f"  {name}: {len(log)} calls, parallel {len(parallel)} (median {par:.1f} ms), serial {len(serial)} "
          f"(median {ser:.1f} ms), serial run as incumbent {as_incumbent}")
    for i, e in enumerate(log):
        before = log[i - 1]["best"] if i else None
        if e["started"] and before is not None and before != e["best"]:
            print(f"    call {i}: recorded {e['form']} {e['ms']:.1f} ms -> best {e['best']}, windows {e['windows']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="densenet121@1")
    parser.add_argument("--engine", type=Path, default=None, help="a saved engine of the model (built at 2 threads)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--ort-every", type=int, default=8)
    parser.add_argument("--ort-calls", type=int, default=4)
    parser.add_argument("--settings", default="alone,interleaved")
    parser.add_argument("--dump", action="store_true", help="print every call of the largest segment")
    parser.add_argument("--trace", type=Path, default=None,
                        help="setting 'paired': write each segment's (parallel, serial) time pairs here (JSON)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    import kiln
    from kiln.kernels.cpu.form_choice import FormChooser
    from zoo_new import cases, ort_session
    from zoo_new_models import MODELS, export

    (name, batch), = cases(args.model)
    engine = kiln.load(args.engine) if args.engine else kiln.build(str(export(name, batch).path))
    feeds = MODELS[name].inputs(batch, seed=1)
    session = ort_session(export(name, batch).path, 2)
    engine.run(feeds)
    session.run(None, feeds)
    segments = [s for s in engine.program.segments if getattr(s, "chooser", None) is not None]
    print(f"form_chooser_log: {name}@{batch}, 2 threads, {len(segments)} segments with a chooser; torch "
          f"{torch.__version__}; load {os.getloadavg()[0]:.2f}")
    for setting in args.settings.split(","):
        if setting in ("paired", "paired-interleaved"):  # the forms call by call (P S S P ...): both forms' times
            # at about each moment; -interleaved: onnxruntime's block every --ort-every pairs
            fixed = [FixedForm() for _ in segments]
            saved = [s.chooser for s in segments]
            for s, f in zip(segments, fixed):
                s.chooser = f
            load0 = os.getloadavg()[0]
            after_ort = []  # the pair indices right after an onnxruntime block
            for i in range(2 * args.calls):
                if setting == "paired-interleaved" and i % (2 * args.ort_every) == 0:
                    for _ in range(args.ort_calls):
                        session.run(None, feeds)
                    after_ort.append(i // 2)
                for f in fixed:
                    f.form = "parallel" if (i % 4 in (0, 3)) else "serial"
                engine.run(feeds)
            for s, f in zip(segments, saved):
                s.chooser = f
            pairs = [[{"parallel": a[1], "serial": b[1]} if a[0] == "parallel" else {"parallel": b[1], "serial": a[1]}
                      for a, b in zip(f.times[::2], f.times[1::2])] for f in fixed]
            for k, p in enumerate(pairs):
                par, ser = (statistics.median([x[form] * 1e3 for x in p]) for form in ("parallel", "serial"))
                won = sum(x["parallel"] < x["serial"] for x in p)
                print(f"{setting}, segment {k}: {len(p)} pairs, parallel {par:.1f} ms, serial {ser:.1f} ms (medians), "
                      f"parallel faster in {won}; load {load0:.2f}-{os.getloadavg()[0]:.2f}")
                if after_ort:
                    first = [p[j] for j in after_ort]
                    par1, ser1 = (statistics.median([x[form] * 1e3 for x in first]) for form in ("parallel", "serial"))
                    print(f"  the pair right after each onnxruntime block ({len(first)}): parallel {par1:.1f} ms, "
                          f"serial {ser1:.1f} ms (medians)")
            if args.trace:
                args.trace.write_text(json.dumps(pairs))
            continue
        logs = []
        for s in segments:
            logs.append([])
            s.chooser = LoggedChooser(FormChooser(), logs[-1])
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        for i in range(args.calls):
            if setting == "interleaved" and i % args.ort_every == 0:
                for _ in range(args.ort_calls):
                    session.run(None, feeds)
            engine.run(feeds)
        print(f"\n{setting}: {args.calls} calls, {time.perf_counter() - t0:.1f} s, "
              f"load {load0:.2f}-{os.getloadavg()[0]:.2f}")
        for k, log in enumerate(logs):
            summary(f"segment {k}", log)
        if args.dump:
            big = max(logs, key=lambda lg: statistics.median([e["ms"] for e in lg]))
            for i, e in enumerate(big):
                print(f"    {i:3d} {e['form'][0]} {e['ms']:6.1f} -> {e['next'][0]} {e['windows']}")
        for s in segments:
            s.chooser = s.chooser.chooser


if __name__ == "__main__":
    main()
