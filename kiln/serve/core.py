"""The server's core, shared by its HTTP and gRPC frontends: models, their states, inference.

A frontend decodes its wire format into an InferRequest (numpy arrays by input name), awaits
`ServerCore.infer`, and encodes the InferResponse; health, metadata, config, statistics and the
repository calls are plain methods. Everything here runs on the server's event loop; engines run
on their instances' threads (kiln/serve/batcher.py), loading on a worker thread.

Model states follow Triton's repository index: READY, LOADING, UNLOADING, UNAVAILABLE (with a
reason: the load error, or "unloaded").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kiln import BindingError, Engine
from kiln.serve import datatypes
from kiln.serve.batcher import Batcher, Pending, Signature
from kiln.serve.config import BATCH_BUCKETS_DEFAULT, CUDA_SYNC_DEFAULT, WARM_UP_DEFAULT, ModelConfig, parse_json
from kiln.serve.errors import (
    InvalidRequest,
    ModelLoadError,
    NotFound,
    QueueFull,
    RequestTimeout,
    ServeError,
    Unavailable,
)
from kiln.serve.repository import LoadedVersion, ModelRepository
from kiln.serve.shared_memory import SharedMemoryRegistry, TensorPlace
from kiln.serve.stats import ModelStats
from kiln.version import __version__

SERVER_NAME = "kiln"
EXTENSIONS = ["classification", "model_repository", "model_repository(unload_dependents)", "schedule_policy",
              "model_configuration", "statistics", "binary_tensor_data", "parameters", "system_shared_memory"]
DEFAULT_MAX_QUEUE_SIZE = 1024


@dataclass
class InferRequest:
    model: str
    version: str = ""  # "": the latest ready version
    id: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # in the client's order
    outputs: list[str] | None = None  # requested outputs; None: all, in the model's order
    timeout_us: int | None = None
    # outputs for the engine process to write into shared memory (a front end's request; in one process the
    # frontend writes them as it encodes the response)
    output_places: dict[str, TensorPlace] | None = None


@dataclass
class InferResponse:
    model: str
    version: str
    id: str
    outputs: list[tuple[str, np.ndarray]]


@dataclass
class ModelVersion:
    """One served version: its engine, config, batcher and statistics."""

    name: str
    version: str
    engine: Engine
    config: ModelConfig
    batcher: Batcher
    stats: ModelStats

    def __post_init__(self):
        # what validate() checks of every request, looked up once: (name, numpy dtype, dims past the batch axis)
        self.input_specs = [(t.name, t.datatype.numpy, tuple(t.dims)) for t in self.config.inputs]
        self.output_names = [t.name for t in self.config.outputs]
        self.output_set = frozenset(self.output_names)
        batching = self.config.dynamic_batching
        self.default_timeout_us = batching.default_timeout_microseconds if batching else 0
        self.valid_shapes: dict[tuple, tuple[int, Signature]] = {}  # _validate_quickly's answers by input shapes

    def metadata(self, versions: list[str]) -> dict:
        mbs = self.config.max_batch_size

        def tensors(ts):
            return [{"name": t.name, "datatype": t.datatype.v2, "shape": t.shape(mbs)} for t in ts]

        return {"name": self.name, "versions": versions, "platform": "kiln",
                "inputs": tensors(self.config.inputs), "outputs": tensors(self.config.outputs)}


@dataclass
class ModelEntry:
    name: str
    state: str = "UNAVAILABLE"
    reason: str = ""
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load/unload at a time


class ServerCore:
    def __init__(self, repository: ModelRepository, max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
                 warm_up: str = WARM_UP_DEFAULT, cuda_sync: str = CUDA_SYNC_DEFAULT,
                 batch_buckets: str = BATCH_BUCKETS_DEFAULT):
        self.repository = repository
        self.max_queue_size = max_queue_size
        self.warm_up = warm_up  # CPU instances' warm-up where a model's config sets none (config.parse_warm_up)
        self.cuda_sync = cuda_sync  # CUDA instances' wait where a model's config sets none (config.parse_cuda_sync)
        self.batch_buckets = batch_buckets  # bucketed instances' batch buckets likewise (config.parse_batch_buckets)
        self.models: dict[str, ModelEntry] = {}
        self.accepting = True  # False from the start of a shutdown on
        self.started = False
        self.shared_memory = SharedMemoryRegistry()  # the frontends read inputs from and write outputs into it

    # ---- health and metadata ------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        """Ready once the startup loads are done and until shutdown begins (each model has its own
        readiness: a model that failed to load is UNAVAILABLE in the index, the others serve)."""
        return self.started and self.accepting

    def metadata(self) -> dict:
        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    def model(self, name: str, version: str = "") -> ModelVersion:
        entry = self.models.get(name)
        if entry is None:
            if name in self.repository.names():
                raise NotFound(f"model {name!r} is not loaded; load it: POST /v2/repository/models/{name}/load")
            raise NotFound(f"unknown model {name!r}; the repository holds {self.repository.names()}")
        if not entry.versions:
            state = f"{entry.state}{': ' + entry.reason if entry.reason else ''}"
            if entry.state in ("LOADING", "UNLOADING"):
                raise Unavailable(f"model {name!r} is {state}")
            raise NotFound(f"model {name!r} is not loaded ({state}); load it: POST /v2/repository/models/{name}/load")
        if not version:  # the newest (most requests name none: one version, found without max's int per key)
            versions = entry.versions
            return next(iter(versions.values())) if len(versions) == 1 else versions[max(versions, key=int)]
        found = entry.versions.get(version)
        if found is None:
            if not version.isdigit():
                raise InvalidRequest(f"model {name!r}: version {version!r} is not a positive integer")
            raise NotFound(f"model {name!r} has no version {version!r}; versions served: "
                           f"{sorted(entry.versions, key=int)}")
        return found

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.model(name, version)
        except ServeError:
            return False
        return self.accepting

    def model_metadata(self, name: str, version: str = "") -> dict:
        m = self.model(name, version)
        return m.metadata(sorted(self.models[name].versions, key=int))

    def statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if name:
            if version:
                return [self.model(name, version).stats]
            self.model(name)  # NotFound / Unavailable
            return [v.stats for _, v in sorted(self.models[name].versions.items(), key=lambda kv: int(kv[0]))]
        return [v.stats for entry in self.models.values() for v in entry.versions.values()]

    async def statistics_json(self, name: str = "", version: str = "") -> list[dict]:
        """statistics() as the routes answer it (a front-end process's core asks the engine's)."""
        return [s.to_json() for s in self.statistics(name, version)]

    def ready_versions(self) -> list[ModelVersion]:
        return [v for entry in self.models.values() for v in entry.versions.values()]

    # ---- inference ----------------------------------------------------------------------------

    async def infer(self, request: InferRequest, model: ModelVersion | None = None) -> InferResponse:
        """`model`: the request's model version, when the frontend has looked it up already."""
        arrival = time.monotonic_ns()
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if model is None:
            model = self.model(request.model, request.version)
        pending = None
        queue_ns = None  # set once the request reached its batcher
        try:
            inputs, rows, signature = validate(request, model)
            # an idle model's lone request runs now, here (Batcher.run_now): no future, no wait; else it is queued
            outputs = model.batcher.run_now(inputs, rows, signature)
            if outputs is not None:
                queue_ns = 0
                if isinstance(outputs, BaseException):
                    raise outputs
                return _answered(request, model, arrival, queue_ns, outputs)
            pending, timeout = _queue(request, model, arrival, inputs, rows, signature)
            if pending.deadline_ns is not None:
                try:
                    outputs = await asyncio.wait_for(asyncio.shield(pending.future),
                                                     (pending.deadline_ns - arrival) / 1e9)
                except TimeoutError:
                    pending.future.cancel()  # the batcher skips it if still queued
                    raise _timed_out(model, timeout) from None
            else:
                outputs = await pending.future
        except Exception as e:
            raise _failed(model, arrival, queue_ns if pending is None else pending.queue_ns, e) from None
        resumed = time.monotonic_ns()
        response = _answered(request, model, arrival, pending.queue_ns, outputs)
        if pending.done_ns:  # its call's phases: the frontend's encoding of the response is its own (not counted)
            now = time.monotonic_ns()
            model.stats.record_respond(now - pending.done_ns, now - resumed)
        return response

    def infer_soon(self, request: InferRequest, answer: Callable[[InferResponse | Exception], None]) -> None:
        """infer() without a coroutine: `answer` is called once, on the loop, with the response or the error.

        The engine process of `--frontends N` runs this for every request a front end sends: the requests
        of one socket read are validated and queued in that read's callback (the batcher sees them together
        on its next dispatch) and answered from their futures' callbacks, with no task, coroutine or
        wait_for per request. With ipc's one frame per run of calls, the engine loop's CPU time per request
        fell by about a third on the 2-core VM (bench/serve_engine_loop.py; this part alone ~15%).

        A request's timeout answers it at once while it is queued; once its batch has taken it, it is answered
        when the batch returns (a timeout error if the deadline passed meanwhile), as Triton times out queued
        requests only: its inputs may be views into the front end's staging arena (kiln/serve/staging.py),
        whose slots the front end reuses once the call is answered."""
        arrival = time.monotonic_ns()
        pending = None
        try:
            if not self.accepting:
                raise Unavailable("the server is shutting down")
            model = self.model(request.model, request.version)
            self.shared_memory.read_shared(request.inputs)  # a front end's inputs left in shared memory
        except ServeError as e:
            answer(e)
            return
        try:
            pending, timeout = _submit(request, model, arrival)
        except Exception as e:  # noqa: BLE001 - answered to the caller
            answer(_failed(model, arrival, None if pending is None else pending.queue_ns, e))
            return
        timer = None
        if pending.deadline_ns is not None:
            timer = model.batcher.loop.call_later((pending.deadline_ns - arrival) / 1e9, _expire, model, pending,
                                                  timeout)

        def settled(future: asyncio.Future) -> None:
            if timer is not None:
                timer.cancel()
            error = Unavailable("the request was cancelled") if future.cancelled() else future.exception()
            if error is None and pending.deadline_ns is not None and time.monotonic_ns() >= pending.deadline_ns:
                error = _timed_out(model, timeout)  # passed while its batch ran (_expire left it to finish)
            if error is not None:
                answer(_failed(model, arrival, pending.queue_ns, error))
                return
            settling = time.monotonic_ns()
            outputs = future.result()
            if request.output_places:  # written before the request counts as a success: a write can fail
                try:
                    outputs = self.shared_memory.write_outputs(outputs, request.output_places)
                except ServeError as e:
                    answer(_failed(model, arrival, pending.queue_ns, e))
                    return
            answer(_answered(request, model, arrival, pending.queue_ns, outputs))
            if pending.done_ns:  # its call's phases: the response built and queued for its front end (the write: send)
                now = time.monotonic_ns()
                model.stats.record_respond(now - pending.done_ns, now - settling)

        pending.future.add_done_callback(settled)

    # ---- system shared memory (a front-end process's core asks the engine's, which tells every front end) ----

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.shared_memory.register(name, key, offset, byte_size)

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        self.shared_memory.unregister(name)

    def system_shared_memory_status(self, name: str = "") -> list[dict]:
        return [r.to_json() for r in self.shared_memory.status(name)]

    # ---- the repository -----------------------------------------------------------------------

    async def start(self, load: list[str] | None = None) -> None:
        """Load every model of the repository (or those named); a model that fails to load is
        UNAVAILABLE with its reason, the others serve."""
        names = self.repository.names() if load is None else load
        for name in names:
            try:
                await self.load(name)
            except ServeError:
                pass  # recorded in the model's entry (the index shows it)
        self.started = True

    def index(self, ready_only: bool = False) -> list[dict]:
        rows = []
        for name in sorted(set(self.repository.names()) | set(self.models)):
            entry = self.models.get(name)
            if entry is None:
                if not ready_only:
                    rows.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": "not loaded"})
                continue
            if entry.versions:
                rows += [{"name": name, "version": v, "state": entry.state, "reason": entry.reason}
                         for v in sorted(entry.versions, key=int)]
            elif not ready_only:
                rows.append({"name": name, "version": "", "state": entry.state, "reason": entry.reason})
        return [r for r in rows if not ready_only or r["state"] == "READY"]

    async def load(self, name: str, config_json: str | dict | None = None) -> None:
        """(Re)load a model; a reload swaps versions in only once the new ones are ready."""
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        override = parse_json(config_json, f"load request for {name!r}") if config_json else None
        if name not in self.repository.names():
            raise NotFound(f"unknown model {name!r}; the repository holds {self.repository.names()}")
        entry = self.models.setdefault(name, ModelEntry(name))
        async with entry.lock:
            if not entry.versions:
                entry.state, entry.reason = "LOADING", ""
            try:
                loaded: list[LoadedVersion] = await asyncio.to_thread(self.repository.load, name, override)
            except ServeError as e:
                if not entry.versions:
                    entry.state, entry.reason = "UNAVAILABLE", str(e)
                raise ModelLoadError(f"failed to load model {name!r}: {e}") from e
            fresh = {}
            for v in loaded:
                stats = ModelStats(v.name, v.version)
                # off the loop: a CUDA instance captures its graphs as it is made, a CPU one binds shapes (warm-up);
                # the version is ready only after
                try:
                    batcher = await asyncio.to_thread(Batcher, v.engine, v.config, stats, self.max_queue_size,
                                                      self.warm_up, self.cuda_sync, self.batch_buckets)
                except ServeError as e:
                    if not entry.versions:
                        entry.state, entry.reason = "UNAVAILABLE", str(e)
                    raise
                batcher.start()
                fresh[v.version] = ModelVersion(v.name, v.version, v.engine, v.config, batcher, stats)
            old, entry.versions = entry.versions, fresh
            entry.state, entry.reason = "READY", ""
            for v in old.values():
                await v.batcher.close()  # requests it holds finish on the old engine

    async def unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            if name in self.repository.names():
                return  # not loaded: nothing to do (Triton answers success too)
            raise NotFound(f"unknown model {name!r}; the repository holds {self.repository.names()}")
        async with entry.lock:
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason = "UNLOADING", ""
            for v in old.values():
                await v.batcher.close()  # queued and running requests finish first
            entry.state, entry.reason = "UNAVAILABLE", "unloaded"

    async def close(self) -> None:
        """Graceful: refuse new requests, finish every queued and running one."""
        self.accepting = False
        for entry in self.models.values():
            for v in entry.versions.values():
                await v.batcher.close()


