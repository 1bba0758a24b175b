"""The HTTP frontend (FastAPI): KServe v2 routes with Triton's extensions, over a ServerCore.

    GET  /v2/health/live | /v2/health/ready                  200, or 400 when not (the v2 protocol's 4xx)
    GET  /v2                                                 server metadata
    GET  /v2/models/{m}[/versions/{v}]                       model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready                 200, or 400
    GET  /v2/models/{m}[/versions/{v}]/config                Triton's model config as JSON
    GET  /v2/models[/{m}[/versions/{v}]]/stats               Triton's statistics
    POST /v2/models/{m}[/versions/{v}]/infer                 JSON and binary tensors
    POST /v2/repository/index                                {"ready": bool} optional
    POST /v2/repository/models/{m}/load | /unload            {"parameters": {"config": "<json>"}} optional
    GET  /v2/systemsharedmemory[/region/{r}]/status          registered regions (kiln/serve/shared_memory.py)
    POST /v2/systemsharedmemory/region/{r}/register          {"key": "/name", "offset": 0, "byte_size": n}
    POST /v2/systemsharedmemory[/region/{r}]/unregister      one region, or all
    *    /v2/cudasharedmemory/...                            400 not supported (the status lists none)
    GET  /metrics                                            Prometheus text (also on --metrics-port)

Every error answers {"error": "..."}: 400 malformed, 404 unknown model/version or route, 413 too
large, 429 queue full and 503 unavailable (both with Retry-After); a 500 only for a fault of the server.
Handlers read the raw request (no pydantic models on the hot path); the OpenAPI document still
describes the bodies (kiln/serve/openapi.py).
"""

from __future__ import annotations

import json
import logging
import zlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kiln.serve import openapi
from kiln.serve.core import ServerCore
from kiln.serve.errors import InvalidRequest, NotSupported, PayloadTooLarge, ServeError
from kiln.serve.http_codec import (
    HEADER_LENGTH,
    decode_request,
    encode_response,
    parse_json_header,
)
from kiln.serve.metrics import CONTENT_TYPE, MetricsExporter
from kiln.serve.shared_memory import CUDA_NOT_SUPPORTED

log = logging.getLogger("kiln.serve")
DEFAULT_MAX_REQUEST_BYTES = 64 << 20


