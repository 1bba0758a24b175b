"""Run memory reported by `kiln build -v` and `kiln bench` (issue 11), measured by kiln/runtime/rss.py.

PeakMemory's phase peak is checked against an allocation of known size (a measure that always says 0
would fail); the CLI rows are checked for presence and plausibility, never for a number that depends
on the machine.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from kiln.cli import main
from kiln.runtime.rss import PeakMemory, resident_bytes
from tests.unit.test_memory_shared_weights import shared_layers_model

MiB = 1 << 20


def test_a_phase_peak_sees_memory_touched_and_freed_inside_it():
    peak = PeakMemory.start()
    block = np.ones(64 * MiB // 8)  # 64 MiB touched, then freed before the phase ends
    assert block.sum() > 0
    del block
    if peak.method == "VmHWM":
        assert peak.delta() >= 60 * MiB
        later = PeakMemory.start()  # a new phase starts from the current RSS: the freed block is not in it
        assert later.delta() < 32 * MiB
    assert resident_bytes() > 0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("run_memory") / "shared.onnx"
    onnx.save(shared_layers_model(transpose_per_layer=True), path)
    return path


def test_kiln_build_verbose_reports_run_memory(model_path, capsys):
    engine = model_path.with_suffix(".kiln")
    assert main(["build", str(model_path), "-o", str(engine), "-v"]) == 0
    out = capsys.readouterr().out
    assert "run memory" in out and "over the loaded engine during 2 runs" in out
    assert main(["build", str(model_path), "-o", str(engine)]) == 0
    assert "run memory" not in capsys.readouterr().out  # -v only


def test_kiln_bench_reports_each_runtimes_memory(model_path, tmp_path, capsys):
    engine = tmp_path / "shared.kiln"
    assert main(["build", str(model_path), "-o", str(engine)]) == 0
    capsys.readouterr()
    report = tmp_path / "bench.json"
    assert main(["bench", str(engine), "--against", "onnxruntime", "--iterations", "5", "--no-overhead",
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "peak RSS growth: kiln load +" in out and "onnxruntime runs +" in out
    memory = json.loads(report.read_text())["peak_rss_growth_bytes"]
    assert set(memory) == {"kiln load", "kiln runs", "onnxruntime load", "onnxruntime runs"}
    assert all(isinstance(v, int) and v >= 0 for v in memory.values())
