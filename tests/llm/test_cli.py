"""kiln llm generate and kiln llm bench, run in-process on a tiny checkpoint."""

import json

from kiln.cli import main


def test_generate_prints_the_text(hf_models, capsys):
    folder, _ = hf_models("llama")
    assert main(["llm", "generate", str(folder), "--prompt", "Hello world", "--prompt", "Hi", "--max-tokens", "5",
                 "--kv-cache-memory", "2MiB"]) == 0
    out = capsys.readouterr().out
    assert out.count("5 tokens, finish_reason length") == 2 and "--- prompt 1: 'Hi'" in out


def test_bench_serves_the_model_and_reports_vllm_bench_numbers(hf_models, tmp_path, capsys):
    folder, _ = hf_models("llama")
    report_path = tmp_path / "report.json"
    assert main(["llm", "bench", str(folder), "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                 "--max-concurrency", "3", "--goodput", "ttft:60000", "--kv-cache-memory", "4MiB", "--json",
                 str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["input_tokens"] == 6 * 16 and report["output_tokens"] == 6 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(report[key]) == {"mean", "median", "p90", "p99", "max"}
    assert report["goodput"] > 0 and report["output_throughput"] > 0
    out = capsys.readouterr().out
    assert "Time to First Token" in out and "Request goodput (req/s):" in out


def test_cli_errors_are_one_line(hf_models, capsys):
    assert main(["llm", "bench"]) == 1
    assert "give a model folder" in capsys.readouterr().err
    assert main(["llm", "generate", "/nonexistent", "--prompt", "x"]) == 1
    assert "no config.json" in capsys.readouterr().err