def _submit(request: InferRequest, model: ModelVersion, arrival: int) -> tuple[Pending, int | None]:
    """The request validated and queued on its model's batcher; its timeout (us) where one applies."""
    return _queue(request, model, arrival, *validate(request, model))


def _queue(request: InferRequest, model: ModelVersion, arrival: int, inputs: dict[str, np.ndarray], rows: int,
           signature: Signature) -> tuple[Pending, int | None]:
    """The validated request queued on its model's batcher; its timeout (us) where one applies."""
    timeout = request.timeout_us
    if model.default_timeout_us and (not timeout or model.default_timeout_us < timeout):
        timeout = model.default_timeout_us
    deadline = arrival + timeout * 1000 if timeout else None
    return model.batcher.submit(inputs, rows, signature, deadline), timeout


def _timed_out(model: ModelVersion, timeout: int | None) -> RequestTimeout:
    return RequestTimeout(f"model {model.name!r}: the request's timeout of {timeout} us passed before it was answered")


def _expire(model: ModelVersion, pending: Pending, timeout: int | None) -> None:
    """infer_soon's deadline: a queued request is answered now (the batcher drops it); one its batch has taken
    (queue_ns set) is left to finish, and answered then."""
    if pending.queue_ns is None and not pending.future.done():
        pending.future.set_exception(_timed_out(model, timeout))


