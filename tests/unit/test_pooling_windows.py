"""Pooling windows against onnxruntime and the ONNX reference: kernels larger than the input,
ceil_mode, count_include_pad, auto_pad, asymmetric pads and dilations, fp32 and fp16.

kiln reduces each window over the taps inside the input and counts the divisor from the
geometry, never padding the input (kiln/ops/nn.py, Pooling). Every case runs through
`kiln.build` twice: with every tactic (what users get) and with the op's own implementation only
(tactics=["none"] allows no tactic), so the reference semantics are checked even where a tactic
would win. Fresh random inputs per case (seeded by its id).

Oracles: onnxruntime on every case. `onnx.reference` (1.23) too where it follows the spec; it
does not where a ceil_mode tail exists (it splits the tail's padding over both ends, shifting every
window), for kernels larger than the input (NaN or 0 for the mean) and for MaxPool with
SAME_LOWER, so those cases name onnxruntime alone. ONNX shape inference also misses the spec's
"a ceil_mode window may not start in the end padding" rule, so outputs are declared by type only.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import kiln
from kiln.ops.nn import PoolAxis
from tests.unit.oracle import assert_close, one_node_model, run_oracle

# (rtol, atol) per output dtype. fp32: kiln and onnxruntime sum a window in different orders
# (a few ulp). fp16: both sum in fp32 and round once, so they may differ by one fp16 ulp (~1e-3).
TOLERANCE = {
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float16): (1e-3, 1e-3),
}


@dataclass
class PoolCase:
    id: str
    op: str
    shape: tuple[int, ...]
    attrs: dict = field(default_factory=dict)
    outputs: int = 1
    oracles: tuple[str, ...] = ("ort", "ref")
    dtypes: tuple[type, ...] = (np.float32, np.float16)
    opset: int = 19


def ort_only(case_id, op, shape, **attrs):
    return PoolCase(case_id, op, shape, attrs, oracles=("ort",))


CASES = [
    # A kernel larger than the input, ceil_mode: transformers' EfficientNet head (AvgPool2d(1280,
    # ceil_mode=True) on 7x7) in small.
    ort_only("avg-kernel-larger-ceil", "AveragePool", (2, 3, 5, 6), kernel_shape=[9, 11], strides=[9, 11],
             ceil_mode=1),
    ort_only("avg-kernel-larger-ceil-include-pad", "AveragePool", (2, 3, 5, 6), kernel_shape=[9, 11],
             strides=[9, 11], ceil_mode=1, count_include_pad=1),
    ort_only("avg-kernel-larger-overlapping", "AveragePool", (2, 3, 7, 7), kernel_shape=[8, 8], strides=[3, 3],
             ceil_mode=1),
    ort_only("avg-kernel-larger-asym-pads-include", "AveragePool", (2, 3, 7, 7), kernel_shape=[8, 9],
             strides=[3, 2], ceil_mode=1, pads=[1, 2, 1, 0], count_include_pad=1),
    ort_only("avg-kernel-larger-asym-pads-exclude", "AveragePool", (2, 3, 7, 7), kernel_shape=[8, 9],
             strides=[3, 2], ceil_mode=1, pads=[1, 2, 1, 0]),
    ort_only("avg-1d-kernel-larger", "AveragePool", (2, 3, 11), kernel_shape=[15], strides=[4], ceil_mode=1,
             pads=[1, 3]),
    ort_only("avg-3d-kernel-larger-include", "AveragePool", (1, 2, 5, 6, 7), kernel_shape=[2, 8, 3],
             strides=[2, 8, 2], ceil_mode=1, pads=[1, 0, 0, 0, 0, 1], count_include_pad=1),
    ort_only("max-kernel-larger-ceil", "MaxPool", (2, 3, 5, 6), kernel_shape=[9, 11], strides=[9, 11],
             ceil_mode=1),
    ort_only("max-kernel-larger-asym-pads", "MaxPool", (2, 3, 7, 7), kernel_shape=[8, 9], strides=[3, 2],
             ceil_mode=1, pads=[1, 2, 1, 0]),
    ort_only("max-3d-kernel-larger", "MaxPool", (1, 2, 5, 6, 7), kernel_shape=[2, 8, 3], strides=[2, 8, 2],
             ceil_mode=1, pads=[1, 0, 0, 0, 0, 1]),
    ort_only("lp-kernel-larger-ceil", "LpPool", (2, 3, 7, 7), kernel_shape=[8, 9], strides=[3, 2], ceil_mode=1,
             pads=[1, 2, 1, 0], p=2),
    # Begin pads over half the kernel (torch's kernels refuse them) and end pads unlike the begin ones.
    PoolCase("avg-begin-pad-over-half-include", "AveragePool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 3], strides=[2, 2], pads=[2, 0, 0, 2], count_include_pad=1)),
    ort_only("avg-begin-pad-over-half-ceil", "AveragePool", (2, 3, 9, 8), kernel_shape=[3, 3], strides=[2, 2],
             pads=[2, 0, 0, 2], ceil_mode=1),
    PoolCase("max-begin-pad-over-half", "MaxPool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 3], strides=[2, 2], pads=[2, 0, 0, 2])),
    PoolCase("avg-end-pads-larger-include", "AveragePool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 3], strides=[2, 1], pads=[0, 1, 2, 2], count_include_pad=1)),
    # Dilations (torch's average kernel has none).
    PoolCase("avg-dilations-ceil", "AveragePool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 2], strides=[2, 2], dilations=[2, 3], pads=[1, 1, 2, 0], ceil_mode=1)),
    PoolCase("avg-dilations-ceil-include", "AveragePool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 2], strides=[2, 2], dilations=[2, 3], pads=[1, 1, 2, 0], ceil_mode=1,
                  count_include_pad=1)),
    PoolCase("max-dilations-ceil", "MaxPool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 2], strides=[2, 2], dilations=[2, 3], pads=[1, 1, 2, 0], ceil_mode=1)),
    PoolCase("lp-dilations", "LpPool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 2], strides=[2, 2], dilations=[2, 3], pads=[1, 1, 2, 0], p=3),
             dtypes=(np.float32,)),  # fp16: the reference's |x|**3 in fp16 overflows its own precision
    # auto_pad.
    PoolCase("avg-same-upper-include", "AveragePool", (2, 3, 9, 8),
             dict(kernel_shape=[4, 3], strides=[3, 2], auto_pad="SAME_UPPER", count_include_pad=1)),
    PoolCase("avg-same-lower-include", "AveragePool", (2, 3, 9, 8),
             dict(kernel_shape=[4, 3], strides=[3, 2], auto_pad="SAME_LOWER", count_include_pad=1)),
    PoolCase("avg-valid", "AveragePool", (2, 3, 9, 8), dict(kernel_shape=[4, 3], strides=[3, 2], auto_pad="VALID")),
    ort_only("avg-same-upper-ceil", "AveragePool", (2, 3, 9, 8), kernel_shape=[4, 3], strides=[3, 2],
             auto_pad="SAME_UPPER", ceil_mode=1),  # the reference refuses ceil_mode with auto_pad
    ort_only("max-same-lower", "MaxPool", (2, 3, 9, 8), kernel_shape=[4, 3], strides=[3, 2], auto_pad="SAME_LOWER"),
    # MaxPool's Indices (fp32: onnxruntime's kernel with indices is fp32 only here).
    PoolCase("max-indices-kernel-larger", "MaxPool", (2, 3, 5, 6),
             dict(kernel_shape=[9, 11], strides=[9, 11], ceil_mode=1), outputs=2, dtypes=(np.float32,)),
    PoolCase("max-indices-asym-pads-ceil", "MaxPool", (2, 3, 7, 7),
             dict(kernel_shape=[8, 9], strides=[3, 2], ceil_mode=1, pads=[1, 2, 1, 0]), outputs=2,
             dtypes=(np.float32,)),
    PoolCase("max-indices-dilations", "MaxPool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 2], strides=[2, 2], dilations=[2, 3], pads=[1, 1, 2, 0], ceil_mode=1),
             outputs=2, dtypes=(np.float32,)),
    PoolCase("max-indices-col-major", "MaxPool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 1, 2, 0], ceil_mode=1, storage_order=1),
             outputs=2, dtypes=(np.float32,)),
    PoolCase("max-int8-asym-pads", "MaxPool", (2, 3, 9, 8),
             dict(kernel_shape=[3, 3], strides=[2, 2], pads=[2, 0, 0, 2], ceil_mode=1), dtypes=(np.int8,),
             oracles=("ort",)),
]

PARAMS = [pytest.param(case, np.dtype(dtype), id=f"{case.id}-{np.dtype(dtype).name}")
          for case in CASES for dtype in case.dtypes]


def _model(case: PoolCase, x: np.ndarray) -> onnx.ModelProto:
    names = [f"out{i}" for i in range(case.outputs)]
    node = helper.make_node(case.op, ["in0"], names, **case.attrs)
    model = one_node_model(node, {"in0": x}, opset=case.opset)
    types = [helper.np_dtype_to_tensor_dtype(x.dtype), onnx.TensorProto.INT64]
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types))
    return model


def _input(case: PoolCase, dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{case.id}-{dtype.name}".encode()))
    if dtype.kind == "i":
        return rng.integers(-128, 128, case.shape).astype(dtype)
    return rng.uniform(-3.0, 3.0, case.shape).astype(dtype)


@pytest.mark.parametrize("case, dtype", PARAMS)
def test_pool_matches_oracles(case: PoolCase, dtype: np.dtype) -> None:
    x = _input(case, dtype)
    model = _model(case, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference warns on its own empty means
        wants = {oracle: run_oracle(model, {"in0": x}, oracle) for oracle in case.oracles}
    for tactics in ([], ["none"]):
        got = kiln.build(model, tactics=tactics).run({"in0": x})
        for oracle, want in wants.items():
            for i, w in enumerate(want):
                assert_close(got[f"out{i}"], w, TOLERANCE, f"{case.id} {dtype.name} tactics={tactics} "
                                                              f"output {i} vs {oracle}")


# ---- the window grid itself


def test_tap_grid_of_a_kernel_larger_than_the_input_is_bounded_by_the_input():
    """EfficientNet's head: a 1280-wide window over 7 positions gathers 7 taps, not 1280."""
    axis = PoolAxis(size=7, kernel=1280, stride=1280, dilation=1, begin=0, end=0, out=1)
    index, valid = axis.tap_grid(torch.device("cpu"))
    assert index.tolist() == [list(range(7))] and bool(valid.all())
    assert axis.counts(include_pad=False).tolist() == [7.0]
    assert axis.counts(include_pad=True).tolist() == [7.0]  # ceil's tail is never counted


