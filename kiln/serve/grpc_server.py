"""The gRPC frontend (grpc.aio): Triton's `inference.GRPCInferenceService`, over a ServerCore.

The messages and the servicer base class are the ones tritonclient ships (its service_pb2 and
service_pb2_grpc, generated from Triton's own protocol files), so field numbers are Triton's and
`tritonclient.grpc` works unchanged. Implemented: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelInfer, ModelStreamInfer, ModelConfig, ModelStatistics,
RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload, SystemSharedMemoryStatus/Register/
Unregister; CUDA shared memory answers UNIMPLEMENTED with a reason, the trace and log calls
UNIMPLEMENTED (the base class's answer). Errors map as the HTTP ones do
(kiln/serve/errors.py: INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from kiln.serve import datatypes
from kiln.serve.core import InferRequest, InferResponse, ServerCore
from kiln.serve.errors import InvalidRequest, NotSupported, ServeError
from kiln.serve.grpc_options import GrpcOptions
from kiln.serve.grpc_wire import Parts, QuickLayout, ResponseEncoder, WireRequest, parse_infer_request
from kiln.serve.http_codec import OutputOptions, classify
from kiln.serve.shared_memory import (
    CUDA_NOT_SUPPORTED,
    SharedMemoryRegistry,
    SharedTensor,
    TensorPlace,
    output_parameters,
    tensor_place,
)

log = logging.getLogger("kiln.serve")
SERVICE = "inference.GRPCInferenceService"

# InferTensorContents' typed field for each datatype sent without raw_input_contents
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


async def _abort(context, e: Exception, method: str) -> None:
    """ServeError -> its status code and message; anything else -> INTERNAL (and logged)."""
    if isinstance(e, ServeError):
        if e.retry_after:
            context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
        await context.abort(getattr(grpc.StatusCode, e.grpc_code), str(e))
    log.exception("internal error in %s", method, exc_info=e)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def _answers_errors(method):
    @functools.wraps(method)
    async def wrapped(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001 - answered to the client (_abort)
            await _abort(context, e, method.__name__)

    return wrapped


def _decode_quickly(request: pb.ModelInferRequest, raw) -> InferRequest | None:
    """The common request (every input raw, of a fixed-size type, sizes that agree; no parameters, no
    outputs named) in few steps; None for anything else, which decode_request then handles or refuses.
    `raw`: the tensors' bytes (request.raw_input_contents, or views into the received message)."""
    tensors = request.inputs
    if not raw or len(raw) != len(tensors) or request.parameters or request.outputs:
        return None
    inputs: dict[str, np.ndarray] = {}
    for tensor, data in zip(tensors, raw):
        datatype = datatypes.BY_V2.get(tensor.datatype)
        name = tensor.name
        if datatype is None or datatype.v2 == "BYTES" or not name or name in inputs or tensor.parameters:
            return None
        shape = tuple(tensor.shape)
        count = 1
        for d in shape:
            count *= d
        if count < 0 or min(shape, default=0) < 0 or len(data) != count * datatype.numpy.itemsize:
            return None
        inputs[name] = np.frombuffer(data, dtype=datatype.numpy).reshape(shape)  # read-only (datatypes.from_bytes)
    return InferRequest(model=request.model_name, version=request.model_version, id=request.id, inputs=inputs)


def _decode_layout(layout: QuickLayout, data: bytes) -> InferRequest:
    """_decode_quickly's answer for a request of a known layout (grpc_wire.QuickLayouts), the rest from the layout:
    its tensors writable arrays over one copy of the message's bytes (small: grpc_wire.WALK_FROM_BYTES), the
    request's own, so that the engine call takes them as they are. Read-only views of `data` would each be copied
    by the batcher (engines may write their inputs: batcher.writable), with a reshape each: one numpy call an input
    instead of three (~0.8 us of ~1.6 an input, on the 2-core VM)."""
    buffer = bytearray(data)
    return InferRequest(layout.model, layout.version, layout.id, {
        name: np.ndarray(shape, dtype, buffer, offset) for name, dtype, _, offset, shape in layout.inputs})