def _failed(model: ModelVersion, arrival: int, queue_ns: int | None, e: BaseException) -> BaseException:
    """A failed request recorded in its model's statistics (queue_ns: None where it never reached its batch); the
    error its caller gets."""
    duration = time.monotonic_ns() - arrival
    if isinstance(e, BindingError):  # the engine's own check of a request validate() let through
        model.stats.record_request(False, duration, queue_ns, "OTHER")
        return InvalidRequest(f"model {model.name!r}: {e}")
    model.stats.record_request(False, duration, queue_ns, failure_reason(e) if isinstance(e, ServeError) else "BACKEND")
    return e


def _answered(request: InferRequest, model: ModelVersion, arrival: int, queue_ns: int | None,
              outputs: dict[str, np.ndarray]) -> InferResponse:
    model.stats.record_request(True, time.monotonic_ns() - arrival, queue_ns)
    names = request.outputs if request.outputs is not None else model.output_names
    return InferResponse(model.name, model.version, request.id, [(n, outputs[n]) for n in names])


def failure_reason(e: ServeError) -> str:
    """Triton's reason label of nv_inference_request_failure."""
    if isinstance(e, (QueueFull, Unavailable)):
        return "REJECTED"
    if isinstance(e, RequestTimeout):
        return "CANCELED"
    if isinstance(e, InvalidRequest):
        return "OTHER"
    return "BACKEND"


