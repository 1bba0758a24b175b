import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the ONNX backend node suite's pass count (the number issue #2 asks for)."""
    stats = terminalreporter.stats
    counts = {}
    for key in ("passed", "failed", "skipped", "error"):
        counts[key] = sum(1 for r in stats.get(key, []) if "OnnxBackendNodeModelTest" in r.nodeid)
    total = sum(counts.values())
    if not total:
        return
    from tests.conformance.excluded import EXCLUDED

    run = counts["passed"] + counts["failed"] + counts["error"]
    terminalreporter.write_sep("=", "ONNX backend node suite through kiln")
    terminalreporter.write_line(
        f"passed {counts['passed']} of {run} run ({100 * counts['passed'] / max(run, 1):.1f}%); "
        f"failed {counts['failed'] + counts['error']}; skipped {counts['skipped']}; "
        f"{len(EXCLUDED)} exclusion pattern(s) listed with reasons in tests/conformance/excluded.py"
    )
