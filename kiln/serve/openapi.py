"""What the OpenAPI document says about the routes' bodies (handlers read raw requests, so FastAPI
cannot infer them): the v2 inference request, the repository calls, and each route's answers.
Fuzzers (schemathesis) generate requests from these schemas."""

from __future__ import annotations

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_ERRORS = {
    code: {"description": text, "content": {"application/json": {"schema": _ERROR}}}
    for code, text in [(400, "malformed request"), (404, "unknown model or version"), (413, "body too large"),
                       (429, "queue full (Retry-After)"), (503, "unavailable (Retry-After)")]
}

EMPTY = {200: {"description": "yes"}, **_ERRORS}
OBJECT = {200: {"description": "a JSON object", "content": {"application/json": {"schema": {"type": "object"}}}},
          **_ERRORS}
ARRAY = {200: {"description": "a JSON list", "content": {"application/json": {"schema": {"type": "array"}}}},
         **_ERRORS}
TEXT = {200: {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}}

_PARAMETERS = {"type": "object", "additionalProperties": True}
_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                                                "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES"]},
        "parameters": _PARAMETERS,
        "data": {"type": "array"},
    },
}
_OUTPUT = {"type": "object", "required": ["name"],
           "properties": {"name": {"type": "string"}, "parameters": _PARAMETERS}}
_INFER_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": _PARAMETERS,
        "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {"type": "array", "items": _OUTPUT},
    },
}


def _body(schema: dict, required: bool) -> dict:
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


INFER = _body(_INFER_REQUEST, True)
INFER_RESPONSES = {200: {"description": "the outputs (JSON, or JSON then binary tensors: Inference-Header-"
                                        "Content-Length)",
                         "content": {"application/json": {"schema": {"type": "object"}},
                                     "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                   **_ERRORS}
INDEX = _body({"type": "object", "properties": {"ready": {"type": "boolean"}}}, False)
LOAD = _body({"type": "object", "properties": {"parameters": {
    "type": "object", "properties": {"config": {"type": "string"}}, "additionalProperties": True}}}, False)
UNLOAD = _body({"type": "object", "properties": {"parameters": _PARAMETERS}}, False)
REGISTER = _body({"type": "object", "required": ["key", "byte_size"], "properties": {
    "key": {"type": "string"}, "offset": {"type": "integer", "minimum": 0},
    "byte_size": {"type": "integer", "minimum": 0}}}, True)
