"""kiln perf's check of an answer against its own request (the wire client, kiln/serve/perf_wire.py): each request
is first answered alone and that answer kept as its Reference; under load an answer must carry the request's id and
the same outputs (names, datatypes, shapes, sizes), byte for byte or within the datatype's tolerance: SAMPLES values
spread over each output in every answer, all of them when asked (`full`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError

SAMPLES = 16  # values of each output checked in every answer
NUMPY_TYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
               "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
               "FP32": np.float32, "FP64": np.float64}
# of the output's largest magnitude: a batched call may take other kernels than the request alone (other tiles,
# other accumulation orders; fp16 rounds each partial sum to 11 bits); integers and booleans exact
RTOL = {"FP16": 2e-2, "FP32": 1e-3, "FP64": 1e-9}


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
    tolerance: float
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
            relative = RTOL.get(datatype, 0.0) if rtol is None else rtol
            self.outputs.append(Expected(name, datatype, list(shape), bytes(data), values, relative * largest, at,
                                         values[at]))

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
                error = np.abs(values[e.at] - e.sample).max()
            if not error <= e.tolerance:  # NaN fails too
                return (f"request {self.id!r}: output {name!r} differs from its answer alone by {error:.4g} "
                        f"(tolerance {e.tolerance:.4g}{'' if full else ', sampled values'})")
        return None

    def distance(self, other: Reference) -> float:
        """How far apart two requests' answers are, in tolerances (inf when their outputs differ in shape)."""
        if [e.values.size for e in self.outputs] != [e.values.size for e in other.outputs]:
            return float("inf")
        return max((np.abs(a.values - b.values).max() / a.tolerance if a.tolerance else
                    float("inf") if (a.values != b.values).any() else 0.0)
                   for a, b in zip(self.outputs, other.outputs)) if self.outputs else 0.0


def numpy_type(datatype: str, name: str):
    if datatype not in NUMPY_TYPES:
        raise KilnError(f"{name!r} is {datatype}: the wire client sends and checks numeric tensors "
                        f"({', '.join(NUMPY_TYPES)}); use --client tritonclient")
    return NUMPY_TYPES[datatype]
