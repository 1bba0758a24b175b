"""run()'s direct paths on the CPU (kiln/runtime/context.py): a fixed-shape engine fed exactly its bindings as numpy
arrays (a program that is one native segment: numpy in, numpy out), and numpy feeds of a signature checked once,
then straight to the program or to one call of its segment's compiled loop (kiln/runtime/direct_run.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.ir import dtypes
from kiln.kernels.cpu.form_choice import PARALLEL
from kiln.runtime.bindings import _numpy_signature, _to_user
from kiln.runtime.direct_run import program_signature

# torch.inference_mode() as its C guard alone: the Python wrapper (a class instance, a scripting check, then the same
# guard) is ~1.5 us of a ~10 us engine call on the empty model, measured interleaved (10.36 -> 8.98 us a call,
# bench/engine_call_inference_guard.py; bench/results/serve-ray-2026-12-06.md), and these paths enter it once per
# call. torch's wrapper where a torch lacks the private guard.
_GUARD = getattr(torch._C, "_InferenceMode", None)
inference_mode = functools.partial(_GUARD, True) if _GUARD is not None else torch.inference_mode


@dataclass(frozen=True)
class CheckedSignature:
    """A numpy input signature checked once (Engine.checked_signatures, by _numpy_signature's key): the profile it
    selects, and the program's signature of those inputs (program.input_signature's, for the direct runs' look-ups:
    found once, not per call; None where an input's dtype has no torch twin)."""

    profile: int
    program_signature: tuple | None

    @classmethod
    def of(cls, key: tuple, profile: int) -> CheckedSignature:
        return cls(profile, program_signature(key))


class CpuPaths:
    """run()'s direct paths on the CPU, a mixin of ExecutionContext: they read what its __init__ set (engine,
    program, _static, _whole_segment, _input_names, _output_names, _checked, _numpy_check, _direct, _first_calls) and
    fall back on its general path's helpers."""

    def _run_checked(self, feeds: dict[str, Any]) -> dict[str, Any] | None:
        """A CPU engine fed numpy arrays (C-contiguous, writable, of numpy's own dtypes): checked once per
        signature (remembered), then straight to the program. Else None: the general path."""
        names = self._input_names
        key = _numpy_signature(names, feeds)
        if key is None:
            return None
        checked = self._checked.get(key)
        if checked is None:  # a new signature: checked here (errors as the general path raises them), then run
            # as a checked one (the general path's conversions give the same tensors for these); from the signature
            # alone where it passes (NumpyCheck), else by _check, which raises what is wrong
            profile = self._numpy_check(key) if self._numpy_check is not None else None
            if profile is None:
                self._check(feeds)
                profile = self.profile
            self.profile = profile
            checked = self._remember_checked(key)
        self.profile = checked.profile
        if self._direct is not None and checked.program_signature is not None:
            results = self._run_direct([feeds[n] for n in names], checked.program_signature)
            if results is not None:
                return {self._output_names[0]: results[0]} if len(results) == 1 \
                    else dict(zip(self._output_names, results))
        args = [torch.from_numpy(feeds[n]) for n in names]
        with inference_mode():
            results = self._run_program(args, self._packed_rows(args, self._host_tokens(feeds)))
        return {b.name: _to_user(v, False) for b, v in zip(self.engine.outputs, results)}

    def _run_direct(self, arrays: list[np.ndarray], signature: tuple) -> list[np.ndarray] | None:
        """Checked numpy inputs of a bound shape (or, padding first calls, of a new one a bound shape hosts) as one
        call of the segment's compiled loop (kiln/runtime/direct_run.py); None: the general path. `signature`: the
        program's signature of `arrays` (CheckedSignature's)."""
        if self._first_calls is not None:
            return self._first_calls.run_direct(arrays, signature, self._direct)
        record = self._direct.find(signature)
        if record is None:  # a new shape: bound without a run of the program, then run as its repeats are
            record = self._direct.bind(signature, arrays)
        return record.run(arrays) if record is not None else None

    def _run_static(self, feeds: dict[str, Any]) -> dict[str, Any] | None:
        """The common case in a few lines: a CPU engine of fixed input shapes fed exactly those, as
        C-contiguous writable numpy arrays of the bound dtypes. After a large network each line of
        Python runs from cold caches (~0.2 ms for ResNet-50's general path); anything else returns
        None and takes the general path, which checks and explains."""
        names, signature, outputs = self._static
        if len(feeds) != len(names):
            return None
        arrays = []
        for name, (dtype, shape) in zip(names, signature):
            value = feeds.get(name)
            if type(value) is not np.ndarray or (value.dtype is not dtype and value.dtype != dtype) \
                    or value.shape != shape:
                return None
            flags = value.flags  # (an object made per access)
            if not (flags.c_contiguous and flags.writeable):
                return None
            arrays.append(value)
        whole = self._whole_segment
        if whole is not None:  # the program is one native segment: numpy in, numpy out, no torch call
            results = whole.run(arrays)
            if len(results) == 1:  # (a tiny model's call: dict(zip(...)) was ~0.2 µs of ~5)
                return {self._output_names[0]: results[0]}
            return dict(zip(self._output_names, results))
        args = [torch.from_numpy(a) for a in arrays]
        with inference_mode():
            results = self.program.run(args)
        return {b.name: _to_user(v, False) for b, v in zip(outputs, results)}  # real dtypes: one .numpy() each


def _static_signature(engine: Any) -> tuple | None:
    """(input names, [(numpy dtype, shape)], output bindings) of a CPU engine whose inputs are all
    tensors of fixed shapes and numpy-native dtypes, run without boundary casts; else None."""
    if engine.device.type != "cpu" or engine.internal_dtype:
        return None
    signature = []
    for b in engine.inputs:
        dt = dtypes.BY_NAME.get(b.dtype) if b.dtype else None
        if (b.kind != "tensor" or b.shape is None or not all(isinstance(d, int) for d in b.shape) or dt is None
                or dt.torch not in dtypes.NUMPY_REAL):
            return None
        signature.append((np.dtype(dt.numpy), tuple(b.shape)))
    return [b.name for b in engine.inputs], signature, list(engine.outputs)


def _tiny_calls(engine: Any, whole: Any, direct: Any) -> bool:
    """Whether every call of a context runs one tiny native segment (Segment.tiny): a fixed-shape program that is
    one segment (`whole`, its StaticRun), or a one-segment program over symbolic dims (`direct`, its DirectRuns) of
    kiln's own kernels alone whose work stays tiny at the profiles' largest inputs (its work scaled by their
    elements over its planned entries'). Such a context skips the OpenMP governor's begin / end per call."""
    if whole is not None:
        return whole.segment.tiny()
    if direct is None or not engine.profiles:
        return False
    segment = direct.segment
    planned = sum(math.prod(size) for size in segment.entry_sizes)
    largest = max(sum(math.prod(r.max) for r in profile.inputs.values()) for profile in engine.profiles)
    return planned > 0 and segment.only_form == PARALLEL and segment.tiny(max(1.0, largest / planned))