def test_tap_grid_counts_padding_and_dilation():
    # taps of window o: 2*o - 1 + 2*t, t in 0..2, over 6 positions, pads 1 and 2.
    axis = PoolAxis(size=6, kernel=3, stride=2, dilation=2, begin=1, end=2, out=4)
    index, valid = axis.tap_grid(torch.device("cpu"))
    inside = [[int(i) for i, ok in zip(row, oks) if ok] for row, oks in zip(index, valid)]
    assert inside == [[1, 3], [1, 3, 5], [3, 5], [5]]
    assert axis.counts(include_pad=False).tolist() == [2.0, 3.0, 2.0, 1.0]
    assert axis.counts(include_pad=True).tolist() == [3.0, 3.0, 3.0, 2.0]  # [-1, 8): 7 counts, 9 does not


# ---- memory: nothing proportional to the kernel's area


_MEMORY_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    import kiln
    from tests.unit.test_pooling_windows import memory_case_model
    import onnxruntime as ort

    model, x = memory_case_model()
    # A guard, not the measure: the address space may grow by 1 GiB at most, so a regression
    # (the padded 1280x1280 planes: 1.7 GB here) fails with MemoryError instead of taking the machine.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"in0": x})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = kiln.build(model).run({"in0": x})["out0"]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    np.testing.assert_allclose(got, want[0], rtol=1e-5, atol=1e-6)
    print(grown * 1024)
