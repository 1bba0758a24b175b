"""`kiln perf` against a live server: a short concurrency sweep over HTTP and gRPC with either client, JSON and PNG
out; the wire client's check of every answer against its own request, failing on a server that mixes answers up."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from conftest import options

from kiln.cli import main
from kiln.serve import ServerThread, perf, perf_wire
from kiln.serve.batcher import Batcher
from kiln.serve.perf_check import FLOOR_ULPS, NUMPY_TYPES, RTOL, SPREAD_FACTOR, Answer, Reference


@pytest.mark.parametrize("client", ["wire", "tritonclient"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_sweep(grpc_server, tmp_path, capsys, protocol, client):
    port = grpc_server.ports.http if protocol == "http" else grpc_server.ports.grpc
    out, png = tmp_path / "perf.json", tmp_path / "perf.png"
    code = main(["perf", "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency", "1", "4",
                 "-b", "2", "--measurement-interval", "300", "--warmup", "0.1", "--max-requests", "200",
                 "--client", client, "--json", str(out), "--plot", str(png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "infer/s" in printed and "p99 ms" in printed
    results = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 4]
    assert all(r["requests"] > 0 and r["errors"] == 0 and r["batch_size"] == 2 for r in results)
    if client == "wire":  # every answer checked (warm-up included), none wrong
        assert all(r["checked"] >= r["requests"] and r["wrong"] == 0 and r["requests"] <= 200 for r in results), results
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _perf(repository, tmp_path, protocol: str) -> tuple[int, dict | None]:
    """kiln perf (wire client, concurrency 16, a 500 ms window) against a server of `repository` started for it and
    stopped after: the exit code and the level's JSON (None: none)."""
    thread = ServerThread(options(repository, metrics_port=None))
    running = thread.start()
    out = tmp_path / "perf.json"
    try:
        port = running.ports.http if protocol == "http" else running.ports.grpc
        code = main(["perf", "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency", "16",
                     "--measurement-interval", "500", "--warmup", "0.2", "--json", str(out)])
    finally:
        thread.stop()
    return code, json.loads(out.read_text())["results"][0] if out.exists() else None


def _perf_mixed_up(repository, monkeypatch, tmp_path, protocol: str) -> tuple[int, dict | None]:
    """_perf against a server whose batcher hands each request of a merged call the next request's rows (shapes
    right, values another's)."""
    run_batch = Batcher._run_batch

    def mixed_up(self, instance, batch):
        result = run_batch(self, instance, batch)
        result.outputs = result.outputs[1:] + result.outputs[:1]
        return result

    monkeypatch.setattr(Batcher, "_run_batch", mixed_up)
    return _perf(repository, tmp_path, protocol)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_wire_client_catches_answers_mixed_up_before_the_load(repository, monkeypatch, tmp_path, capsys, protocol):
    """The requests sent together before the load (their batched-vs-alone spread) already show the mix-up."""
    code, result = _perf_mixed_up(repository, monkeypatch, tmp_path, protocol)
    assert code == 1 and result is None
    error = capsys.readouterr().err
    assert "answered together (batched)" in error and "answers mixed up" in error, error


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_wire_client_catches_answers_mixed_up_under_load(repository, monkeypatch, tmp_path, capsys, protocol):
    """Without the pass together (a server that mixes up only under load), each answer's check fails."""
    monkeypatch.setattr(perf_wire, "TOGETHER_ROUNDS", 0)
    code, result = _perf_mixed_up(repository, monkeypatch, tmp_path, protocol)
    assert code == 1
    assert result["wrong"] > 0, result
    printed = capsys.readouterr().out
    assert "differs from its answer alone" in printed and "answers mixed up" in printed, printed


