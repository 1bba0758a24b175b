"""Build memory on the zoo models that used to exhaust it (issue 11), each against onnxruntime.

- EfficientNet (transformers): its head is AvgPool2d(hidden_dim, ceil_mode=True), a 1280-wide
  kernel over B0's 7x7 map. Pooling padded the input to the window grid (8 GB per image at B0).
- ALBERT (transformers): every layer reads one layer's weights. The build stored the shared
  weights once per layer (folding, the GEMM fusions, lowering): the engine held N copies.

Each model is exported once (cached), then built and run in a child process whose address space
may grow by BUILD_GUARD at most, so a regression fails with MemoryError instead of taking the
machine down. The child reports the build's own measure (`header["build_memory"]`: peak RSS
growth from the start of kiln.build, the engine's load included; kiln/builder/build.py) and its
outputs on fresh random inputs next to onnxruntime's. The child builds without KILN_VERIFY, as
users do (the verifier between passes is a test aid).

Bounds: the issue's target is peak build memory <= 3x the model's weight bytes. A build also
costs a fixed amount whatever the model (oneDNN/MKL and kernels on first use, the tactic search's
recorded activations and timing buffers): FIXED, 160 MiB; albert_tiny measured 50 MiB with
0.5 MiB of weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kiln import zoo
from tests.models.test_zoo import assert_fp32_close

MiB = 1 << 20
FIXED = 160 * MiB
BUILD_GUARD = 4 << 30  # address space the child may add after its imports
ROOT = Path(__file__).parents[2]

_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import onnxruntime as ort
    import torch
    import kiln
    from kiln import zoo

    name, guard, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    exported = zoo.export(name)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + guard, resource.getrlimit(resource.RLIMIT_AS)[1]))
    engine = kiln.build(str(exported.path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    feeds = zoo.random_inputs(name, exported, seed=1)
    got, want = engine.run(feeds), session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    np.savez(out, **{f"kiln_{i}": got[n] for i, n in enumerate(names)}, **{f"ort_{i}": w for i, w in enumerate(want)})
    large = [w for w in engine.plan.weights.values() if isinstance(w, torch.Tensor) and w.numel() >= 4096]
    contents = {(str(w.dtype), tuple(w.shape), w.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for w in large}
    print(json.dumps({"build_memory": engine.plan.header["build_memory"],
                      "weights_bytes": engine.plan.header["weights_bytes"],
                      "large_weights": len(large), "distinct_large_weights": len(contents), "outputs": len(names)}))
""")


@dataclass(frozen=True)
class Built:
    build_memory: dict
    weights_bytes: int
    large_weights: int
    distinct_large_weights: int
    outputs: dict[str, np.ndarray]

    @property
    def peak(self) -> int:
        return self.build_memory["peak_rss_delta_bytes"]

    @property
    def model_weights(self) -> int:
        return self.build_memory["model_weight_bytes"]


def build_in_child(name: str, tmp_path: Path) -> Built:
    zoo.export(name)  # export (or find) it here: the export's own memory is not the build's
    env = {k: v for k, v in os.environ.items() if k != "KILN_VERIFY"}
    out = tmp_path / f"{name}.npz"
    result = subprocess.run([sys.executable, "-c", _CHILD, name, str(BUILD_GUARD), str(out)], capture_output=True,
                            text=True, timeout=1200, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{name}: the build failed or ran out of its guard:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    with np.load(out) as arrays:
        outputs = {k: arrays[k] for k in arrays.files}
    return Built(report["build_memory"], report["weights_bytes"], report["large_weights"],
                 report["distinct_large_weights"], outputs)


def check_outputs(name: str, built: Built) -> None:
    n = len([k for k in built.outputs if k.startswith("ort_")])
    for i in range(n):
        assert_fp32_close(built.outputs[f"kiln_{i}"], built.outputs[f"ort_{i}"], f"{name} output #{i}")


def check_peak(name: str, built: Built, bound: int, what: str) -> None:
    assert built.peak <= bound, (
        f"{name}: the build's peak RSS grew by {built.peak / MiB:.0f} MiB, over {bound / MiB:.0f} MiB ({what}); "
        f"the model holds {built.model_weights / MiB:.1f} MiB of weights")


# ---- EfficientNet: a pooling kernel larger than its input


@pytest.mark.parametrize("name, bound, what", [
    # measured 86 MiB; 330 MiB when pooling padded the 320-wide head's window grid
    ("efficientnet_tiny", None, "3x the weights + FIXED"),
    # measured 315 MiB (the search records ~80 convolutions' activations at 224x224); > 8 GiB before
    pytest.param("efficientnet_b0", 512 * MiB, "3x the weights + 512 MiB", marks=pytest.mark.slow),
], ids=["efficientnet_tiny", "efficientnet_b0"])
def test_efficientnet_builds_in_bounded_memory_and_matches_onnxruntime(name, bound, what, tmp_path):
    built = build_in_child(name, tmp_path)
    check_outputs(name, built)
    check_peak(name, built, 3 * built.model_weights + (bound or FIXED), what)


# ---- ALBERT: one layer's weights read by every layer


def check_weights_stored_once(name: str, built: Built) -> None:
    assert built.distinct_large_weights == built.large_weights, \
        f"{name}: {built.large_weights - built.distinct_large_weights} large engine weight(s) duplicate another"
    # Not N copies of the shared layer: the engine holds what the model does, give or take the fused
    # layers' own small biases (below SHARE_MIN_ELEMENTS each, kept per layer: 0.4% of albert_base).
    assert built.weights_bytes <= 1.02 * built.model_weights, \
        f"{name}: the engine holds {built.weights_bytes} bytes of weights, the model {built.model_weights}"


def test_albert_tiny_stores_shared_weights_once_and_matches_onnxruntime(tmp_path):
    built = build_in_child("albert_tiny", tmp_path)
    check_outputs("albert_tiny", built)
    check_weights_stored_once("albert_tiny", built)
    check_peak("albert_tiny", built, 3 * built.model_weights + FIXED, "3x the weights + FIXED")


@pytest.fixture(scope="module")
def albert_base(tmp_path_factory):
    return build_in_child("albert_base", tmp_path_factory.mktemp("albert_base"))


@pytest.mark.slow
def test_albert_base_stores_shared_weights_once_and_matches_onnxruntime(albert_base):
    check_outputs("albert_base", albert_base)
    check_weights_stored_once("albert_base", albert_base)
    # Measured 0.36 GiB (8.7x its 42 MiB of weights); 0.55-0.57 GiB before layers of one weight shared one
    # prepared launch, the search's records one copy per activation and packed weights their own huge
    # pages; 1.23 GiB (29x) when folding, the GEMM fusions, lowering and the records each held a copy of
    # the shared layer per layer.
    check_peak("albert_base", albert_base, 512 * MiB, "512 MiB")


@pytest.mark.slow
def test_albert_base_build_memory_near_the_target(albert_base):
    # The target is 3x the weights + FIXED (287 MiB here). Since the search tunes each layer as
    # the example run reaches it (one layer's record alive at a time, not every layer's activations),
    # 7 builds on a loaded 2-core machine peaked at 252-289 MiB, one at 320 (316-333 before): the peak
    # now comes from the whole-engine check and the engine's load, and moves with the tactics the
    # timings pick. Bounded here at the target + 40 MiB; the target itself is met in most builds only.
    check_peak("albert_base", albert_base, 3 * albert_base.model_weights + FIXED + 40 * MiB,
               "3x the weights + FIXED + 40 MiB")
