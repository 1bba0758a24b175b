"""What a kiln serve server is asked to do (ServeOptions): the engine process reads all of it, each
front-end process (`frontends`) its ports, host and limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.serve.config import BATCH_BUCKETS_DEFAULT, CUDA_SYNC_DEFAULT, WARM_UP_DEFAULT
from kiln.serve.core import DEFAULT_MAX_QUEUE_SIZE
from kiln.serve.grpc_options import GrpcOptions
from kiln.serve.http_server import DEFAULT_MAX_REQUEST_BYTES
from kiln.serve.repository import ModelRepository
from kiln.serve.staging import ARENA_BYTES, STAGE_MIN_BYTES

SWITCH_INTERVAL_US = 200


@dataclass
class ServeOptions:
    repository: str | Path | None = None  # a model repository folder
    model: str | Path | None = None  # or one .onnx/.kiln file
    model_name: str | None = None  # the single model's name (default: the file's stem)
    host: str = "127.0.0.1"
    http_port: int | None = 8000  # None: no HTTP; 0: a free port
    grpc_port: int | None = 8001
    # "kiln": kiln's own HTTP/2 transport on the event loop (kiln/serve/grpc_h2.py; ~5x less server CPU a call);
    # "grpcio": grpc.aio's server. Both serve the same method handlers (grpc_server.method_handlers).
    grpc_transport: str = "kiln"
    # TLS, mutual TLS, response compression, keepalive: tritonserver's --grpc-* flags, on either transport
    grpc: GrpcOptions = field(default_factory=GrpcOptions)
    metrics_port: int | None = 8002  # /metrics is also on the HTTP port
    load_models: list[str] | None = None  # explicit model control: load only these at start ([]: none)
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE  # per model, where its config sets none
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # CPU instances' warm-up at load, where a model's config sets no warm_up parameter: "true" | "false" | seconds
    # (the most one instance's warm-up takes; "true": WARM_UP_DEFAULT); the model is ready only after it
    warm_up: str = WARM_UP_DEFAULT
    # how CUDA instances wait for their streams, where a model's config sets no cuda_sync parameter: "spin" | "pinned" |
    # "blocking" | "staged" (kiln/serve/instances.py)
    cuda_sync: str = CUDA_SYNC_DEFAULT
    # a bucketed (CUDA) instance's batch buckets, where a model's config sets no batch_buckets parameter: "pow2" |
    # "half" (also 12, 24, 48, ...: kiln/runtime/buckets.py)
    batch_buckets: str = BATCH_BUCKETS_DEFAULT
    shutdown_timeout: float = 30.0  # seconds for requests in flight to finish at shutdown
    log_level: str = "warning"
    # Python's GIL switch interval while serving (None: leave Python's 5 ms). An instance's thread gives the
    # GIL up inside its engine call (a stream sync, a copy, a native segment) and then waits for it behind
    # the event loop, which parses requests without pause under load: up to one interval per give-up. On the
    # H200 (commit 6c09b4d) MobileNetV2 calls of 14 requests took 12.7 ms for ~1 ms of GPU work; a thread
    # with four 0.2-ms GIL-free waits beside a busy one took 22-48 ms at 5 ms, 2.4-3.6 ms at 200 us.
    switch_interval_us: int | None = SWITCH_INTERVAL_US
    # front-end processes (kiln/serve/frontends.py): 0 serves HTTP and gRPC on this process's event loop; N runs
    # them in N processes on the same ports (SO_REUSEPORT), which decode and encode and send the tensors here,
    # where the models, batchers and instances stay (one CUDA context). Past one event loop's ~1 ms per request.
    frontends: int = 0
    # per front end, bytes of shared memory its input tensors of staging_min_bytes or more reach the engine through
    # (kiln/serve/staging.py), not the engine's socket; 0: every tensor over the socket
    staging_bytes: int = ARENA_BYTES
    staging_min_bytes: int = STAGE_MIN_BYTES


def repository_of(options: ServeOptions) -> ModelRepository:
    """The model repository the options name: a folder, or one model file."""
    if (options.repository is None) == (options.model is None):
        raise ValueError("serve a model repository or one model file (one of repository=, model=)")
    if options.repository is not None:
        return ModelRepository(options.repository)
    return ModelRepository.single(options.model, options.model_name)
