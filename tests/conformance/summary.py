"""Run the backend node suite without pytest and print failures grouped by op (a dev tool).

    python -m tests.conformance.summary [name-regex]
"""

from __future__ import annotations

import collections
import re
import sys
import time
import warnings

warnings.filterwarnings("ignore")

from onnx.backend.test.loader import load_model_tests  # noqa: E402
from onnx.backend.test.runner import Runner, _normalize_tensor  # noqa: E402

from kiln.backend import KilnBackend  # noqa: E402
from tests.conformance.excluded import EXCLUDED  # noqa: E402


def main() -> None:
    pattern = re.compile(sys.argv[1]) if len(sys.argv) > 1 else None
    cases = load_model_tests(kind="node")
    passed, failed, excluded = 0, [], 0
    t0 = time.time()
    for case in cases:
        if pattern and not pattern.search(case.name):
            continue
        if any(re.search(p, case.name + "_cpu") for p in EXCLUDED):
            excluded += 1
            continue
        try:
            rep = KilnBackend.prepare(case.model)
            for inputs, ref in case.data_sets:
                # in-memory cases may hold TensorProtos, as the suite's own runner allows
                inputs = [_normalize_tensor(t) for t in inputs]
                ref = [_normalize_tensor(t) for t in ref]
                out = rep.run(inputs)
                Runner.assert_similar_outputs(ref, out, rtol=case.rtol, atol=case.atol)
            passed += 1
        except Exception as e:  # noqa: BLE001  a dev report: every failure is listed
            msg = str(e).strip().splitlines()
            failed.append((case.name, type(e).__name__, (msg[0] if msg else "")[:160]))
    by_kind = collections.Counter(f[1] for f in failed)
    for name, kind, msg in failed:
        print(f"FAIL {name}: {kind}: {msg}")
    total = passed + len(failed)
    print(f"\n{passed}/{total} passed ({100 * passed / max(total, 1):.1f}%), {excluded} excluded, "
          f"{time.time() - t0:.0f}s; failures by type: {dict(by_kind)}")


if __name__ == "__main__":
    main()
