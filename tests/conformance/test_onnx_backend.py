"""The ONNX backend node suite (onnx.backend.test), run through kiln.build + engine.run.

Every case builds an engine with `kiln.backend.KilnBackend.prepare` and compares its outputs
with the suite's expected outputs at the suite's own tolerances. Excluded cases are listed
with their reasons in excluded.py; the pass count is printed at the end of the session
(see conftest.py).
"""

import warnings

import onnx.backend.test

from kiln.backend import KilnBackend
from tests.conformance.excluded import EXCLUDED

warnings.filterwarnings("ignore", category=RuntimeWarning)  # the suite's own data generation

backend_test = onnx.backend.test.BackendTest(KilnBackend, __name__)
backend_test.include(r"^test_.*_cpu$")
for pattern in EXCLUDED:
    backend_test.exclude(pattern)

OnnxBackendNodeModelTest = backend_test.test_cases["OnnxBackendNodeModelTest"]