def validate(request: InferRequest, model: ModelVersion) -> tuple[dict[str, np.ndarray], int, Signature]:
    """The request's inputs against the model's config and profiles: every problem a 400 naming
    the tensor, expected and given. Returns the inputs in config order, the batch rows and the
    shapes past the batch axis (what the batcher groups by)."""
    return _validate_quickly(request, model) or _validate(request, model)


def _validate_quickly(request: InferRequest, model: ModelVersion) -> tuple[dict[str, np.ndarray], int, Signature] | None:
    """validate()'s answer for a request that passes every check (the common case), in few steps;
    None for anything else: _validate then says what is wrong, or answers the rarer valid cases.
    The shape checks' answer is remembered per combination of input shapes (model.valid_shapes): a
    server sees few, and a request then costs a dtype check and a dict lookup per input. Requested outputs
    (HTTP clients name theirs, tritonclient's too) pass when each is the model's and none is named twice."""
    given = request.inputs
    specs = model.input_specs
    outputs = request.outputs
    if len(given) != len(specs) or (outputs is not None and not (
            model.output_set.issuperset(outputs) and len(set(outputs)) == len(outputs))):
        return None
    inputs, shapes = {}, []
    for name, dtype, _ in specs:
        array = given.get(name)
        if array is None or (array.dtype is not dtype and array.dtype != dtype):
            return None
        inputs[name] = array
        shapes.append(array.shape)
    shapes = tuple(shapes)
    found = model.valid_shapes.get(shapes)
    if found is None:
        found = _batch_of(shapes, model)
        if found is None:
            return None
        if len(model.valid_shapes) >= 1024:
            model.valid_shapes.clear()
        model.valid_shapes[shapes] = found
    return inputs, found[0], found[1]


