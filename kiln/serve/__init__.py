"""kiln serve: a Triton Inference Server-compatible model server for kiln engines.

    kiln serve MODEL_REPOSITORY          # <repo>/<model>/<version>/model.kiln | model.onnx
    kiln serve --model model.onnx        # one model, its config inferred from the engine

HTTP (KServe v2 + Triton's extensions, FastAPI), gRPC (Triton's GRPCInferenceService; kiln's own HTTP/2
transport, or grpc.aio),
dynamic batching over several execution contexts per engine, Prometheus /metrics with Triton's
names. `tritonclient` works against it unchanged. docs/serving.md is the user's guide.

    repository.py  the model repository on disk; model.onnx built and cached on first load
    config.py      Triton's model config (subset): read, completed from the engine, checked
    batcher.py     per model: bounded queue, dynamic batching, instances (execution contexts)
    core.py        models and their states, validation, inference: what both frontends call
    http_codec.py, http_server.py, openapi.py   the HTTP frontend
    grpc_server.py the gRPC frontend: the servicer and its method handlers, grpc.aio's server
    grpc_h2.py, grpc_call.py, eager.py   kiln's own gRPC transport (the default): calls over h2_connection.py
                   (HTTP/2 on the event loop), h2_frames.py, h2_keepalive.py
    stats.py, metrics.py   Triton's statistics and Prometheus metrics
    server.py      the process: frontends + core on one event loop; graceful shutdown
    options.py     ServeOptions; frontdoors.py: the HTTP, gRPC and metrics ports of a process
    frontends.py, frontend_process.py, ipc.py   --frontends N: HTTP and gRPC in N processes, the
                   batchers in this one, requests and answers over a Unix socket
    perf.py        the load generator behind `kiln perf` (perf_analyzer-like)

Requires the `serve` extra (fastapi, uvicorn, grpcio, hpack, tritonclient's protocol stubs).
"""

from kiln.serve.server import ServeOptions, Server, ServerThread

__all__ = ["ServeOptions", "Server", "ServerThread"]
