"""The Ray ingress: kiln serve's HTTP frontend over the models' deployments.

The ingress runs kiln serve's own FastAPI app (kiln/serve/http_server.py: the same v2 routes,
JSON and binary tensors, the same errors and status codes) over RayCore, a ServerCore whose models
live in other deployments: metadata, config, readiness and the repository index come from each
model's description (asked of one replica at start: every replica loads the same files), and
`infer` sends the decoded request to the model's deployment through its handle.

A request whose replica dies while it is in flight (killed, out of memory, its node lost) is sent
again, up to `retries` times: inference is stateless, so a second run gives the answer the first
would have. Past that it is answered 503 with Retry-After, never lost and never another's.
Each inference response says where it was computed and how many sends it took, in the headers
`kiln-ray-node` (the Ray node id), `kiln-ray-replica` (the Serve replica's actor name) and
`kiln-ray-attempts`.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass

from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from kiln.serve.config import ModelConfig
from kiln.serve.core import InferRequest, InferResponse, ModelEntry, ServerCore
from kiln.serve.errors import QueueFull, ServeError, Unavailable
from kiln.serve.http_server import http_app
from kiln.serve.metrics import MetricsExporter
from kiln.serve.ray.replica import ModelDescription, ReplicaAnswer, ReplicaIdentity
from kiln.serve.repository import ModelRepository

log = logging.getLogger("kiln.serve.ray")

NODE_HEADER, REPLICA_HEADER, ATTEMPTS_HEADER = "kiln-ray-node", "kiln-ray-replica", "kiln-ray-attempts"


@dataclass
class Answered:
    """Who answered the HTTP request being handled: one per request, set by the middleware, filled by infer."""

    replica: ReplicaIdentity | None = None
    attempts: int = 0


ANSWERED: contextvars.ContextVar[Answered | None] = contextvars.ContextVar("kiln_ray_answered", default=None)


class NotUnderRay(ServeError):
    """A route of kiln serve that a Ray deployment does not serve (statistics, repository changes)."""

    http_status = 501
    grpc_code = "UNIMPLEMENTED"


@dataclass
class IngressOptions:
    retries: int = 2  # sends again of a request whose replica died with it in flight
    max_request_bytes: int = 64 << 20


@dataclass
class RemoteVersion:
    """A served version as the ingress knows it: what ServerCore's routes read of a ModelVersion."""

    name: str
    version: str
    config: ModelConfig
    described: dict

    def metadata(self, versions: list[str]) -> dict:
        return {**self.described, "versions": versions}


class RayCore(ServerCore):
    """ServerCore's frontend interface (what http_app calls) over Ray deployment handles."""

    def __init__(self, repository: ModelRepository, deployments: dict[str, DeploymentHandle], retries: int):
        super().__init__(repository)
        self.deployments = deployments
        self.retries = retries
        self.descriptions: dict[str, ModelDescription] = {}

    async def start(self, load: list[str] | None = None) -> None:
        for name, handle in self.deployments.items():
            described: ModelDescription = await handle.describe.remote()
            self.descriptions[name] = described
            versions = {v: RemoteVersion(name, v, d.config, d.metadata) for v, d in described.versions.items()}
            self.models[name] = ModelEntry(name, described.state, described.reason, versions)
        self.started = True

    async def infer(self, request: InferRequest) -> InferResponse:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        self.model(request.model, request.version)  # unknown or unavailable: 404/503 without a round trip
        handle = self.deployments[request.model]
        answered = ANSWERED.get() or Answered()
        for attempt in range(self.retries + 1):
            answered.attempts = attempt + 1
            try:
                answer: ReplicaAnswer = await handle.infer.remote(request)
            except (RayActorError, ReplicaUnavailableError) as e:  # the replica died with the request in flight
                if attempt == self.retries:
                    raise Unavailable(f"model {request.model!r}: the replica running the request died "
                                      f"{self.retries + 1} time(s) ({type(e).__name__}); retry later") from None
                log.warning("model %r: a replica died with request %r in flight (%s); sending it again",
                            request.model, request.id, type(e).__name__)
                continue
            except BackPressureError:
                raise QueueFull(f"model {request.model!r}: every replica's queue is full; retry later") from None
            except DeploymentUnavailableError as e:
                raise Unavailable(f"model {request.model!r}: its deployment is unavailable: {e}") from None
            except RayTaskError as e:  # a fault of the replica itself (kiln serve's 500)
                raise ServeError(f"model {request.model!r}: the replica failed: {e.cause!r}") from None
            answered.replica = answer.replica
            if answer.error is not None:
                raise answer.error
            return answer.response
        raise AssertionError("unreachable: the loop returns or raises")

    def statistics(self, name: str = "", version: str = "") -> list:
        raise NotUnderRay("statistics are kept by each replica under Ray Serve; read Ray Serve's metrics "
                          "(ray_serve_*) on the Ray metrics endpoint, or one replica's through the model's "
                          "deployment handle (statistics.remote())")

    async def load(self, name: str, config_json: str | dict | None = None) -> None:
        raise NotUnderRay("models are loaded by Ray Serve deployments; change the repository and run the "
                          "application again (serve.run or kiln serve --ray)")

    async def unload(self, name: str) -> None:
        raise NotUnderRay("models are unloaded by deleting their Ray Serve application (serve.delete)")

    async def close(self) -> None:
        self.accepting = False


class AnsweredByHeaders:
    """ASGI middleware: the node and replica that computed an inference, as response headers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answered = Answered()
        token = ANSWERED.set(answered)

        async def send_with_headers(message):
            if message["type"] == "http.response.start" and answered.attempts:
                headers = [*message.get("headers", []), (ATTEMPTS_HEADER.encode(), str(answered.attempts).encode())]
                if answered.replica is not None:
                    headers += [(NODE_HEADER.encode(), answered.replica.node_id.encode()),
                                (REPLICA_HEADER.encode(), answered.replica.replica_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            ANSWERED.reset(token)


@serve.ingress()
class Ingress:
    """The application's ingress deployment: kiln serve's HTTP routes at Ray Serve's proxy."""

    async def __init__(self, repository: ModelRepository, deployments: dict[str, DeploymentHandle],
                       options: IngressOptions):
        self.options = options
        self.core = RayCore(repository, deployments, options.retries)
        await self.core.start()

    def __serve_build_asgi_app__(self):
        # /metrics: the ingress machine's own gauges; per-model counters live in the replicas (Ray's metrics)
        app = http_app(self.core, MetricsExporter(list), self.options.max_request_bytes)
        app.add_middleware(AnsweredByHeaders)
        return app

    async def index(self) -> list[dict]:
        """The repository index (for `kiln serve --ray`'s start-up lines, through the app's handle)."""
        return self.core.index()

    async def replicas(self) -> dict[str, ReplicaIdentity | None]:
        """Which replica described each model at start (tests, debugging)."""
        return {name: d.replica for name, d in self.core.descriptions.items()}