def _batch_of(shapes: tuple[tuple[int, ...], ...], model: ModelVersion) -> tuple[int, Signature] | None:
    """The rows and signature of a request whose inputs have these shapes (in config order), or None when
    the shapes do not fit the config's dims, its max batch or the engine's profiles."""
    batching = model.config.max_batch_size > 0
    rows, signature = 1, []
    for k, ((_, _, dims), shape) in enumerate(zip(model.input_specs, shapes)):
        if batching:
            if k == 0:
                rows = shape[0] if shape else 0
            elif not shape or shape[0] != rows:
                return None
            shape = shape[1:]
        if len(shape) != len(dims) or any(w != d and w != -1 for w, d in zip(dims, shape)):
            return None
        signature.append(shape)
    if batching and not 1 <= rows <= model.config.max_batch_size:
        return None
    signature = tuple(signature)
    if model.batcher.shapes.padded(signature, rows) is None:
        return None
    return rows, signature


def _validate(request: InferRequest, model: ModelVersion) -> tuple[dict[str, np.ndarray], int, Signature]:
    config = model.config
    name = model.name
    unknown = [n for n in request.inputs if config.input(n) is None]
    if unknown:
        raise InvalidRequest(f"model {name!r} has no input(s) {unknown}; its inputs are {[t.name for t in config.inputs]}")
    missing = [t.name for t in config.inputs if t.name not in request.inputs]
    if missing:
        raise InvalidRequest(f"model {name!r}: missing input(s) {missing}")
    if request.outputs is not None:
        wrong = [n for n in request.outputs if config.output(n) is None]
        if wrong:
            raise InvalidRequest(f"model {name!r} has no output(s) {wrong}; its outputs are "
                                 f"{[t.name for t in config.outputs]}")
        if len(set(request.outputs)) != len(request.outputs):
            raise InvalidRequest(f"model {name!r}: an output is requested twice in {request.outputs}")
    batching = config.max_batch_size > 0
    inputs, rows = {}, None
    for t in config.inputs:
        array = request.inputs[t.name]
        given = datatypes.of_array(array)
        if given is not t.datatype:
            raise InvalidRequest(f"input {t.name!r} of model {name!r}: datatype {given.v2} given, expected {t.datatype.v2}")
        shape = list(array.shape)
        dims = shape[1:] if batching else shape
        if len(shape) != len(t.shape(config.max_batch_size)) or any(w != -1 and w != d for w, d in zip(t.dims, dims)):
            raise InvalidRequest(f"input {t.name!r} of model {name!r}: shape {shape} given, expected "
                                 f"{t.shape(config.max_batch_size)} (-1: any size"
                                 f"{', the batch axis at most ' + str(config.max_batch_size) if batching else ''})")
        if batching:
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise InvalidRequest(f"model {name!r}: inputs have different batch sizes ({rows} and {shape[0]} "
                                     f"for {t.name!r})")
        inputs[t.name] = array
    rows = rows if rows is not None else 1
    if batching and not 1 <= rows <= config.max_batch_size:
        raise InvalidRequest(f"model {name!r}: batch size {rows} given, expected 1..{config.max_batch_size} "
                             "(max_batch_size)")
    signature = tuple(tuple(a.shape[1:] if batching else a.shape) for a in inputs.values())
    if model.batcher.shapes.padded(signature, rows) is None:
        given = ", ".join(f"{n} {list(a.shape)}" for n, a in inputs.items())
        raise InvalidRequest(f"model {name!r}: input shapes {given} are outside every optimization profile of its "
                             f"engine ({'; '.join(p.describe() for p in model.engine.profiles)})")
    return inputs, rows, signature
