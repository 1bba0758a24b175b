"""A CUDA build's Triton kernels compiled in parallel processes while the tactic search times the first layers.

Triton compiles a kernel when a launch first needs it, on the launching thread, one at a time. The tactic
search launches every candidate of every distinct layer, so a build compiles them all in turn: ResNet-50 FP8 at
opt level 3 has 74 distinct kernels among its candidates (51 implicit-GEMM convolution variants, ~1.2 s of a core
each with ptxas): 84 s of one core (bench/results/fp8-build-2026-12-05.md), most of a build that ran past 125 s.

Before the search, one more run of the reference program hands each layer's inputs to `CandidateKernels.record`,
which prepares and launches the candidates that the search will prepare, with Triton's launches recorded instead
of compiled (kiln/kernels/cuda/triton/precompile.py), and submits the kernels to a pool of worker processes.
The search waits for a layer's kernels before it tunes the layer (`wait`): by then they are in Triton's disk
cache, and the launch loads them. Layers the timing cache answers need their chosen tactic only; identical
layers are recorded once. What runs is unchanged: a kernel the workers did not compile is compiled by its launch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from kiln.tactics.tactic import Launch, Tactic


class CandidateKernels:
    """Layer index -> the compiles its candidates wait for, running in a CompilePool."""

    def __init__(self, workers: int | None):
        self._precompile = importlib.import_module("kiln.kernels.cuda.triton.precompile")
        self.pool = self._precompile.CompilePool(workers)
        self.pending: dict[int, list[Future]] = {}

    @classmethod
    def start(cls, device: torch.device, workers: int | None) -> CandidateKernels | None:
        """A pool for a CUDA build with Triton (None on the CPU, without Triton, or with workers 0)."""
        if device.type != "cuda" or workers == 0 or importlib.util.find_spec("triton") is None:
            return None
        try:
            return cls(workers)
        except (ImportError, AttributeError):  # a Triton without the hooks used here: kernels compile on launch
            return None

    def record(self, i: int, tactics: list[Tactic], prepare: Callable[[Tactic], Launch], ctx: Any,
               inputs: list[Any], attributes: dict) -> None:
        """Launch each tactic's prepared kernel once on layer i's `inputs` (in its layout), compiling nothing, and
        submit the kernels those launches need. A tactic that fails here is left to the search, which says why."""
        with self._precompile.recorded_launches() as kernels:
            for tactic in tactics:
                try:
                    launch = prepare(tactic)
                    with torch.inference_mode():
                        launch(ctx, *[tactic.to_layout(a) for a in inputs], **attributes)
                except Exception:  # noqa: BLE001  the search prepares and checks it again, and notes the failure
                    continue
        self.pending[i] = self.pool.submit(kernels)

    def wait(self, i: int) -> None:
        """Until layer i's kernels are compiled (or failed: their launch compiles them again and raises there)."""
        for future in self.pending.pop(i, []):
            future.exception()

    @property
    def kernels(self) -> int:
        """Distinct kernels submitted so far."""
        return len(self.pool.submitted)

    def close(self) -> None:
        self.pool.close()
