"""`kiln perf` against a live server: a short concurrency sweep over HTTP and gRPC, JSON and PNG out."""

from __future__ import annotations

import json

import pytest

from kiln.cli import main


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_sweep(grpc_server, tmp_path, capsys, protocol):
    port = grpc_server.ports.http if protocol == "http" else grpc_server.ports.grpc
    out, png = tmp_path / "perf.json", tmp_path / "perf.png"
    code = main(["perf", "-m", "mlp", "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency", "1", "4",
                 "-b", "2", "--measurement-interval", "300", "--warmup", "0.1", "--max-requests", "200",
                 "--json", str(out), "--plot", str(png)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "infer/s" in printed and "p99 ms" in printed
    results = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 4]
    assert all(r["requests"] > 0 and r["errors"] == 0 and r["batch_size"] == 2 for r in results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    assert all(int(r[-2]) > 0 and int(r[-1]) == 0 for r in rows)  # requests answered, no errors
