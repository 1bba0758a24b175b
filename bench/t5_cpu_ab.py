"""T5-small encoder on the CPU: kiln engines built with tactics left out (argv[2:], prefixes) vs the default build
and onnxruntime, whole runs in interleaved blocks of one process (8 rounds, median of block medians).

    KILN_POOL=0 python bench/t5_cpu_ab.py 2 cpu.gemm.kiln_packed cpu.where     # threads, then tactics to leave out
"""
import sys, time, statistics, torch, numpy as np, kiln
from kiln import zoo
from kiln.tactics import registry
from kiln.zoo.timing import peer_runners, time_samples
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
ex = zoo.export("t5_small_encoder", batch=1); feeds = ex.inputs()
registry.load_device("cpu")
allcpu = sorted(registry.all_tactics("cpu"))
variants = {"default": []}
for drop in sys.argv[2:]:
    variants["-" + drop] = [t for t in allcpu if not t.startswith(drop)]
runners = {}
for label, tac in variants.items():
    e = kiln.build(str(ex.path), tactics=tac)
    runners[label] = (lambda e=e: e.run(feeds))
    print(label, [ (n, l["tactic"]) for n, l in e.plan.header["tactics"]["layers"].items() if not l.get("cached")])
runners["ort"] = peer_runners("t5_small_encoder", ex.path, feeds, threads=threads, engine=e)["onnxruntime"]
s = {k: [] for k in runners}
for r in range(8):
    for k, fn in runners.items():
        s[k].append(float(np.median(time_samples(fn, iterations=40, warmup=3, budget_s=1.0))))
for k, v in s.items():
    print(f"{k:20s} median {statistics.median(v):.3f} ms  / ort {statistics.median(v)/statistics.median(s['ort']):.3f}  rounds {' '.join(f'{x:.2f}' for x in v)}")
