"""Triton's system shared-memory extension: tensors read from and written into regions a client registered.

A client creates a POSIX shared-memory object (`tritonclient.utils.shared_memory`: shm_open, so a
file under /dev/shm on Linux), registers a window of it by name ({"key", "offset", "byte_size"}), and
then names that region in an input's or a requested output's parameters instead of sending bytes:

    shared_memory_region: "input0"    shared_memory_offset: 0 (optional)    shared_memory_byte_size: 32

An input is read as a read-only view of the mapping (no copy here: the batcher copies what an engine
call needs, the IPC writes it to the engine process); an output is written into its region and the
response carries its name, datatype and shape without data. Every mistake is an InvalidRequest
naming the region and the tensor: an unknown region, a window outside the region, a byte size that
does not fit the tensor, a key that is not a shared-memory object.

Like Triton's, the extension trusts its clients with the server's shared-memory objects: a client that
can reach the port can register any object under /dev/shm the server's user may open (the key is one
name there, never a path), so serve it to local, trusted clients.

The registry holds a mapping per region, opened on first use. A front-end process of `--frontends N`
learns the regions from the engine's View and hands a request's tensors in shared memory on to the engine
as regions (ForwardingRegistry, SharedTensor): the engine reads and writes them itself. Each use
checks the object's current size first: a client that shrinks its object after registering would
otherwise crash the server with SIGBUS on the next read.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

from kiln.serve import datatypes
from kiln.serve.errors import InvalidRequest

SHM_FOLDER = "/dev/shm"  # where Linux's shm_open keeps its objects
PARAMETERS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


CUDA_NOT_SUPPORTED = ("CUDA shared memory is not supported by kiln serve; use system shared memory "
                      "(/v2/systemsharedmemory) or send the tensors in the request")


@dataclass(frozen=True)
class Region:
    """A registered window of a shared-memory object: what the status calls list."""

    name: str
    key: str
    offset: int
    byte_size: int

    def to_json(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass(frozen=True)
class TensorPlace:
    """Where a request puts one tensor: a window of a registered region (offset relative to the region)."""

    region: str
    offset: int
    byte_size: int


def _path(key: str) -> str:
    """The file of shm_open(key): one name under /dev/shm (a leading '/' as shm_open takes it), nothing else."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidRequest(f"shared memory key {key!r} is not a shared-memory object name ('/name', as "
                             "shm_open takes it)")
    return os.path.join(SHM_FOLDER, name)