def _values(parameters) -> dict:
    """InferParameter messages as plain values (what shared_memory.tensor_place reads)."""
    values = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            values[key] = getattr(parameter, choice)
    return values


def decode_request(request: pb.ModelInferRequest, shared_memory: SharedMemoryRegistry,
                   raw=None) -> tuple[InferRequest, OutputOptions]:
    raw = request.raw_input_contents if raw is None else raw
    quick = _decode_quickly(request, raw)
    if quick is not None:
        return quick, OutputOptions()
    # inputs in shared memory have no raw_input_contents (tritonclient sends none for them): the others take
    # theirs in order
    places = [tensor_place(_values(t.parameters), t.name) if t.parameters else None for t in request.inputs]
    sent = sum(place is None for place in places)
    if raw and len(raw) != sent:
        raise InvalidRequest(f"{len(raw)} raw_input_contents for {sent} inputs not in shared memory: send every "
                             "input's data raw, or every input's in contents")
    raw_data = iter(raw)
    inputs: dict[str, np.ndarray] = {}
    for k, (tensor, place) in enumerate(zip(request.inputs, places)):
        name = tensor.name
        if not name:
            raise InvalidRequest(f"inputs[{k}] needs a name")
        if name in inputs:
            raise InvalidRequest(f"input {name!r} is given twice")
        datatype = datatypes.from_v2(tensor.datatype, name)
        shape = list(tensor.shape)
        if place is not None:
            inputs[name] = shared_memory.read(place, datatype, shape, name)
            continue
        if raw:
            inputs[name] = datatypes.from_bytes(next(raw_data), datatype, shape, name)  # checks the shape
            continue
        field_name = _CONTENTS.get(datatype.v2)
        if field_name is None:
            raise InvalidRequest(f"input {name!r}: {datatype.v2} data must be sent in raw_input_contents")
        values = list(getattr(tensor.contents, field_name))
        count = datatypes.element_count(shape, name)
        if len(values) != count:
            raise InvalidRequest(f"input {name!r}: {len(values)} values in contents.{field_name}, shape {shape} "
                                 f"needs {count}")
        if datatype.v2 == "BYTES":
            array = np.empty(count, dtype=object)
            array[:] = values
        else:
            array = np.asarray(values, dtype=np.float64 if datatype.numpy.kind == "f" else None)
            if datatype.numpy.kind in "iu" and array.size:
                info = np.iinfo(datatype.numpy)
                if array.min() < info.min or array.max() > info.max:
                    raise InvalidRequest(f"input {name!r}: values outside {datatype.v2}'s range")
            array = array.astype(datatype.numpy)
        inputs[name] = array.reshape(shape)
    timeout = None
    if request.parameters and "timeout" in request.parameters:
        timeout = request.parameters["timeout"].int64_param
        if timeout < 0:
            raise InvalidRequest("parameter 'timeout' must be >= 0 microseconds")
    outputs, options = None, OutputOptions()
    if request.outputs:
        outputs = []
        for o in request.outputs:
            values = _values(o.parameters)
            place = tensor_place(values, o.name)
            if place is not None:
                shared_memory.check(place, o.name)  # an unknown region or window: refused before the model runs
                options.places[o.name] = place
            if "classification" in values:
                k = values["classification"]
                if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                    raise InvalidRequest(f"output {o.name!r}: classification must be an integer >= 0")
                options.classification[o.name] = k
            outputs.append(o.name)
    return InferRequest(model=request.model_name, version=request.model_version, id=request.id, inputs=inputs,
                        outputs=outputs, timeout_us=timeout or None, output_places=options.engine_places()), options


_Output = pb.ModelInferResponse.InferOutputTensor


def _output_parameters(place: TensorPlace, written: int) -> dict[str, pb.InferParameter]:
    return {key: pb.InferParameter(string_param=value) if isinstance(value, str) else pb.InferParameter(int64_param=value)
            for key, value in output_parameters(place, written).items()}


