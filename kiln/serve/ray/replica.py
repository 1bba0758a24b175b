"""One model's Ray Serve deployment: each replica holds the model's engines and answers inferences.

A replica is kiln serve's own core for a repository of one model: it loads the model's served
versions with the repository code (kiln/serve/repository.py: model.onnx built and cached on first
load), runs them through kiln's dynamic batcher on the config's instances, and validates every
request exactly as kiln serve does. It speaks to the ingress in Python objects (InferRequest in,
ReplicaAnswer out), never in HTTP: decoding and encoding happen once, at the ingress.

A model that fails to load does not fail the deployment (Ray would retry the replica and then the
whole application): the replica stays up and describes the model as UNAVAILABLE with its reason,
as kiln serve's repository index does, while the other models serve.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ray
from ray import serve

from kiln.serve.config import ModelConfig
from kiln.serve.core import InferRequest, InferResponse, ServerCore
from kiln.serve.errors import ServeError
from kiln.serve.repository import ModelRepository


@dataclass(frozen=True)
class ReplicaIdentity:
    """Where an answer was computed: the Ray node, the Serve replica, the process."""

    node_id: str
    replica_id: str  # the replica's actor name (SERVE_REPLICA::app#deployment#id), for ray.get_actor(namespace="serve")
    pid: int


@dataclass
class VersionDescription:
    config: ModelConfig  # completed from the engine, as GET .../config shows it
    metadata: dict  # as GET /v2/models/{m}/versions/{v} shows it


@dataclass
class ModelDescription:
    """What the ingress needs to answer metadata, config, readiness and the index without a replica."""

    name: str
    state: str  # READY | UNAVAILABLE (Triton's repository states)
    reason: str
    versions: dict[str, VersionDescription] = field(default_factory=dict)
    replica: ReplicaIdentity | None = None


@dataclass
class ReplicaAnswer:
    """An inference's outcome: the response, or the kiln serve error it ended with (a 4xx/429/503
    the ingress answers as kiln serve would), and the replica that answered."""

    replica: ReplicaIdentity
    response: InferResponse | None = None
    error: ServeError | None = None


class ModelReplica:
    """The callable of a model's deployment (kiln/serve/ray/app.py wraps it with serve.deployment)."""

    async def __init__(self, repository: ModelRepository, name: str, max_queue_size: int):
        self.name = name
        self.core = ServerCore(repository, max_queue_size)
        await self.core.start([name])  # a model that fails to load is UNAVAILABLE with its reason
        self.identity = ReplicaIdentity(ray.get_runtime_context().get_node_id(),
                                        serve.get_replica_context().replica_id.to_full_id_str(), os.getpid())

    async def describe(self) -> ModelDescription:
        entry = self.core.models[self.name]
        versions = sorted(entry.versions, key=int)
        return ModelDescription(
            self.name, entry.state, entry.reason,
            {v: VersionDescription(entry.versions[v].config, entry.versions[v].metadata(versions)) for v in versions},
            self.identity)

    async def infer(self, request: InferRequest) -> ReplicaAnswer:
        try:
            response = await self.core.infer(request)
        except ServeError as e:
            return ReplicaAnswer(self.identity, error=e)
        return ReplicaAnswer(self.identity, response=response)

    async def statistics(self) -> tuple[ReplicaIdentity, list[dict]]:
        """This replica's Triton statistics of the model (the HTTP route cannot gather every replica's:
        a deployment handle reaches one replica per call)."""
        return self.identity, [s.to_json() for s in self.core.statistics()]

    async def __del__(self):
        """Ray Serve stops a replica once its ongoing requests are answered; the batcher then has
        nothing queued, and closing it ends its instances' threads."""
        await self.core.close()