""")


def memory_case_model() -> tuple[onnx.ModelProto, np.ndarray]:
    """transformers' EfficientNet-B0 head: AveragePool(1280, ceil_mode) over [2, 64, 7, 7]."""
    x = np.random.default_rng(7).standard_normal((2, 64, 7, 7)).astype(np.float32)
    case = PoolCase("efficientnet-head", "AveragePool", x.shape,
                    dict(kernel_shape=[1280, 1280], strides=[1280, 1280], ceil_mode=1, count_include_pad=1))
    return _model(case, x), x


def test_kernel_larger_than_input_allocates_nothing_like_its_area():
    result = subprocess.run([sys.executable, "-c", _MEMORY_CHILD], capture_output=True, text=True, timeout=300,
                            cwd=str(Path(__file__).parents[2]))
    assert result.returncode == 0, result.stderr[-3000:]
    grown = int(result.stdout.split()[-1])
    padded = 2 * 64 * 1280 * 1280 * 4  # what one padded fp32 copy of the input would be: 839 MB
    # The build itself (tactic timing, the engine) grows RSS by some tens of MB at most.
    assert grown < 128 << 20, f"building and running the pool grew RSS by {grown / 2**20:.0f} MiB " \
                              f"(the padded input alone would be {padded / 2**20:.0f} MiB)"
