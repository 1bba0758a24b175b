"""torch.nn.Module -> ONNX the way users do it: torch.onnx.export(..., dynamo=True), fp32, eval mode."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

import numpy as np
import torch


@contextlib.contextmanager
def offline():
    """Never reach a model hub: the zoo builds from configs, random seeds and bundled weights."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_loggers(quiet: bool, names=("torch.onnx", "torch.export", "onnxscript")):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    if quiet:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_module(module: torch.nn.Module, inputs: dict[str, np.ndarray], folder: Path,
                  *, verbose: bool = False, dynamic_axes: dict[int, str] | None = None) -> dict[str, np.ndarray]:
    """Export `module(**inputs)` to folder/model.onnx; the graph inputs take the keyword names.
    `dynamic_axes` ({axis: name}, the same for every input): symbolic dims (torch.export.Dim)."""
    module = module.eval()
    kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    dynamic_shapes = None
    if dynamic_axes:
        dims = {axis: torch.export.Dim(name, min=1) for axis, name in dynamic_axes.items()}
        dynamic_shapes = {k: {a: d for a, d in dims.items() if a < v.dim()} for k, v in kwargs.items()}
    # The exporter narrates every step and warns about things users cannot act on; keep it for -v.
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with torch.no_grad(), warnings.catch_warnings(), quiet, _quiet_loggers(not verbose):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, (), kwargs=kwargs, dynamo=True, external_data=False,
                                    verbose=verbose, dynamic_shapes=dynamic_shapes)
    program.save(str(folder / "model.onnx"), external_data=False)
    return inputs