def encode_response(response: InferResponse, options: OutputOptions | None, batched: bool,
                    shared_memory: SharedMemoryRegistry) -> pb.ModelInferResponse:
    tensors, contents = [], []
    for name, array in response.outputs:
        if type(array) is SharedTensor:  # the engine process wrote it into its region
            parameters = _output_parameters(options.places[name], array.place.byte_size)
            tensors.append(_Output(name=name, datatype=array.datatype, shape=array.shape, parameters=parameters))
            contents.append(b"")
            continue
        if options and name in options.classification:
            array = classify(array, options.classification[name], batched)
        place = options.places.get(name) if options else None
        if place is not None:  # empty contents keep every later output's raw_output_contents at its index
            parameters = _output_parameters(place, shared_memory.write(place, array, name))
            tensors.append(_Output(name=name, datatype=datatypes.of_array(array).v2, shape=array.shape,
                                   parameters=parameters))
            contents.append(b"")
            continue
        tensors.append(_Output(name=name, datatype=datatypes.of_array(array).v2, shape=array.shape))
        contents.append(datatypes.to_bytes(array))
    # one constructor call: the outputs and their bytes given whole (not added one field at a time)
    return pb.ModelInferResponse(model_name=response.model, model_version=response.version, id=response.id,
                                 outputs=tensors, raw_output_contents=contents)


