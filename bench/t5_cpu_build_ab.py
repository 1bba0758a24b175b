"""One fresh build of the T5-small encoder (no timing cache): the tactics the tuner chose for the layers that
vary build to build, and kiln / onnxruntime (6 interleaved blocks). Run alternately from two checkouts for an A/B:

    for t in /tmp/main /work/wt-t5; do (cd $t && KILN_POOL=0 PYTHONPATH=$t python bench/t5_cpu_build_ab.py 2); done
"""
import sys, statistics, torch, numpy as np, kiln
from kiln import zoo
from kiln.zoo.timing import peer_runners, time_samples
threads = int(sys.argv[1]); torch.set_num_threads(threads)
ex = zoo.export("t5_small_encoder", batch=1); feeds = ex.inputs()
e = kiln.build(str(ex.path))
L = e.plan.header["tactics"]["layers"]
pick = {n: L[n]["tactic"] for n in ("node_where_1", "node_scaled_dot_product_attention", "node_linear_merged", "node_linear_3")}
r = peer_runners("t5_small_encoder", ex.path, feeds, threads=threads, engine=e)
s = {"kiln": [], "onnxruntime": []}
for _ in range(6):
    for k in s:
        s[k].append(float(np.median(time_samples(r[k], iterations=40, warmup=3, budget_s=1.0))))
k, o = statistics.median(s["kiln"]), statistics.median(s["onnxruntime"])
print(f"{kiln.__file__.split('/')[2]:8s} thr {threads} kiln {k:.2f} ort {o:.2f} ratio {k/o:.3f} | " + " ".join(f"{n[5:]}={t.replace('cpu.','')}" for n, t in pick.items()))
