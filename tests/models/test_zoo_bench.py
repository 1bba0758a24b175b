"""bench/zoo.py: every zoo model is in its table, the CPU run makes a table and a results file, a
failing model is a row that says how, and the CUDA mode's CPU-side parts work without a GPU.
No assertion on time (tests never assert on speed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import zoo
from kiln.builder.timing_cache import cpu_name

BENCH = Path(__file__).resolve().parents[2] / "bench" / "zoo.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_zoo", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_zoo"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


QUICK = ["--rounds", "1", "--iterations", "5", "--warmup", "1", "--budget", "2", "--timing-cache", ""]


def test_every_zoo_model_has_a_row(bench):
    ci = [a.ci for a in bench.ARCHITECTURES]
    full = [a.full for a in bench.ARCHITECTURES]
    assert set(ci) | set(full) == set(zoo.MODELS), "add the missing zoo models to bench/zoo.py's ARCHITECTURES"
    assert len(set(ci)) == len(ci) and len(set(full)) == len(full)
    assert not [n for n in ci if zoo.get(n).slow], "a CI variant is marked slow"
    assert len(bench.ARCHITECTURES) >= 20


def test_cpu_run_prints_a_table_and_writes_results(bench, tmp_path, capsys):
    lines = bench.main(["--models", "dcn_tiny,lstm_forecaster", "--results", str(tmp_path), *QUICK])
    rows = [line for line in lines if line.startswith("| DCN recommender") or line.startswith("| LSTM forecaster")]
    assert len(rows) == 2 and all("failed" not in r for r in rows), lines
    (written,) = tmp_path.glob("zoo-cpu-*.md")
    text = written.read_text()
    assert "| DCN recommender | dcn_tiny | dense 16x13, sparse 16x26 |" in text
    assert f"- device: {cpu_name()}" in text
    assert "kiln / ort by round" in text and "failed: none" in text


def test_thread_clock_run_is_tagged_and_needs_one_thread(bench, tmp_path):
    """--clock thread times the calling thread's CPU (one thread only: more would leave the workers out);
    --tag names the results file (bench/zoo_avx2.py writes zoo-cpu-avx2-<date>.md)."""
    lines = bench.main(["--models", "dcn_tiny", "--results", str(tmp_path), "--threads", "1", "--clock", "thread",
                        "--tag", "avx2", *QUICK])
    assert any(line.startswith("| DCN recommender") and "failed" not in line for line in lines), lines
    (written,) = tmp_path.glob("zoo-cpu-avx2-*.md")
    assert "latency in ms (CPU time of the calling thread)" in written.read_text()
    with pytest.raises(SystemExit):
        bench.parse_args(["--threads", "2", "--clock", "thread"])


def test_a_failing_model_is_a_row(bench, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("node 'x' (Foo, #3): no kernel")

    monkeypatch.setattr(bench.kiln, "build", refuse)
    lines = bench.main(["--models", "dcn_tiny", "--results", str(tmp_path), "--no-write", *QUICK])
    (row,) = [line for line in lines if line.startswith("| DCN recommender")]
    assert "failed: RuntimeError: node 'x' (Foo, #3): no kernel" in row
    assert row.count("|") == lines[0].count("|"), "a failed row keeps the table's columns"


def test_cuda_mode_without_a_gpu_says_so(bench):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/zoo.py --device cuda runs for real")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--device", "cuda", "--models", "dcn_tiny", "--no-write"])


def test_cuda_table_and_inputs_on_the_cpu(bench):
    exported = zoo.export("dcn_tiny")
    feeds = exported.inputs()
    half = bench.tensors(feeds, "cpu", half=True)
    assert half["dense"].dtype == torch.float16 and half["sparse"].dtype == torch.int64
    model = zoo.torch_model("dcn_tiny")
    with torch.inference_mode():
        want = bench.as_list(model(**bench.tensors(feeds, "cpu", half=False)))
    assert bench.relative_error_torch(want, want) == 0.0
    np.testing.assert_allclose(want[0].numpy(), model(**bench.tensors(feeds, "cpu", half=False)).detach().numpy())

    ok = bench.CudaRow("DCN recommender", "dcn_tiny", "dense 16x13, sparse 16x26",
                       ms={"torch eager": 2.0, "torch.compile": 1.0, "reduce-overhead": None, "kiln": 0.5},
                       error_vs_fp32=1e-3, torch_fp16_vs_fp32=2e-3, build_s=3.0)
    failed = bench.CudaRow("Swin", "swin_tiny", error="RuntimeError: boom")
    lines = bench.cuda_table([ok, failed])
    assert "| **2.00x** |" in lines[2] and "| — |" in lines[2]
    assert "failed: RuntimeError: boom" in lines[3] and lines[3].count("|") == lines[0].count("|")
