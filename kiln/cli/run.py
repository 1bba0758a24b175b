"""`kiln run`: run an engine once on given or random inputs, print its outputs, and save them."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import kiln
from kiln.cli.common import console, fmt_shape, make_inputs, text
from kiln.ir import dtypes


def cmd_run(args: argparse.Namespace) -> int:
    from rich.table import Table

    engine = kiln.load(args.engine)
    feeds = make_inputs(engine.plan, args)
    t0 = time.perf_counter()
    outputs = engine.run(feeds)
    seconds = time.perf_counter() - t0
    out = console()
    table = Table(title=f"{Path(args.engine).name}: {len(outputs)} output(s) in {1000 * seconds:.2f} ms",
                  title_justify="left")
    for column in ("output", "dtype", "shape", "values"):
        table.add_column(column)
    for name, value in outputs.items():
        table.add_row(text(name), *map(text, _describe_value(value)))
    out.print(table)
    if args.outputs:
        _save_npz(Path(args.outputs), outputs)
        out.print(text(f"outputs written to {args.outputs}"))
    if args.save_inputs:
        _save_npz(Path(args.save_inputs), feeds)
        out.print(text(f"inputs written to {args.save_inputs}"))
    return 0


def _savable(value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:
        return array.astype(str)
    if array.dtype.type.__module__ != "numpy":  # ml_dtypes (bfloat16, float8, int4): npz cannot hold them
        return array.astype(np.float32 if dtypes.from_numpy(array.dtype).is_float else np.int8)
    return array


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    """Write to a temporary file next to `path`, then rename: never a half-written file."""
    flat: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if value is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                flat[f"{name}[{i}]"] = _savable(item)
        else:
            flat[name] = _savable(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **flat)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _describe_value(value: Any) -> tuple[str, str, str]:
    """(dtype, shape, first values) for the outputs table."""
    if value is None:
        return "none", "-", "(empty optional)"
    if isinstance(value, list):
        return "sequence", f"{len(value)} item(s)", ", ".join(_describe_value(v)[1] for v in value[:4])
    array = np.asarray(value)
    flat = array.reshape(-1)[:6]
    if array.dtype.kind == "f" or array.dtype.type.__module__ != "numpy":
        shown = ", ".join(f"{float(v):.6g}" for v in flat)
    else:
        shown = ", ".join(str(v) for v in flat.tolist())
    if array.size > 6:
        shown += ", ..."
    name = dtypes.from_numpy(array.dtype).name if array.dtype.kind not in "US" else "string"
    return name, fmt_shape(list(array.shape)), shown
