"""kiln perf's check of an answer against its own request (the wire client, kiln/serve/perf_wire.py): each request
is first answered alone and that answer kept as its Reference; under load an answer must carry the request's id and
the same outputs (names, datatypes, shapes, sizes), byte for byte or within tolerance: SAMPLES values spread over each
output in every answer, all of them when asked (`full`).

The tolerance of an output starts at the datatype's (RTOL of its largest magnitude: what a batched call's other
kernels may change) and is then narrowed to what the server showed (`narrow`): the requests answered together,
batched, differ from their answers alone by a spread; the tolerance becomes SPREAD_FACTOR times that spread, no less
than the datatype's FLOOR and no more than RTOL. Random-weight models answer distinct requests alike (MobileNetV2's
and BERT-base's 8 random requests were all within 2% of each other on the H200): at RTOL an answer given to the wrong
request would pass; at the narrowed tolerance it fails.
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
# the least tolerance a narrowed one keeps, of the output's largest magnitude: a few units in the last place
FLOOR = {"FP16": 4e-3, "FP32": 1e-5, "FP64": 1e-12}
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
            relative = RTOL.get(datatype, 0.0) if rtol is None else rtol
            self.outputs.append(Expected(name, datatype, list(shape), bytes(data), values, relative * largest, largest,
                                         at, values[at]))

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
        """Each output's tolerance down to SPREAD_FACTOR x its batched-vs-alone spread (FLOOR at least)."""
        for e, spread in zip(self.outputs, spreads):
            floor = FLOOR.get(e.datatype, 0.0) * e.largest
            e.tolerance = min(e.tolerance, max(SPREAD_FACTOR * spread, floor))

    def distance(self, other: Reference) -> float:
        """How far apart two requests' answers are, in tolerances (inf when their outputs differ in shape)."""
        if [e.values.size for e in self.outputs] != [e.values.size for e in other.outputs]:
            return float("inf")
        return max((_in_tolerances(np.abs(a.values - b.values).max(), a.tolerance)
                    for a, b in zip(self.outputs, other.outputs) if a.values.size), default=0.0)


def _in_tolerances(error: float, tolerance: float) -> float:
    return error / tolerance if tolerance else float("inf") if error else 0.0


def numpy_type(datatype: str, name: str):
    if datatype not in NUMPY_TYPES:
        raise KilnError(f"{name!r} is {datatype}: the wire client sends and checks numeric tensors "
                        f"({', '.join(NUMPY_TYPES)}); use --client tritonclient")
    return NUMPY_TYPES[datatype]