def _json(body: object, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json")


def error_response(status: int, message: str, retry_after: int | None = None) -> Response:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, inflated when Content-Encoding says gzip/deflate, never more than `limit` bytes."""
    check_length(request.headers.get("content-length"), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds the server's limit of {limit} bytes")
        chunks.append(chunk)
    return inflate(b"".join(chunks), request.headers.get("content-encoding", ""), limit)


def check_length(length: str | None, limit: int) -> None:
    if length and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"the request body of {length} bytes exceeds the server's limit of {limit}")


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    encoding = encoding.lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, detected
        try:
            body = inflater.decompress(body, limit + 1)
        except zlib.error as e:
            raise InvalidRequest(f"the body is not valid {encoding} data: {e}") from None
        if len(body) > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"the inflated request body exceeds the server's limit of {limit} bytes")
    elif encoding not in ("", "identity"):
        raise InvalidRequest(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    return body


async def _optional_object(request: Request, limit: int) -> dict:
    body = await read_body(request, limit)
    if not body.strip():
        return {}
    return parse_json_header(body)


def http_app(core: ServerCore, metrics: MetricsExporter, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="kiln serve", version=core.metadata()["version"], openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None,
                  description="KServe v2 / Open Inference Protocol with Triton Inference Server's extensions.")

    @app.exception_handler(ServeError)
    async def serve_error(_request: Request, e: ServeError) -> Response:
        return error_response(e.http_status, str(e), e.retry_after)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, e: HTTPException) -> Response:
        message = "no such route" if e.status_code == 404 else str(e.detail)
        return error_response(e.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError) -> Response:
        return error_response(400, f"invalid request: {e.errors()}")

    @app.exception_handler(Exception)
    async def server_fault(request: Request, e: Exception) -> Response:
        log.exception("internal error answering %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    # ---- health and metadata ------------------------------------------------------------------

    @app.get("/v2/health/live", responses=openapi.EMPTY)
    async def live() -> Response:
        return Response(status_code=200 if core.live else 400)

    @app.get("/v2/health/ready", responses=openapi.EMPTY)
    async def ready() -> Response:
        return Response(status_code=200 if core.ready else 400)

    @app.get("/v2", responses=openapi.OBJECT)
    async def server_metadata() -> Response:
        return _json(core.metadata())

    @app.get("/metrics", responses=openapi.TEXT)
    async def prometheus() -> Response:
        return Response(await metrics.scrape(), media_type=CONTENT_TYPE)

    # ---- statistics (before /v2/models/{m}: "stats" is not a model name here, as in Triton) ----

    @app.get("/v2/models/stats", responses=openapi.OBJECT)
    async def all_stats() -> Response:
        return _json({"model_stats": await core.statistics_json()})

    @app.get("/v2/models/{model_name}/stats", responses=openapi.OBJECT)
    @app.get("/v2/models/{model_name}/versions/{model_version}/stats", responses=openapi.OBJECT)
    async def model_stats(model_name: str, model_version: str = "") -> Response:
        return _json({"model_stats": await core.statistics_json(model_name, model_version)})

    # ---- models -------------------------------------------------------------------------------

    @app.get("/v2/models/{model_name}", responses=openapi.OBJECT)
    @app.get("/v2/models/{model_name}/versions/{model_version}", responses=openapi.OBJECT)
    async def model_metadata(model_name: str, model_version: str = "") -> Response:
        return _json(core.model_metadata(model_name, model_version))

    @app.get("/v2/models/{model_name}/ready", responses=openapi.EMPTY)
    @app.get("/v2/models/{model_name}/versions/{model_version}/ready", responses=openapi.EMPTY)
    async def model_ready(model_name: str, model_version: str = "") -> Response:
        return Response(status_code=200 if core.model_ready(model_name, model_version) else 400)

    @app.get("/v2/models/{model_name}/config", responses=openapi.OBJECT)
    @app.get("/v2/models/{model_name}/versions/{model_version}/config", responses=openapi.OBJECT)
    async def model_config(model_name: str, model_version: str = "") -> Response:
        return _json(core.model(model_name, model_version).config.to_json())

    @app.post("/v2/models/{model_name}/infer", openapi_extra=openapi.INFER, responses=openapi.INFER_RESPONSES)
    @app.post("/v2/models/{model_name}/versions/{model_version}/infer", openapi_extra=openapi.INFER,
              responses=openapi.INFER_RESPONSES)
    async def infer(request: Request, model_name: str, model_version: str = "") -> Response:
        body = await read_body(request, max_request_bytes)
        core.model(model_name, model_version)  # an unknown model is a 404 before the body is parsed
        infer_request, options = decode_request(body, request.headers.get(HEADER_LENGTH), model_name, model_version,
                                                core.shared_memory)
        response = await core.infer(infer_request)
        batched = core.model(model_name, response.version).config.max_batch_size > 0
        payload, header_length = encode_response(response, options, batched, core.shared_memory)
        if header_length is None:
            return Response(payload, media_type="application/json")
        return Response(payload, media_type="application/octet-stream", headers={HEADER_LENGTH: str(header_length)})

    # ---- system shared memory (Triton's extension; CUDA shared memory answers "not supported") -------

    @app.get("/v2/systemsharedmemory/status", responses=openapi.ARRAY)
    @app.get("/v2/systemsharedmemory/region/{region_name}/status", responses=openapi.ARRAY)
    async def shared_memory_status(region_name: str = "") -> Response:
        return _json(core.system_shared_memory_status(region_name))

    @app.post("/v2/systemsharedmemory/region/{region_name}/register", openapi_extra=openapi.REGISTER,
              responses=openapi.EMPTY)
    async def shared_memory_register(request: Request, region_name: str) -> Response:
        body = await _optional_object(request, max_request_bytes)
        await core.register_system_shared_memory(region_name, body.get("key"), body.get("offset", 0),
                                                 body.get("byte_size"))
        return Response(status_code=200)

    @app.post("/v2/systemsharedmemory/unregister", responses=openapi.EMPTY)
    @app.post("/v2/systemsharedmemory/region/{region_name}/unregister", responses=openapi.EMPTY)
    async def shared_memory_unregister(region_name: str = "") -> Response:
        await core.unregister_system_shared_memory(region_name)
        return Response(status_code=200)

    @app.get("/v2/cudasharedmemory/status", responses=openapi.ARRAY)
    @app.get("/v2/cudasharedmemory/region/{region_name}/status", responses=openapi.ARRAY)
    async def cuda_shared_memory_status(region_name: str = "") -> Response:
        if region_name:
            raise NotSupported(CUDA_NOT_SUPPORTED)
        return _json([])  # none can be registered

    @app.post("/v2/cudasharedmemory/region/{region_name}/register", responses=openapi.EMPTY)
    @app.post("/v2/cudasharedmemory/unregister", responses=openapi.EMPTY)
    @app.post("/v2/cudasharedmemory/region/{region_name}/unregister", responses=openapi.EMPTY)
    async def cuda_shared_memory(region_name: str = "") -> Response:
        raise NotSupported(CUDA_NOT_SUPPORTED)

    # ---- repository ---------------------------------------------------------------------------

    @app.post("/v2/repository/index", openapi_extra=openapi.INDEX, responses=openapi.ARRAY)
    async def repository_index(request: Request) -> Response:
        body = await _optional_object(request, max_request_bytes)
        ready_only = body.get("ready", False)
        if not isinstance(ready_only, bool):
            raise InvalidRequest("'ready' must be true or false")
        return _json(core.index(ready_only))

    @app.post("/v2/repository/models/{model_name}/load", openapi_extra=openapi.LOAD, responses=openapi.EMPTY)
    async def repository_load(request: Request, model_name: str) -> Response:
        body = await _optional_object(request, max_request_bytes)
        params = body.get("parameters", {})
        if not isinstance(params, dict):
            raise InvalidRequest("'parameters' must be a JSON object")
        files = [k for k in params if k.startswith("file:")]
        if files:
            raise InvalidRequest(f"model files in a load request ({files}) are not supported; put them in the repository")
        config = params.get("config")
        if config is not None and not isinstance(config, (str, dict)):
            raise InvalidRequest("parameter 'config' must be the model config as a JSON string")
        await core.load(model_name, config)
        return Response(status_code=200)

    @app.post("/v2/repository/models/{model_name}/unload", openapi_extra=openapi.UNLOAD, responses=openapi.EMPTY)
    async def repository_unload(request: Request, model_name: str) -> Response:
        body = await _optional_object(request, max_request_bytes)
        if not isinstance(body.get("parameters", {}), dict):
            raise InvalidRequest("'parameters' must be a JSON object")
        await core.unload(model_name)
        return Response(status_code=200)

    return app