def _alike(datatype, shape, name, rng):
    """Requests whose answers differ by ~1e-4 of their magnitude: within FP32's RTOL (1e-3) of each other, as
    random-weight MobileNetV2's and BERT-base's were within FP16's (2e-2)."""
    return (100 + 0.01 * rng.standard_normal(shape)).astype(np.float32)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_wire_client_catches_alike_answers_mixed_up(repository, monkeypatch, tmp_path, capsys, protocol):
    """Answers alike within the datatype's tolerance: the tolerance narrowed to the server's batched-vs-alone spread
    (exact on the CPU: the floor) still tells them apart; at FP32's 1e-3 of the largest value the mix-up passed."""
    monkeypatch.setattr(perf, "_random", _alike)
    monkeypatch.setattr(perf_wire, "TOGETHER_ROUNDS", 0)
    code, result = _perf_mixed_up(repository, monkeypatch, tmp_path, protocol)
    assert code == 1 and result["wrong"] > 0, result
    assert "answers mixed up" in capsys.readouterr().out


def _fp16_engine(run_batch, ulps: int):
    """Batcher._run_batch answering as an FP16 engine with FP32 bindings: every output on FP16's grid, and a batch
    of several requests `ulps` FP16 spacings off (at each output's largest magnitude) in its top binade's values,
    as BERT-base fp16's batch 8 was from batch 1 on the H200 (2.5)."""

    def answered(self, instance, batch):
        result = run_batch(self, instance, batch)
        rng = np.random.default_rng()
        for outputs in result.outputs:
            for name, array in outputs.items():
                values = array.astype(np.float16).astype(np.float64)
                if len(batch) > 1 and values.any():
                    top = np.exp2(np.floor(np.log2(np.abs(values).max())))
                    noise = ulps * top * 2.0 ** -10 * rng.choice([-1.0, 1.0], values.shape)
                    values = np.where(np.abs(values) >= top, values + noise, values)
                outputs[name] = values.astype(np.float32)
        return result

    return answered


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_wire_client_passes_an_fp16_engines_batch_noise(repository, monkeypatch, tmp_path, capsys, protocol):
    """FP32 answers of an FP16 engine, batched ones 3 FP16 ulps off their answers alone: honest noise, every answer
    passes (at FP32's 1e-3 the H200's BERT-base stopped before its load); mixed up as well, they fail before the load."""
    monkeypatch.setattr(Batcher, "_run_batch", _fp16_engine(Batcher._run_batch, 3))
    code, result = _perf(repository, tmp_path, protocol)
    assert code == 0, capsys.readouterr().err
    assert result["requests"] > 0 and result["wrong"] == 0 and result["errors"] == 0, result
    assert result["checked"] >= result["requests"]
    (tmp_path / "mixed").mkdir()
    code, result = _perf_mixed_up(repository, monkeypatch, tmp_path / "mixed", protocol)
    assert code == 1 and result is None
    error = capsys.readouterr().err
    assert "answered together (batched)" in error and "answers mixed up" in error, error


def test_wire_client_counts_unanswered_calls_as_errors(repository, monkeypatch, tmp_path, capsys):
    """Calls still unanswered DRAIN_S after the window (a stalled engine) are errors, not wrong answers, not nothing:
    the H200's BERT-base row read 0 infer/s and 0 errors."""
    stalled = threading.Event()
    run_batch = Batcher._run_batch

    def stalling(self, instance, batch):
        if stalled.is_set():
            time.sleep(2.0)
        return run_batch(self, instance, batch)

    wire_plan = perf._wire_plan

    async def then_stall(*args):
        plan = await wire_plan(*args)
        stalled.set()
        return plan

    monkeypatch.setattr(Batcher, "_run_batch", stalling)
    monkeypatch.setattr(perf, "_wire_plan", then_stall)
    monkeypatch.setattr(perf_wire, "DRAIN_S", 0.3)
    thread = ServerThread(options(repository, metrics_port=None))
    running = thread.start()
    out = tmp_path / "perf.json"
    try:
        code = main(["perf", "-m", "mlp", "-u", f"127.0.0.1:{running.ports.grpc}", "-i", "grpc", "--concurrency", "4",
                     "--measurement-interval", "300", "--warmup", "0.1", "--json", str(out)])
    finally:
        stalled.clear()
        thread.stop()
    result = json.loads(out.read_text())["results"][0]
    assert code == 1
    assert result["requests"] == 0 and result["wrong"] == 0 and result["errors"] == 4, result
    assert "4 call(s) unanswered" in capsys.readouterr().out