def serialize_response(response: pb.ModelInferResponse | bytes | Parts) -> bytes:
    """ModelInfer's response_serializer: the answer's bytes (ResponseEncoder's, its Parts joined), or the
    message's. (kiln's transport takes Parts as they are: grpc_h2.GrpcConnection._answer_parts.)"""
    if type(response) is bytes:
        return response
    if type(response) is Parts:
        return b"".join(response)
    return response.SerializeToString()


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: ServerCore):
        self.core = core
        self.responses = ResponseEncoder()

    @_answers_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.core.live)

    @_answers_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.ready)

    @_answers_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.core.model_ready(request.name, request.version))

    @_answers_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**self.core.metadata())

    @_answers_errors
    async def ModelMetadata(self, request, context):
        meta = self.core.model_metadata(request.name, request.version)
        message = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
        for kind in ("inputs", "outputs"):
            for t in meta[kind]:
                getattr(message, kind).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return message

    @_answers_errors
    async def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(config=self.core.model(request.name, request.version).config.to_proto())

    @_answers_errors
    async def ModelStatistics(self, request, context):
        message = pb.ModelStatisticsResponse()
        for stats in await self.core.statistics_json(request.name, request.version):
            json_format.ParseDict(stats, message.model_stats.add(), ignore_unknown_fields=True)  # kiln's warm_up
        return message

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        model = self.core.model(request.model_name, request.model_version)  # NOT_FOUND before decoding
        infer_request, options = decode_request(request, self.core.shared_memory)
        response = await self.core.infer(infer_request, model)
        return encode_response(response, options, model.config.max_batch_size > 0, self.core.shared_memory)

    async def ModelInfer(self, request, context):
        """`request`: a WireRequest (kiln serve's deserializer, kiln/serve/grpc_wire.py) or a ModelInferRequest.
        _infer's steps inline, with _answers_errors' handling: the hot path, one coroutine frame."""
        try:
            options = None
            if type(request) is WireRequest and request.layout is not None:  # a small request of a known layout
                model = self.core.model(request.layout.model, request.layout.version)
                infer_request = _decode_layout(request.layout, request.data)
            else:
                if type(request) is WireRequest:
                    if request.message is None:
                        raise InvalidRequest(request.error)
                    request, raw = request.message, request.raw
                else:
                    raw = request.raw_input_contents
                model = self.core.model(request.model_name, request.model_version)  # NOT_FOUND before decoding
                infer_request = _decode_quickly(request, raw)
                if infer_request is None:
                    infer_request, options = decode_request(request, self.core.shared_memory, raw)
            response = await self.core.infer(infer_request, model)
            if options is None:  # the common answer (every output raw): its bytes or Parts, for serialize_response
                return self.responses.encode(response.model, response.version, response.id, [
                    (name, datatypes.of_array(array).v2, array.shape, datatypes.raw_view(array))
                    for name, array in response.outputs])
            return encode_response(response, options, model.config.max_batch_size > 0, self.core.shared_memory)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001 - answered to the client (_abort)
            await _abort(context, e, "ModelInfer")

    async def ModelStreamInfer(self, request_iterator, context):
        """Responses in completion order, each with its request's id; an error is a response too."""
        responses: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def one(request):
            try:
                await responses.put(pb.ModelStreamInferResponse(infer_response=await self._infer(request)))
            except ServeError as e:
                await responses.put(pb.ModelStreamInferResponse(
                    error_message=str(e), infer_response=pb.ModelInferResponse(
                        id=request.id, model_name=request.model_name, model_version=request.model_version)))

        async def read():
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            await responses.put(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await responses.get()) is not None:
                yield item
        finally:
            reader.cancel()

    # ---- system shared memory (kiln/serve/shared_memory.py); CUDA shared memory: not supported ----

    @_answers_errors
    async def SystemSharedMemoryStatus(self, request, context):
        message = pb.SystemSharedMemoryStatusResponse()
        for region in self.core.system_shared_memory_status(request.name):
            message.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return message

    @_answers_errors
    async def SystemSharedMemoryRegister(self, request, context):
        await self.core.register_system_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_answers_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        await self.core.unregister_system_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_answers_errors
    async def CudaSharedMemoryStatus(self, request, context):
        if request.name:
            raise NotSupported(CUDA_NOT_SUPPORTED)
        return pb.CudaSharedMemoryStatusResponse()  # none can be registered

    @_answers_errors
    async def CudaSharedMemoryRegister(self, request, context):
        raise NotSupported(CUDA_NOT_SUPPORTED)

    @_answers_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        raise NotSupported(CUDA_NOT_SUPPORTED)

    @_answers_errors
    async def RepositoryIndex(self, request, context):
        message = pb.RepositoryIndexResponse()
        for row in self.core.index(request.ready):
            message.models.add(**row)
        return message

    @_answers_errors
    async def RepositoryModelLoad(self, request, context):
        config = None
        if "config" in request.parameters:
            config = request.parameters["config"].string_param
        files = [k for k in request.parameters if k.startswith("file:")]
        if files:
            raise InvalidRequest(f"model files in a load request ({files}) are not supported; put them in the repository")
        await self.core.load(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_answers_errors
    async def RepositoryModelUnload(self, request, context):
        await self.core.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


class _Handlers:
    """Stands in for a server to catch the method handlers the generated add_..._to_server makes."""

    def __init__(self):
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def method_handlers(servicer: InferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The generated registration's handler per method name, with ModelInfer's request deserialized by
    parse_infer_request (tensor bytes as views into the received message, not protobuf's copies) and its
    answer serialized by serialize_response (the common answer arrives as bytes). Both transports serve
    this table: grpcio's server (add_servicer) and kiln's own (kiln/serve/grpc_h2.py)."""
    caught = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, caught)
    handlers = caught.handlers
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer, request_deserializer=parse_infer_request,
        response_serializer=serialize_response)
    return handlers


def add_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def grpc_server(core: ServerCore, host: str, port: int, max_message_bytes: int, reuse_port: bool = False,
                options: GrpcOptions | None = None) -> tuple[grpc.aio.Server, int]:
    """The server with the servicer added and its port bound (0: a free one); not started. `reuse_port`:
    SO_REUSEPORT, for front-end processes sharing the port (off otherwise: a second server on a port in use
    is an error, not a silent share). `options`: TLS, compression and keepalive, as channel arguments and
    credentials (GrpcOptions; the max message size bounds decompressed requests too)."""
    options = options or GrpcOptions()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", -1),
                                      ("grpc.so_reuseport", int(reuse_port)), *options.channel_args()])
    add_servicer(InferenceServicer(core), server)
    credentials = options.server_credentials()
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port} (in use?)")
    return server, bound
