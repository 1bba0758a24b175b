"""kiln perf's check of an answer against its own request (the wire client, kiln/serve/perf_wire.py): each request
is first answered alone and that answer kept as its Reference; under load an answer must carry the request's id and
the same outputs (names, datatypes, shapes, sizes), byte for byte or within tolerance: SAMPLES values spread over each
output in every answer, all of them when asked (`full`).

A float output's tolerance is set by the precision it was computed in, which the wire does not say: an FP16 engine
serving FP32 outputs (TensorRT's and kiln's --fp16 keep FP32 bindings) answers values that all lie on FP16's grid, and
is judged as FP16 (`precision`: the coarsest of BF16 and FP16 whose grid holds every value of the answer alone, else
the datatype's own). The tolerance starts at the precision's RTOL of the output's largest magnitude (what a batched
call's other kernels may change) and is then narrowed to what the server showed (`narrow`): the requests answered
together, batched, differ from their answers alone by a spread; the tolerance becomes SPREAD_FACTOR times that
spread, no less than FLOOR_ULPS units in the last place of the precision at the largest magnitude, no more than RTOL.
Random-weight models answer distinct requests alike (MobileNetV2's and BERT-base's 8 random requests were all within
2% of each other on the H200): at RTOL an answer given to the wrong request would pass; at the narrowed tolerance it
fails. (BERT-base fp16 on the H200, FP32 outputs: batch 8 vs 1 differed by 2.5 FP16 ulps of the largest value, which
FP32's 1e-3 refused.)
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kiln.errors import KilnError
from kiln.serve.datatypes import BY_V2

SAMPLES = 16  # values of each output checked in every answer
NUMPY_TYPES = {v2: d.numpy for v2, d in BY_V2.items() if v2 != "BYTES"}
# of the output's largest magnitude, by the precision it was computed in: a batched call may take other kernels than
# the request alone (other tiles, other accumulation orders; fp16 rounds each partial sum to 11 bits, bf16 to 8);
# integers and booleans exact
RTOL = {"BF16": 1.6e-1, "FP16": 2e-2, "FP32": 1e-3, "FP64": 1e-9}
COARSER = ("BF16", "FP16")  # grids an FP32/FP64 output's values may all lie on: the precision it was computed in
FLOOR_ULPS = 4  # the least tolerance a narrowed one keeps: units in the last place at the largest magnitude
SPREAD_FACTOR = 4  # the narrowed tolerance over the batched-vs-alone spread measured before the load


@dataclass
class Answer:
    id: str
    outputs: list[tuple[str, str, list[int], memoryview | bytes]]  # name, datatype, shape, the values' bytes


@dataclass
class Expected:
    """One output of a reference answer, and where its values are sampled."""
    name: str
    datatype: str
    shape: list[int]
    raw: bytes  # the values as answered: an answer of the same bytes passes at once
    values: np.ndarray  # [n] float64
    precision: str  # the float datatype it was computed in (precision()); its own datatype otherwise
    tolerance: float
    largest: float  # the largest magnitude of its values
    at: np.ndarray  # [SAMPLES] positions checked in every answer
    sample: np.ndarray  # values[at]


class Reference:
    """A request's answer alone: what every answer to it under load is checked against."""

    def __init__(self, answer: Answer, rtol: float | None):
        self.id = answer.id
        self.outputs = []
        for name, datatype, shape, data in answer.outputs:
            values = np.frombuffer(data, numpy_type(datatype, name)).astype(np.float64)
            at = np.linspace(0, values.size - 1, min(SAMPLES, values.size)).astype(np.int64)
            largest = float(np.abs(values).max()) if values.size else 0.0
            computed = precision(values, datatype)
            relative = RTOL.get(computed, 0.0) if rtol is None else rtol
            self.outputs.append(Expected(name, datatype, list(shape), bytes(data), values, computed,
                                         relative * largest, largest, at, values[at]))

    def check(self, answer: Answer, full: bool) -> str | None:
        """None when `answer` is this request's; else what differs."""
        if answer.id != self.id:
            return f"request {self.id!r} answered with id {answer.id!r}"
        got = [(name, datatype, list(shape)) for name, datatype, shape, _ in answer.outputs]
        want = [(e.name, e.datatype, e.shape) for e in self.outputs]
        if got != want:
            return f"request {self.id!r}: outputs {got}, alone it was answered {want}"
        for (name, _, _, data), e in zip(answer.outputs, self.outputs):
            if data == e.raw:
                continue
            values = np.frombuffer(data, NUMPY_TYPES[e.datatype])
            if values.size != e.values.size:
                return f"request {self.id!r}: output {name!r} of {values.size} values, expected {e.values.size}"
            if full:
                error = np.abs(values.astype(np.float64) - e.values).max()
            else:
                error = np.abs(values[e.at].astype(np.float64) - e.sample).max()
            if not error <= e.tolerance:  # NaN fails too
                return (f"request {self.id!r}: output {name!r} differs from its answer alone by {error:.4g} "
                        f"(tolerance {e.tolerance:.4g}{'' if full else ', sampled values'})")
        return None

    def errors(self, answer: Answer) -> list[float]:
        """Per output, the largest difference of an answer that passed check() from this answer alone."""
        return [float(np.abs(np.frombuffer(data, NUMPY_TYPES[e.datatype]).astype(np.float64) - e.values).max())
                if e.values.size else 0.0 for (_, _, _, data), e in zip(answer.outputs, self.outputs)]

    def off(self, answer: Answer) -> float:
        """How far an answer is from this one, in tolerances (inf when their outputs differ in size)."""
        values = [np.frombuffer(data, NUMPY_TYPES[e.datatype]) if e.datatype in NUMPY_TYPES else None
                  for (_, _, _, data), e in zip(answer.outputs, self.outputs)]
        if len(values) != len(self.outputs) or any(v is None or v.size != e.values.size
                                                    for v, e in zip(values, self.outputs)):
            return float("inf")
        return max((_in_tolerances(np.abs(v.astype(np.float64) - e.values).max(), e.tolerance)
                    for v, e in zip(values, self.outputs) if v.size), default=0.0)

    def narrow(self, spreads: list[float]) -> None:
        """Each output's tolerance down to SPREAD_FACTOR x its batched-vs-alone spread (FLOOR_ULPS at least)."""
        for e, spread in zip(self.outputs, spreads):
            floor = FLOOR_ULPS * ulp(e.largest, e.precision) if e.precision in RTOL else 0.0
            e.tolerance = min(e.tolerance, max(SPREAD_FACTOR * spread, floor))

    def distance(self, other: Reference) -> float:
        """How far apart two requests' answers are, in tolerances (inf when their outputs differ in shape)."""
        if [e.values.size for e in self.outputs] != [e.values.size for e in other.outputs]:
            return float("inf")
        return max((_in_tolerances(np.abs(a.values - b.values).max(), a.tolerance)
                    for a, b in zip(self.outputs, other.outputs) if a.values.size), default=0.0)


