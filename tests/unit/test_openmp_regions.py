"""A native segment's serial form enters no OpenMP parallel region of two threads (issue 11, 2026-12-04d).

Counted, not assumed: a subprocess runs EfficientNet or ResNet (the zoo's tiny variants, NCHW input: the segment
reorders it at its head, or the stem kernel reads it) under bench/openmp_regions.c, an LD_PRELOAD shim wrapping libgomp's region entry points, with every
segment held in one form. The parallel form must fork (else the count proves nothing); the serial form must not,
its layers created on one thread and run with OpenMP's count at 1 (onednn.one_openmp_thread), so its time does
not hang on how OpenMP's idle workers wait. The outputs of both forms are compared with onnxruntime's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.kernels.cpu import onednn, se

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "bench" / "openmp_regions.c"

pytestmark = [pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.reason()}"),
              pytest.mark.skipif(not se.available(), reason=f"kiln's SE kernel is not built: {se.reason()}"),
              pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler"),
              pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: no parallel form to compare")]

SCRIPT = r"""
import json, ctypes, sys
import numpy as np
import kiln, torch
from kiln import zoo
from kiln.builder import autotune
import onnxruntime as ort
torch.set_num_threads(2)
autotune.NATIVE_CREDIT_MS = 1e3  # the native tactics (where the forms apply) win
name = sys.argv[1]
exported = zoo.export(name)
engine = kiln.build(str(exported.path))
session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
names = [o.name for o in session.get_outputs()]
process = ctypes.CDLL(None)
regions = ctypes.c_long.in_dll(process, "kiln_shim_regions")
multi = ctypes.c_long.in_dll(process, "kiln_shim_multi")
segments = [s for s in engine.program.segments if s.chooser is not None]
out = {"segments": len(segments)}
for form in ("parallel", "serial"):
    for s in segments:
        s.chooser.choose = (lambda f=form: f)
    feeds = zoo.random_inputs(name, exported, seed=11)
    engine.run(feeds)  # warm
    process.kiln_shim_reset()
    got = engine.run(feeds)
    want = session.run(None, feeds)
    err = max(float(np.abs(got[n] - w).max() / max(1.0, np.abs(w).max())) for n, w in zip(names, want))
    out[form] = {"regions": regions.value, "multi": multi.value, "error": err}
print(json.dumps(out))
"""


@pytest.mark.parametrize("model", ["efficientnet_tiny", "resnet_tiny"])
def test_the_serial_form_forks_no_openmp_thread(tmp_path, model):
    """resnet_tiny: its accumulating 1x1 convolutions' one-thread kernel (brgconv_1x1 on AVX2) wants the weight in
    another layout than their parallel one; they forked in the serial form until their serial form packed its own."""
    shim = tmp_path / "openmp_regions.so"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(shim), str(SHIM), "-ldl"],
                   check=True)
    env = {**os.environ, "LD_PRELOAD": str(shim), "PYTHONPATH": str(ROOT), "KILN_SERIAL_SMALL_LAYERS": ""}
    env.pop("KILN_SERIAL_SMALL_LAYERS")
    done = subprocess.run([sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["segments"] >= 1, out
    assert out["parallel"]["multi"] > 0, out  # the shim sees the forks when there are some
    assert out["serial"]["multi"] == 0, out
    for form in ("parallel", "serial"):
        assert out[form]["error"] < 1e-4, out  # fp32, relative to max(1, |onnxruntime|): summation order only
