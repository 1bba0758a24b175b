"""`kiln bench --random-shapes | --shapes-from`: replay a stream of input shapes, as a service sees
them, and report what a user feels: latency percentiles over every call (first calls, captures and
all), the cost of a signature's first call, after warm-up, CUDA graphs captured / replayed /
evicted, and the memory high-water mark.

    --random-shapes "input_ids:1x1..32x512"   each request draws every dim in its range (uniformly);
                                              inputs sharing a symbol follow (attention_mask)
    --shapes-from FILE                        one request a line: NAME:DIMS[,NAME:DIMS...]
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.cli.common import parse_shapes
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.plan.spec import Binding
from kiln.runtime import profiler


def parse_random_shapes(spec: str) -> dict[str, tuple[list[int], list[int]]]:
    """`input_ids:1x1..32x512[,x:...]` -> {"input_ids": ([1, 1], [32, 512])}."""
    ranges = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, dims = item.rpartition(":")
        low, dots, high = dims.partition("..")
        if not sep or not name or not dots:
            raise KilnError(f"--random-shapes {item!r}: expected NAME:MINxMIN..MAXxMAX, e.g. input_ids:1x1..32x512")
        try:
            lo, hi = [int(d) for d in low.split("x")], [int(d) for d in high.split("x")]
        except ValueError:
            raise KilnError(f"--random-shapes {item!r}: dimensions must be integers separated by 'x'") from None
        if len(lo) != len(hi) or any(a > b or a < 0 for a, b in zip(lo, hi)):
            raise KilnError(f"--random-shapes {item!r}: MIN and MAX must have one rank and MIN <= MAX")
        ranges[name] = (lo, hi)
    return ranges


def shape_stream(bindings: list[Binding], *, random_shapes: str | None, shapes_from: str | None,
                 requests: int, seed: int) -> list[dict[str, list[int]]]:
    """One {input: shape} per request; inputs not named take their symbols from the ones named."""
    names = {b.name for b in bindings}
    if shapes_from:
        path = Path(shapes_from)
        if not path.is_file():
            raise KilnError(f"--shapes-from {path}: no such file")
        given = [parse_shapes([line]) for line in path.read_text().splitlines() if line.strip()]
        if not given:
            raise KilnError(f"--shapes-from {path}: no shapes in it")
    else:
        ranges = parse_random_shapes(random_shapes or "")
        rng = np.random.default_rng(seed)
        given = [{n: [int(rng.integers(a, b + 1)) for a, b in zip(lo, hi)] for n, (lo, hi) in ranges.items()}
                 for _ in range(requests)]
    unknown = sorted({n for g in given for n in g} - names)
    if unknown:
        raise KilnError(f"the shape stream names {unknown}, but the engine's inputs are {sorted(names)}")
    stream = []
    for g in given:
        symbols = {}
        for b in bindings:
            for d, n in zip(b.shape or [], g.get(b.name, [])):
                if isinstance(d, str):
                    symbols[d] = n
        shapes = {}
        for b in bindings:
            if b.name in g:
                shapes[b.name] = g[b.name]
            elif b.shape is not None and all(isinstance(d, int) or d in symbols for d in b.shape):
                shapes[b.name] = [d if isinstance(d, int) else symbols[d] for d in b.shape]
            else:
                raise KilnError(f"input {b.name!r} {b.describe()}: the shape stream gives no size for its dims")
        stream.append(shapes)
    return stream


def request_inputs(bindings: list[Binding], shapes: dict[str, list[int]], rng: np.random.Generator) -> dict:
    """Random inputs of these shapes; a mask input gets real padding (ones, then a tail of zeros)."""
    feeds = {}
    for b in bindings:
        shape = shapes[b.name]
        dt = dtypes.BY_NAME[b.dtype or "float"]
        if "mask" in b.name.lower() and len(shape) == 2 and not dt.is_float:
            mask = np.ones(shape, dt.numpy)
            for row in range(shape[0]):
                mask[row, rng.integers(1, shape[1] + 1) if shape[1] else 0:] = 0
            feeds[b.name] = mask
        elif dt.is_float:
            feeds[b.name] = rng.standard_normal(shape).astype(np.float32).astype(dt.numpy)
        else:
            feeds[b.name] = rng.integers(0, 4, size=shape).astype(dt.numpy)
    return feeds


@dataclass
class StreamResult:
    all_calls: profiler.LatencyStats
    warm_calls: profiler.LatencyStats | None  # the second half of the stream: after warm-up
    first_call_ms: float | None  # mean of the calls that met a shape for the first time
    signatures: int
    memory: str

    def to_json(self) -> dict[str, Any]:
        return {"all": self.all_calls.to_json(), "warm": self.warm_calls.to_json() if self.warm_calls else None,
                "first_call_ms": self.first_call_ms, "signatures": self.signatures, "memory": self.memory}


def replay(run, stream: list[dict], make_feeds, device: torch.device | None) -> StreamResult:
    """Time `run(feeds)` over the stream, every call (nothing is warmed up first)."""
    sync = profiler.device_sync(device) if device is not None else (lambda: None)
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seen: set[tuple] = set()
    first, every = [], []
    feeds_list = [make_feeds(shapes) for shapes in stream]
    for shapes, feeds in zip(stream, feeds_list):
        key = tuple(tuple(s) for s in shapes.values())
        t0 = time.perf_counter()
        run(feeds)
        sync()
        seconds = time.perf_counter() - t0
        every.append(seconds)
        if key not in seen:
            first.append(seconds)
        seen.add(key)
    warm = every[len(every) // 2:]
    if device is not None and device.type == "cuda":
        memory = f"device peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB allocated"
    else:
        memory = f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    return StreamResult(profiler.LatencyStats.from_samples(every),
                        profiler.LatencyStats.from_samples(warm) if warm else None,
                        1000 * sum(first) / len(first) if first else None, len(seen), memory)