def _in_tolerances(error: float, tolerance: float) -> float:
    return error / tolerance if tolerance else float("inf") if error else 0.0


def precision(values: np.ndarray, datatype: str) -> str:
    """The float datatype `values` (float64, as answered in `datatype`) were computed in: the coarsest of COARSER
    whose grid holds every one of them (an FP32 answer of an FP16 engine, cast at its output), else `datatype`."""
    if datatype not in RTOL or not values.size:
        return datatype
    for coarser in COARSER[:COARSER.index(datatype) if datatype in COARSER else None]:
        with np.errstate(over="ignore"):  # beyond the coarser range: not on its grid
            on_grid = np.array_equal(values.astype(NUMPY_TYPES[coarser]).astype(np.float64), values, equal_nan=True)
        if on_grid:
            return coarser
    return datatype


def ulp(magnitude: float, datatype: str) -> float:
    """The spacing of `datatype`'s values at `magnitude` (its smallest, subnormal, at 0)."""
    info = ml_dtypes.finfo(NUMPY_TYPES[datatype])
    if magnitude < info.smallest_normal or not np.isfinite(magnitude):
        return float(info.smallest_subnormal)
    return float(info.eps) * 2.0 ** np.floor(np.log2(magnitude))


def numpy_type(datatype: str, name: str):
    if datatype not in NUMPY_TYPES:
        raise KilnError(f"{name!r} is {datatype}: the wire client sends and checks numeric tensors "
                        f"({', '.join(NUMPY_TYPES)}); use --client tritonclient")
    return NUMPY_TYPES[datatype]
