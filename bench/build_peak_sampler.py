"""Where a ResNet-50 build peaks, as bench/memory.py's build child measures it (numpy and onnxruntime imported
first, no progress callback): a thread samples VmRSS every 5 ms and keeps the main thread's stack at each new
maximum; prints the build's peak growth, the sampled maximum and that stack. Results: bench/results/mem7-2026-12-05.md.

    TMPDIR=/dev/shm PYTHONPATH=$PWD python bench/build_peak_sampler.py
"""
import json, sys, threading, time, traceback
import numpy as np
import onnxruntime as ort
import torch
import kiln
from kiln import zoo
from kiln.runtime.rss import PeakMemory, resident_bytes
torch.set_num_threads(2)
exported = zoo.export("resnet50")
feeds = exported.inputs()
peak = PeakMemory.start()
start = peak.start_rss
main = threading.main_thread().ident
best = [0, None]
done = [False]
def sample():
    while not done[0]:
        rss = resident_bytes() - start
        if rss > best[0] + (1 << 20):
            frame = sys._current_frames().get(main)
            best[:] = [rss, [f"{f.filename.split('kiln/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)][-12:]]
            del frame  # held to the next maximum, the frame kept its locals alive: a stage's programs past their end
        time.sleep(0.005)
t = threading.Thread(target=sample, daemon=True); t.start()
engine = kiln.build(str(exported.path))
done[0] = True
print("build", peak.delta() >> 20, "sampled max", best[0] >> 20)
print("\n".join(best[1] or []))
