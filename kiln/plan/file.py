"""The `.kiln` engine file: one file, versioned header, checksum, safetensors weights.

Layout (little-endian):

    magic          8 bytes  b"KILNENG\\0"
    format version u32
    reserved       u32
    header length  u64      then the header, UTF-8 JSON (the plan's header + program, and a padding-free
                            engine's plain program: both read the one weights section)
    padding        to a 64-byte boundary
    weights        safetensors blob (its own u64 length + JSON + data), mmapped on load
    digest         32 bytes BLAKE2b of everything above

Writing goes to a temporary file in the same folder and is renamed into place, so a failed
save never leaves a half-written engine behind. Reading checks size, magic, version and
digest before anything is built from the file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import EngineFormatError
from kiln.ir import dtypes
from kiln.plan.spec import FORMAT_VERSION, EnginePlan, ProgramSpec

MAGIC = b"KILNENG\0"
_PREFIX = struct.Struct("<8sIIQ")
_DIGEST_SIZE = 32
_ALIGN = 64

_ST_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _d in dtypes.BY_NAME.values():
    if _d.safetensors and _d.torch is not None:
        _ST_TO_TORCH.setdefault(_d.safetensors, _d.torch)
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}


def _pack_weights(weights: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Weights -> (the safetensors blob as the parts to write one after another, header notes for values safetensors
    cannot type). Each weight's part is a view of its own bytes (a copy only where it is not contiguous): joined, the
    blob was three more copies of the weights at once (every tensor's bytes, their join, the join after the header:
    256 MiB of weights saved at +770 MiB peak RSS, now +2), and a build's weights mapped from its spill file
    (kiln/builder/spill.py) are read from there as they are written."""
    notes: dict[str, Any] = {}
    entries: list[tuple[str, str, list[int], np.ndarray]] = []  # name, safetensors dtype, shape, its bytes (uint8)
    for name, value in weights.items():
        if isinstance(value, np.ndarray) and value.dtype == object:
            notes[name] = {"strings": [str(s) for s in value.ravel().tolist()], "shape": list(value.shape)}
            continue
        if isinstance(value, np.ndarray):
            notes[name] = {"dtype": dtypes.from_numpy(value.dtype).name, "shape": list(value.shape)}
            entries.append((name, "U8", [value.nbytes], np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
            continue
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8)
        st = _TORCH_TO_ST.get(t.dtype)
        if st is None:  # complex, fnuz float8, unsigned wider than 8 bits: store the bytes
            notes[name] = {"dtype": dtypes.from_torch(t.dtype).name, "shape": list(t.shape)}
            entries.append((name, "U8", [raw.size], raw))
            continue
        entries.append((name, st, list(t.shape), raw))
    meta: dict[str, Any] = {}
    offset = 0
    for name, st, shape, data in entries:
        meta[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [struct.pack("<Q", len(head)) + head, *(e[3] for e in entries)], notes


@dataclass
class MappedWeights:
    """The weights section of a loaded engine file, mapped copy-on-write (nothing writes to it).

    The tensors of `EnginePlan.weights` are views of these pages; the checksum read every page, so
    all are resident. Once the runtime has packed what its kernels read from packed copies,
    `release()` lets the kernel drop the pages: a weight still read as it is faults its pages back
    in from the page cache, one that only fed a packed copy stays out. The resident memory of a
    loaded engine is then its packed weights plus the weights read as they are, not both of every
    weight. (The mapping holds the file's inode: an engine file replaced by a save, which writes a
    new file and renames it, does not change a loaded engine.)"""

    mm: mmap.mmap
    start: int
    end: int

    def release(self, start: int | None = None, end: int | None = None) -> None:
        """Let the pages of [start, end) go (offsets in the mapping; default: the weights section), those wholly inside
        it only: a page shared with a neighbour stays (the section's last page goes with the section's end)."""
        page = mmap.PAGESIZE
        start = self.start if start is None else max(start, self.start)
        end = self.end if end is None else min(end, self.end)
        low = -(-start // page) * page
        high = end if end == self.end else end // page * page
        if high > low and hasattr(self.mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self.mm.madvise(mmap.MADV_DONTNEED, low, high - low)

    def release_part(self, part: Any) -> None:
        """Let go the whole pages of `part` (an array) where it lies in this mapping: a save, once it is written."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        offset = getattr(getattr(part, "ctypes", None), "data", -1) - base
        if self.start <= offset < self.end:
            self.release(offset, offset + part.nbytes)


def _unpack_weights(buf: memoryview | mmap.mmap, start: int, end: int, notes: dict) -> dict[str, Any]:
    (n,) = struct.unpack_from("<Q", buf, start)
    meta = json.loads(bytes(buf[start + 8 : start + 8 + n]))
    data_start = start + 8 + n
    weights: dict[str, Any] = {}
    for name, m in meta.items():
        if name == "__metadata__":
            continue
        lo, hi = m["data_offsets"]
        if data_start + hi > end:
            raise EngineFormatError(f"weight {name!r} lies past the end of the weights section")
        torch_dtype = _ST_TO_TORCH[m["dtype"]]
        count = (hi - lo) // torch.empty(0, dtype=torch_dtype).element_size()
        t = (
            torch.frombuffer(buf, dtype=torch_dtype, count=count, offset=data_start + lo)
            if count
            else torch.empty(0, dtype=torch_dtype)
        )
        note = notes.get(name)
        if note is None:
            weights[name] = t.reshape(m["shape"])
            continue
        dt = dtypes.BY_NAME[note["dtype"]]
        if dt.torch is not None:
            weights[name] = t.view(dt.torch).reshape(note["shape"])
        else:
            weights[name] = t.numpy().view(dt.numpy).reshape(note["shape"])
    for name, note in notes.items():
        if "strings" in note:
            weights[name] = np.array(note["strings"], dtype=object).reshape(note["shape"])
    return weights


def save(plan: EnginePlan, path: str | os.PathLike) -> None:
    path = Path(path)
    weight_parts, notes = _pack_weights(plan.weights)  # written one by one, never joined
    doc = {"header": plan.header, "program": plan.program.to_json(), "weight_notes": notes}
    if plan.plain is not None:
        doc["plain_program"] = plan.plain.to_json()
    header = json.dumps(doc, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header))
    pad = b"\0" * (-(len(prefix) + len(header)) % _ALIGN)
    digest = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (prefix, header, pad, *weight_parts):
                digest.update(part)
                f.write(part)
                if plan.mapped is not None:  # a mapped weight's pages, read to be written, go again
                    plan.mapped.release_part(part)
            f.write(digest.digest())
        os.replace(tmp, path)
        if plan.mapped is not None:  # the weights' pages the write read back go again (MappedWeights)
            plan.mapped.release()
    except BaseException:
        os.unlink(tmp)
        raise


def load(path: str | os.PathLike) -> EnginePlan:
    path = Path(path)
    if not path.is_file():
        raise EngineFormatError(f"{path}: no such engine file")
    size = path.stat().st_size
    if size < _PREFIX.size + _DIGEST_SIZE:
        raise EngineFormatError(f"{path}: {size} bytes is too short for a kiln engine (truncated?)")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    magic, version, _, header_len = _PREFIX.unpack_from(mm, 0)
    if magic != MAGIC:
        raise EngineFormatError(f"{path}: not a kiln engine file (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise EngineFormatError(
            f"{path}: engine format version {version}, but this kiln reads version {FORMAT_VERSION}; "
            "rebuild the engine with this kiln"
        )
    body_end = size - _DIGEST_SIZE
    if _PREFIX.size + header_len > body_end:
        raise EngineFormatError(f"{path}: header runs past the end of the file (truncated?)")
    digest = hashlib.blake2b(memoryview(mm)[:body_end], digest_size=_DIGEST_SIZE).digest()
    if digest != mm[body_end:size]:
        raise EngineFormatError(f"{path}: checksum mismatch, the file is corrupted or truncated")
    try:
        doc = json.loads(bytes(mm[_PREFIX.size : _PREFIX.size + header_len]))
    except ValueError as e:
        raise EngineFormatError(f"{path}: unreadable header: {e}") from None
    blob_start = _PREFIX.size + header_len
    blob_start += -blob_start % _ALIGN
    try:  # a checksum only proves the file is whole; another writer's layout fails here, named
        weights = _unpack_weights(mm, blob_start, body_end, doc.get("weight_notes", {}))
        mapped = MappedWeights(mm, blob_start, body_end)
        mapped.release()  # the checksum read every page; each comes back when (and if) a layer reads it
        plain = ProgramSpec.from_json(doc["plain_program"]) if "plain_program" in doc else None
        return EnginePlan(header=doc["header"], program=ProgramSpec.from_json(doc["program"]), weights=weights,
                          plain=plain, mapped=mapped)
    except (KeyError, TypeError, ValueError, AttributeError, struct.error) as e:
        raise EngineFormatError(
            f"{path}: the engine's header or weights table is not laid out as this kiln writes them "
            f"({type(e).__name__}: {e}); rebuild the engine with this kiln"
        ) from None
