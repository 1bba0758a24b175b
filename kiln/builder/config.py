"""BuildConfig: every builder option, with the defaults a user gets from `kiln.build`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BuildConfig:
    opt_level: int = 2  # 0: as is; 1: folding/cleanups; 2: + BN folding, fusions; 3-5: wider tactic search (kiln/passes/pipeline.py)
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | tf32 | fp16 | bf16 | int8 | fp8 | best
    shapes: dict[str, list[int]] = field(default_factory=dict)  # the shapes tactics are tuned at (a profile's opt)
    # optimization profiles: [{input: (min, opt, max) | "1x1,8x128,32x512"}]; [] = kiln's default for
    # symbolic dims (kiln/builder/profiles.py)
    profiles: list[dict[str, Any]] = field(default_factory=list)
    # symbolic dims where zero padding is exact, besides batch and a masked sequence (runtime/buckets.py)
    pad_dims: list[str] = field(default_factory=list)
    layer_precision: dict[str, str] = field(default_factory=dict)  # layer name -> "fp32" (pinned)
    cuda_graphs: bool = True  # capture the whole engine per input shape on CUDA
    timing_cache: str | None = None  # JSON file of tactic timings, reused by later builds (kiln/tactics)
    tactics: list[str] = field(default_factory=list)  # tactic names (or prefixes: "cpu.conv") allowed; []: all
    tuning_runs: int = 10  # timed rounds per layer in the tactic search (median)
    verbose: bool = False
    verify: bool = False  # run the IR verifier between passes (tests set KILN_VERIFY=1)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs) -> BuildConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown build option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
