"""A CPU build's large weights in a file of their own, mapped back: their pages go once the layers reading them
have packed them.

A layer whose tactic packs its weights (a oneDNN convolution's blocked layout, kiln's packed GEMM panels) reads its
raw weights when it is prepared, and the engine keeps them only to save them (and for the few layers that read them
as they are). Held in the process's own memory, they were a whole copy of the network beside its packed one from
the search to the end of the build (ResNet-50: 97 MiB of 4.6-5.2x). Written once to an unlinked temporary file and
mapped back copy-on-write, as a loaded engine file is (kiln/plan/file.py MappedWeights), a page comes back from the
page cache when it is read and goes again at the next release: resident is what is being packed or read now. The
file is on the temporary directory's file system (a disk: the page cache's pages are clean and the kernel's to
reclaim; on a tmpfs they would only move out of this process's count).
"""

from __future__ import annotations

import mmap
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from kiln.plan.file import MappedWeights
from kiln.runtime.engine import OWN_COPY_BYTES

ALIGN = 64  # each weight's offset in the file: what the kernels' loads align to


def spill(weights: dict[str, Any], say: Callable[[str], None] = lambda _msg: None) -> MappedWeights | None:
    """Every CPU tensor of `weights` of OWN_COPY_BYTES or more replaced (in place) by a view of its bytes in a mapped,
    unlinked temporary file, its pages released; the mapping (`release()` lets the pages read since go again), or
    None where no weight is that large or the file cannot be written (the weights then stay as they are, and `say`
    tells why: on a full disk a ResNet-50 build peaked 97 MiB higher with nothing said). Smaller weights stay as they
    are: a loaded engine copies them into its own memory too (kiln/runtime/engine.py OWN_COPY_BYTES), and a view would
    fault in the neighbours' pages."""
    large = {name: value for name, value in weights.items() if isinstance(value, torch.Tensor)
             and value.device.type == "cpu" and value.numel() * value.element_size() >= OWN_COPY_BYTES}
    if not large:
        return None
    offsets, size = {}, 0
    try:
        with tempfile.TemporaryFile(prefix="kiln-weights-") as f:
            for name, value in large.items():
                f.write(b"\0" * (-size % ALIGN))
                size += -size % ALIGN
                offsets[name] = size
                f.write(value.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
                size += value.numel() * value.element_size()
            f.flush()
            mapped = MappedWeights(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), 0, size)
    except OSError as e:  # no room in the temporary directory (or none writable): the weights stay where they are
        total = sum(value.numel() * value.element_size() for value in large.values())
        say(f"weights: WARNING the temporary directory {tempfile.gettempdir()} cannot take the {total / 2**20:.0f} MiB "
            f"of large weights ({e}): they stay in memory, and the build peaks that much higher (set TMPDIR to a "
            "directory with room)")
        return None
    for name, value in large.items():  # each view holds the mapping
        weights[name] = torch.frombuffer(mapped.mm, dtype=value.dtype, count=value.numel(),
                                         offset=offsets[name]).view(value.shape)
    mapped.release()
    return mapped