def _answer(request_id: str, values: np.ndarray, datatype: str = "FP16") -> Answer:
    return Answer(request_id, [("y", datatype, list(values.shape), values.tobytes())])


def test_reference_tolerance_is_the_datatypes():
    rng = np.random.default_rng()
    values = rng.standard_normal((2, 300)).astype(np.float16)
    reference = Reference(_answer("3", values), None)
    largest = float(np.abs(values).max())
    near = (values.astype(np.float32) + 0.01 * largest).astype(np.float16)  # fp16's 2e-2 of the largest: passes
    far = values.copy()
    far[1, -1] += np.float16(0.05 * largest)  # the last value, always among the sampled ones
    assert reference.check(_answer("3", near), full=True) is None
    assert "differs from its answer alone" in reference.check(_answer("3", far), full=False)
    assert "answered with id '4'" in reference.check(_answer("4", values), full=False)
    assert "outputs" in reference.check(_answer("3", values.reshape(300, 2)), full=False)
    integers = rng.integers(0, 100, (4, 5)).astype(np.int64)
    exact = Reference(_answer("0", integers, "INT64"), None)
    off = integers.copy()
    off[2, 3] += 1
    assert exact.check(_answer("0", integers, "INT64"), full=True) is None
    assert exact.check(_answer("0", off, "INT64"), full=True) is not None  # integers exact


def test_reference_tolerance_narrows_to_the_spread():
    """narrow(): SPREAD_FACTOR x the batched-vs-alone spread, no less than FLOOR_ULPS of the datatype's spacing at
    the largest magnitude, never above RTOL."""
    values = np.random.default_rng().standard_normal((4, 50)).astype(np.float16)
    largest = float(np.abs(values.astype(np.float64)).max())
    floor = FLOOR_ULPS * float(np.spacing(np.float16(largest)))
    for spread, expected in ((0.0, floor), (2e-3 * largest, SPREAD_FACTOR * 2e-3 * largest),
                             (largest, RTOL["FP16"] * largest)):
        reference = Reference(_answer("0", values), None)
        reference.narrow([spread])
        assert reference.outputs[0].tolerance == pytest.approx(expected)
    reference.narrow([0.0])  # at the floor: 1% of the largest off fails, as two alike requests' answers would
    off = (values.astype(np.float32) + 0.01 * largest).astype(np.float16)
    assert "differs from its answer alone" in reference.check(_answer("0", off), full=True)
    assert reference.off(_answer("0", off)) > 1


def _on_grid(values: np.ndarray, grid: str, datatype: str) -> np.ndarray:
    """`values` rounded to `grid`'s values and answered as `datatype` (an FP16 engine's FP32 output)."""
    return values.astype(NUMPY_TYPES[grid]).astype(NUMPY_TYPES[datatype])


def _noise(alone: np.ndarray, ulps: int, spacing: float, rng: np.random.Generator) -> np.ndarray:
    """`alone` with its values of the largest magnitude's binade (the last one among them: always sampled) moved by
    +-`ulps` of that binade's `spacing`: still on the grid."""
    noisy = alone.astype(np.float64).reshape(-1)
    moved = np.flatnonzero(np.abs(noisy) >= np.exp2(np.floor(np.log2(np.abs(noisy).max()))))
    noisy[moved] += ulps * spacing * rng.choice([-1.0, 1.0], moved.size)
    return noisy.reshape(alone.shape).astype(alone.dtype)


