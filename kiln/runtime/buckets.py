"""Shape buckets: pad a run's inputs up to a few sizes per dynamic dim, so that a stream of
arbitrary shapes replays a bounded number of CUDA graphs (one per bucket, not one per shape).

Padding must never change a result. It is exact along a dim when every output element that is
kept (the crop back to the real size) is computed from real elements only:

    batch   rows of a batch never meet (inference normalisation, attention and GEMMs are per row):
            every symbol that is axis 0 of every input and output carrying it
    seq     where the model masks padding: an integer/bool input named like `attention_mask`,
            shaped [batch, seq], gets zeros in the padded positions, so attention never reads them;
            or where the user declares it (`pad_dims`, e.g. a causal decoder padded at the end)

A dim is padded only when every output carrying it carries it as a plain symbol (so it can be
cropped); padded values are zeros. Bucket sizes are powers of two from a floor (1 for batch, 8
for sequences), with a step of 1.5x between them from HALF_STEPS on (large sizes are where padding
costs compute: at most 1.5x there, not 2x), up to the profile's max, which is always a bucket.
BERT with batch 1..32 x seq 1..512: 7 x 9 = 63 buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.plan.spec import Binding, Profile

SEQUENCE_FLOOR = 8
HALF_STEPS = {1: 16, SEQUENCE_FLOOR: 128}  # floor -> the size from which 1.5x steps come in between
MASK_NAMES = ("attention_mask", "mask", "input_mask")


@dataclass
class Buckets:
    """Which (input, axis) and (output, axis) pairs carry each padded symbol."""

    symbols: dict[str, int]  # symbol -> smallest bucket
    pads: list[list[tuple[int, str]]]  # per input: [(axis, symbol)]
    crops: list[list[tuple[int, str]]]  # per output: [(axis, symbol)]

    def sizes(self, symbol: str, low: int, high: int) -> list[int]:
        """The buckets of `symbol` inside [low, high]: powers of two from the floor (with 1.5x steps
        between them from HALF_STEPS on), and high."""
        floor = max(self.symbols[symbol], 1)
        half_from = HALF_STEPS.get(floor, 1 << 30)
        ladder, size = [], floor
        while size < high:
            ladder.append(size)
            if size >= half_from and size * 3 // 2 < high:
                ladder.append(size * 3 // 2)
            size *= 2
        return [s for s in ladder if s >= low] + [high]

    def bucket(self, symbol: str, value: int, low: int, high: int) -> int:
        return next(s for s in self.sizes(symbol, low, high) if s >= value)

    def targets(self, inputs: list[torch.Tensor], profile: Profile, names: list[str]) -> dict[str, tuple[int, int]]:
        """symbol -> (real size, bucket size) for this run, inside `profile`'s range."""
        out: dict[str, tuple[int, int]] = {}
        for k, pads in enumerate(self.pads):
            r = profile.inputs.get(names[k])
            for axis, symbol in pads:
                if symbol in out or r is None:
                    continue
                value = int(inputs[k].shape[axis])
                out[symbol] = (value, self.bucket(symbol, value, r.min[axis], r.max[axis]))
        return out

    def pad(self, inputs: list[torch.Tensor], targets: dict[str, tuple[int, int]]) -> list[torch.Tensor]:
        """Inputs zero-padded to their buckets (unchanged where they already are there)."""
        padded = []
        for x, pads in zip(inputs, self.pads):
            shape = list(x.shape)
            for axis, symbol in pads:
                shape[axis] = targets[symbol][1]
            if shape == list(x.shape):
                padded.append(x)
                continue
            out = x.new_zeros(shape)
            out[tuple(slice(0, d) for d in x.shape)] = x
            padded.append(out)
        return padded

    def crop(self, outputs: list, targets: dict[str, tuple[int, int]]) -> list:
        cropped = []
        for y, crops in zip(outputs, self.crops):
            if crops and isinstance(y, torch.Tensor):
                index = [slice(None)] * y.dim()
                for axis, symbol in crops:
                    index[axis] = slice(0, targets[symbol][0])
                y = y[tuple(index)]
            cropped.append(y)
        return cropped


def plan_buckets(inputs: list[Binding], outputs: list[Binding], pad_dims: list[str] | None = None) -> Buckets | None:
    """The dims this engine may pad, or None when there is none (fixed shapes, or no dim where
    padding is exact). `pad_dims`: symbols the user declares exact to pad, besides batch and a
    masked sequence."""
    carriers: dict[str, list[tuple[str, int, int]]] = {}  # symbol -> [(input name, axis, rank)]
    for b in inputs:
        if b.kind != "tensor" or b.shape is None:
            continue
        for axis, d in enumerate(b.shape):
            if isinstance(d, str):
                carriers.setdefault(d, []).append((b.name, axis, len(b.shape)))
    floors: dict[str, int] = {}
    mask = next((b for b in inputs if b.kind == "tensor" and b.shape is not None and len(b.shape) == 2
                 and any(m in b.name.lower() for m in MASK_NAMES) and b.dtype in ("int64", "int32", "bool")
                 and all(isinstance(d, str) for d in b.shape)), None)
    for symbol, where in carriers.items():
        if all(axis == 0 for _, axis, _ in where):
            floors[symbol] = 1  # batch
        elif mask is not None and symbol == mask.shape[1] and all(axis == 1 for _, axis, _ in where):
            floors[symbol] = SEQUENCE_FLOOR  # the sequence the mask covers
        if pad_dims and symbol in pad_dims:
            floors.setdefault(symbol, SEQUENCE_FLOOR)
    # every output carrying a padded symbol must carry it as a croppable axis; unknown dims forbid
    for b in outputs:
        if b.kind != "tensor":
            floors.clear()
            break
        if b.shape is None:
            floors.clear()  # rank unknown: nothing can be cropped back
            break
        for d in b.shape:
            if d is None or (isinstance(d, str) and d not in carriers):
                floors.clear()  # unnamed, or an expression of symbols ("seq + 1"): it could not be cropped
    if not floors:
        return None
    pads = [[(axis, d) for axis, d in enumerate(b.shape or []) if d in floors] for b in inputs]
    crops = [[(axis, d) for axis, d in enumerate(b.shape or []) if d in floors] for b in outputs]
    return Buckets(floors, pads, crops)
