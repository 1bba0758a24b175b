"""The gRPC frontend (grpc.aio): Triton's `inference.GRPCInferenceService`, over a ServerCore.

The messages and the servicer base class are the ones tritonclient ships (its service_pb2 and
service_pb2_grpc, generated from Triton's own protocol files), so field numbers are Triton's and
`tritonclient.grpc` works unchanged. Implemented: ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelInfer, ModelStreamInfer, ModelConfig, ModelStatistics,
RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload; the shared-memory, trace and log
calls answer UNIMPLEMENTED (the base class's answer). Errors map as the HTTP ones do
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
from kiln.serve.errors import InvalidRequest, ServeError
from kiln.serve.grpc_wire import WireRequest, parse_infer_request
from kiln.serve.http_codec import classify

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


def decode_request(request: pb.ModelInferRequest, raw=None) -> tuple[InferRequest, dict[str, int]]:
    raw = request.raw_input_contents if raw is None else raw
    quick = _decode_quickly(request, raw)
    if quick is not None:
        return quick, {}
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: send every input's "
                             "data raw, or every input's in contents")
    inputs: dict[str, np.ndarray] = {}
    for k, tensor in enumerate(request.inputs):
        name = tensor.name
        if not name:
            raise InvalidRequest(f"inputs[{k}] needs a name")
        if name in inputs:
            raise InvalidRequest(f"input {name!r} is given twice")
        datatype = datatypes.from_v2(tensor.datatype, name)
        shape = list(tensor.shape)
        if tensor.parameters and any(key.startswith("shared_memory") for key in tensor.parameters):
            raise InvalidRequest(f"input {name!r}: shared memory is not supported by kiln serve; send the data")
        if raw:
            inputs[name] = datatypes.from_bytes(raw[k], datatype, shape, name)  # checks the shape
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
    outputs, classification = None, {}
    if request.outputs:
        outputs = []
        for o in request.outputs:
            if any(key.startswith("shared_memory") for key in o.parameters):
                raise InvalidRequest(f"output {o.name!r}: shared memory is not supported by kiln serve")
            if "classification" in o.parameters:
                k = o.parameters["classification"].int64_param
                if k < 0:
                    raise InvalidRequest(f"output {o.name!r}: classification must be >= 0")
                classification[o.name] = k
            outputs.append(o.name)
    return InferRequest(model=request.model_name, version=request.model_version, id=request.id, inputs=inputs,
                        outputs=outputs, timeout_us=timeout or None), classification


_Output = pb.ModelInferResponse.InferOutputTensor


def encode_response(response: InferResponse, classification: dict[str, int] | None,
                    batched: bool) -> pb.ModelInferResponse:
    tensors, contents = [], []
    for name, array in response.outputs:
        if classification and name in classification:
            array = classify(array, classification[name], batched)
        tensors.append(_Output(name=name, datatype=datatypes.of_array(array).v2, shape=array.shape))
        contents.append(datatypes.to_bytes(array))
    # one constructor call: the outputs and their bytes given whole (not added one field at a time)
    return pb.ModelInferResponse(model_name=response.model, model_version=response.version, id=response.id,
                                 outputs=tensors, raw_output_contents=contents)


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: ServerCore):
        self.core = core

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
            json_format.ParseDict(stats, message.model_stats.add())
        return message

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        model = self.core.model(request.model_name, request.model_version)  # NOT_FOUND before decoding
        infer_request, classification = decode_request(request)
        response = await self.core.infer(infer_request, model)
        return encode_response(response, classification, model.config.max_batch_size > 0)

    async def ModelInfer(self, request, context):
        """`request`: a WireRequest (kiln serve's deserializer, kiln/serve/grpc_wire.py) or a ModelInferRequest.
        _infer's steps inline, with _answers_errors' handling: the hot path, one coroutine frame."""
        try:
            if type(request) is WireRequest:
                if request.message is None:
                    raise InvalidRequest(request.error)
                request, raw = request.message, request.raw
            else:
                raw = request.raw_input_contents
            model = self.core.model(request.model_name, request.model_version)  # NOT_FOUND before decoding
            infer_request = _decode_quickly(request, raw)
            classification = None
            if infer_request is None:
                infer_request, classification = decode_request(request, raw)
            response = await self.core.infer(infer_request, model)
            return encode_response(response, classification, model.config.max_batch_size > 0)
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


def add_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with ModelInfer's request deserialized by parse_infer_request
    (tensor bytes as views into the received message, not protobuf's copies)."""
    caught = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, caught)
    handlers = caught.handlers
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer, request_deserializer=parse_infer_request,
        response_serializer=pb.ModelInferResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def grpc_server(core: ServerCore, host: str, port: int, max_message_bytes: int,
                reuse_port: bool = False) -> tuple[grpc.aio.Server, int]:
    """The server with the servicer added and its port bound (0: a free one); not started. `reuse_port`:
    SO_REUSEPORT, for front-end processes sharing the port (off otherwise: a second server on a port in use
    is an error, not a silent share)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", -1),
                                      ("grpc.so_reuseport", int(reuse_port))])
    add_servicer(InferenceServicer(core), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port} (in use?)")
    return server, bound