@pytest.mark.parametrize("grid, datatype", [("FP16", "FP16"), ("FP16", "FP32"), ("BF16", "BF16"), ("BF16", "FP32"),
                                            ("FP32", "FP32")])
def test_reference_tolerance_is_ulps_of_the_precision_computed_in(grid, datatype):
    """An output computed in `grid` (answered as `datatype`: the FP16 engine's FP32 bindings of BERT-base on the
    H200) is judged in `grid`'s units in the last place at its largest magnitude: batch noise of 2-3 of them passes
    before and after narrowing (at the floor, when the rounds before the load showed none), another request's
    answer alike within 30 of them (FP16: 2.6% of the largest; random-weight MobileNetV2's were within 2%) does not. The spacing is numpy's (ml_dtypes' for bfloat16)."""
    rng = np.random.default_rng()
    alone = _on_grid(4.44 * rng.uniform(-1, 1, (16, 768)), grid, datatype)
    alone[-1, -1] = _on_grid(np.float64(4.44), grid, datatype)
    largest = np.abs(alone.astype(np.float64)).max()
    spacing = float(np.spacing(np.asarray(largest, NUMPY_TYPES[grid])))
    other = _on_grid(alone.astype(np.float64) + 30 * spacing * rng.uniform(-1, 1, alone.shape), grid, datatype)
    for rounds_spread in (0, 3):  # ulps the requests answered together differed by before the load
        reference = Reference(_answer("0", alone, datatype), None)
        assert reference.outputs[0].precision == grid
        together = _noise(alone, rounds_spread, spacing, rng)
        assert reference.check(_answer("0", together, datatype), full=True) is None
        reference.narrow(reference.errors(_answer("0", together, datatype)))
        assert reference.outputs[0].tolerance == pytest.approx(max(FLOOR_ULPS, SPREAD_FACTOR * rounds_spread) * spacing)
        for ulps in (2, 3):
            assert reference.check(_answer("0", _noise(alone, ulps, spacing, rng), datatype), full=True) is None
        swapped = reference.check(_answer("0", other, datatype), full=True)
        assert swapped is not None and "differs from its answer alone" in swapped
        assert reference.off(_answer("0", other, datatype)) > 1


def test_reference_fp32_off_the_fp16_grid_keeps_fp32s_tolerance():
    """An FP32 output with values off FP16's grid was computed in FP32: judged at FP32's 1e-3 of its largest, the
    H200's 2.5 FP16 ulps of BERT-base (0.0098 at 4.44) fail, as they did before FP16 answers were told apart."""
    rng = np.random.default_rng()
    alone = (4.44 * rng.uniform(-1, 1, (16, 768))).astype(np.float32)
    alone[0, 0] = 4.44
    reference = Reference(_answer("0", alone, "FP32"), None)
    assert reference.outputs[0].precision == "FP32"
    assert reference.outputs[0].tolerance == pytest.approx(RTOL["FP32"] * 4.44, rel=1e-6)
    noisy = alone.copy()
    noisy[-1, -1] += 2.5 * 2.0 ** -8
    assert "differs from its answer alone" in reference.check(_answer("0", noisy, "FP32"), full=False)


def test_perf_reports_an_unknown_model(server, capsys):
    code = main(["perf", "-m", "nope", "-u", f"127.0.0.1:{server.ports.http}", "--measurement-interval", "100"])
    assert code == 1
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_perf_spreads_clients_over_processes(grpc_server, capsys):
    """--processes 2: each level's clients split over two worker processes measuring one window."""
    code = main(["perf", "-m", "mlp", "-u", f"127.0.0.1:{grpc_server.ports.grpc}", "-i", "grpc", "--concurrency", "1", "4",
                 "--processes", "2", "--measurement-interval", "500", "--warmup", "0.2"])
    assert code == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4]
    assert all(int(r[6]) > 0 and int(r[7]) == 0 and int(r[9]) == 0 for r in rows)  # answered; no errors, none wrong