def _size(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{what} must be a non-negative integer, given {value!r}")
    return value


class _Mapping:
    """One region's object mapped from its start to the region's end (offsets need no page alignment)."""

    def __init__(self, region: Region):
        path = _path(region.key)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise InvalidRequest(f"shared memory region {region.name!r}: cannot open key {region.key!r}: "
                                 f"{e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            end = region.offset + region.byte_size
            if end > size:
                raise InvalidRequest(f"shared memory region {region.name!r}: offset {region.offset} + byte_size "
                                     f"{region.byte_size} runs past the {size} bytes of key {region.key!r}")
            self.memory = mmap.mmap(fd, end) if end else None  # the mapping keeps its own descriptor
        finally:
            os.close(fd)
        self.region = region

    def window(self, place: TensorPlace, tensor: str) -> memoryview:
        """The tensor's bytes inside the region, checked against the region and the object's size now."""
        region = self.region
        _check_inside(region, place, tensor)
        start = region.offset + place.offset
        if self.memory is None:
            return memoryview(b"")
        if self.memory.size() < start + place.byte_size:  # the client shrank its object since it registered
            raise InvalidRequest(f"shared memory region {region.name!r}: its key {region.key!r} is now smaller "
                                 "than the registered region; register it again")
        return memoryview(self.memory)[start:start + place.byte_size]


def _check_inside(region: Region, place: TensorPlace, tensor: str) -> None:
    if place.offset + place.byte_size > region.byte_size:
        raise InvalidRequest(f"tensor {tensor!r}: shared_memory_offset {place.offset} + shared_memory_byte_size "
                             f"{place.byte_size} runs past the {region.byte_size} bytes of region {region.name!r}")


def _check_input_size(place: TensorPlace, datatype: datatypes.Datatype, shape: list[int], tensor: str) -> None:
    count = datatypes.element_count(shape, tensor)
    if datatype.v2 != "BYTES" and place.byte_size != count * datatype.numpy.itemsize:
        raise InvalidRequest(f"input {tensor!r}: shared_memory_byte_size {place.byte_size}, but shape {shape} of "
                             f"{datatype.v2} is {count * datatype.numpy.itemsize} bytes")


@dataclass(frozen=True)
class SharedTensor:
    """A tensor left in its region, between a front end of `--frontends N` and the engine: an input the front end
    hands on instead of its bytes (the engine maps the region itself and reads it there), an output the engine
    wrote there (place.byte_size: the bytes written). Either way its bytes never cross the engine's socket."""

    place: TensorPlace
    datatype: str  # the protocol's name: "FP32"
    shape: tuple[int, ...]


class SharedMemoryRegistry:
    """The system shared-memory regions of one process, by name."""

    def __init__(self):
        self.regions: dict[str, Region] = {}
        self._mapped: dict[str, _Mapping] = {}

    def register(self, name: object, key: object, offset: object, byte_size: object) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a shared memory region needs a name")
        if not isinstance(key, str):
            raise InvalidRequest(f"shared memory region {name!r}: 'key' must be a string, given {key!r}")
        region = Region(name, key, _size(offset, f"region {name!r} 'offset'"),
                        _size(byte_size, f"region {name!r} 'byte_size'"))
        if name in self.regions:
            raise InvalidRequest(f"shared memory region {name!r} is already registered; unregister it first")
        mapping = _Mapping(region)  # the key and window checked now: a bad registration fails here, not at infer
        self.regions[name] = region
        self._mapped[name] = mapping

    def unregister(self, name: str = "") -> None:
        """One region ('' : all). An unknown name is no error (Triton's answer too). A mapping still read by a
        request in flight stays valid until that request lets go of it."""
        if not name:
            self.regions.clear()
            self._mapped.clear()
            return
        self.regions.pop(name, None)
        self._mapped.pop(name, None)

    def status(self, name: str = "") -> list[Region]:
        if not name:
            return list(self.regions.values())
        if name not in self.regions:
            raise InvalidRequest(f"no system shared memory region {name!r} is registered")
        return [self.regions[name]]

    def apply(self, regions: list[Region]) -> None:
        """Take another process's registry (a front end's, from the engine's View): mappings of unchanged
        regions are kept, the others opened again on their next use."""
        fresh = {r.name: r for r in regions}
        self._mapped = {n: m for n, m in self._mapped.items() if fresh.get(n) == m.region}
        self.regions = fresh

    def _region(self, place: TensorPlace, tensor: str) -> Region:
        region = self.regions.get(place.region)
        if region is None:
            raise InvalidRequest(f"tensor {tensor!r}: no system shared memory region {place.region!r} is registered")
        return region

    def _mapping(self, place: TensorPlace, tensor: str) -> _Mapping:
        mapping = self._mapped.get(place.region)
        if mapping is None:
            mapping = self._mapped[place.region] = _Mapping(self._region(place, tensor))
        return mapping

    # ---- tensors ------------------------------------------------------------------------------

    def check(self, place: TensorPlace, tensor: str) -> None:
        """That `place` lies inside a registered region (an output's, checked before the model runs)."""
        self._mapping(place, tensor).window(place, tensor)

    def read(self, place: TensorPlace, datatype: datatypes.Datatype, shape: list[int], tensor: str) -> np.ndarray:
        """An input from its region: a read-only view (engines may write their inputs; the batcher copies)."""
        _check_input_size(place, datatype, shape, tensor)
        window = self._mapping(place, tensor).window(place, tensor).toreadonly()
        return datatypes.from_bytes(window, datatype, shape, tensor)

    def write(self, place: TensorPlace, array: np.ndarray, tensor: str) -> int:
        """An output into its region; the bytes written."""
        if array.dtype == object:
            data = datatypes.to_bytes(array)
            size = len(data)
        else:
            data, size = array, array.nbytes
        if size > place.byte_size:
            raise InvalidRequest(f"output {tensor!r}: shared_memory_byte_size {place.byte_size} is too small for "
                                 f"its {size} bytes (shape {list(array.shape)}, {datatypes.of_array(array).v2})")
        window = self._mapping(place, tensor).window(place, tensor)
        if isinstance(data, bytes):
            window[:size] = data
        elif size:
            np.frombuffer(window, array.dtype, array.size).reshape(array.shape)[...] = array
        return size


    def write_outputs(self, outputs: dict[str, np.ndarray], places: dict[str, TensorPlace]) -> dict:
        """The outputs that have a place written into it; returned with each of those replaced by a SharedTensor
        saying where and how many bytes (what a front end answers without the bytes crossing its socket)."""
        done = dict(outputs)
        for name, place in places.items():
            array = outputs.get(name)
            if array is not None:
                written = self.write(place, array, name)
                done[name] = SharedTensor(TensorPlace(place.region, place.offset, written),
                                          datatypes.of_array(array).v2, tuple(array.shape))
        return done

    def read_shared(self, inputs: dict) -> None:
        """Replace each SharedTensor among a request's inputs (a front end's) by its array, read here."""
        for name, value in inputs.items():
            if type(value) is SharedTensor:
                inputs[name] = self.read(value.place, datatypes.BY_V2[value.datatype], list(value.shape), name)


class ForwardingRegistry(SharedMemoryRegistry):
    """A front end's registry (`--frontends N`): an input is checked against its registered region and handed on
    as a SharedTensor for the engine to read; an output's place goes to the engine, which writes it (one asked
    for with classification is written here, after the front end classifies it)."""

    def read(self, place: TensorPlace, datatype: datatypes.Datatype, shape: list[int], tensor: str) -> SharedTensor:
        _check_input_size(place, datatype, shape, tensor)
        self.check(place, tensor)
        return SharedTensor(place, datatype.v2, tuple(shape))

    def check(self, place: TensorPlace, tensor: str) -> None:
        _check_inside(self._region(place, tensor), place, tensor)  # no mapping: the engine writes the outputs


def tensor_place(parameters: dict, tensor: str) -> TensorPlace | None:
    """A tensor's shared-memory parameters (plain values: HTTP's JSON, gRPC's unpacked), or None without them."""
    region = parameters.get("shared_memory_region")
    if region is None:  # every request's path: two lookups
        if "shared_memory_byte_size" in parameters or "shared_memory_offset" in parameters:
            raise InvalidRequest(f"tensor {tensor!r}: {[k for k in PARAMETERS if k in parameters]} given without "
                                 "shared_memory_region")
        return None
    if not isinstance(region, str) or not region:
        raise InvalidRequest(f"tensor {tensor!r}: shared_memory_region must be a region's name, given {region!r}")
    if "shared_memory_byte_size" not in parameters:
        raise InvalidRequest(f"tensor {tensor!r}: shared_memory_region {region!r} needs shared_memory_byte_size")
    return TensorPlace(region, _size(parameters.get("shared_memory_offset", 0), f"tensor {tensor!r} shared_memory_offset"),
                       _size(parameters["shared_memory_byte_size"], f"tensor {tensor!r} shared_memory_byte_size"))


def output_parameters(place: TensorPlace, written: int) -> dict:
    """An output written into shared memory, as its response's parameters say it."""
    parameters = {"shared_memory_region": place.region, "shared_memory_byte_size": written}
    if place.offset:
        parameters["shared_memory_offset"] = place.offset
    return parameters
