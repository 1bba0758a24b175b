"""kiln serve past one machine: a model repository as Ray Serve deployments.

    kiln serve --ray models/ [--replicas 2 | --autoscale 1-4]     # the CLI (kiln/cli/serve.py)
    serve.run(kiln.serve.ray.deployment("models/"), route_prefix="/")
    serve run kiln.serve.ray:build repository=models/ replicas=2  # Ray Serve's application builder

One deployment per model, whose replicas each hold the model's engines (loaded with kiln serve's
repository code) and run inferences through kiln serve's dynamic batcher; one ingress deployment
serving kiln serve's own HTTP routes (KServe v2 with Triton's extensions), so tritonclient.http
works against Ray Serve's proxy unchanged. docs/serving.md ("Past one machine: Ray Serve").

    replica.py   the per-model deployment: a ServerCore of one model, its answers tagged with the replica
    ingress.py   RayCore (ServerCore over deployment handles, retrying a request whose replica died)
                 and the ingress deployment running kiln serve's FastAPI app over it
    app.py       options, each model's deployment options from its config, the application, `run`

Requires the `ray` extra (ray[serve]); nothing else of kiln imports this package.
"""

from kiln.serve.ray.app import (
    RayOptions,
    ReplicaOptions,
    build,
    deployment,
    deployment_options,
    run,
)

__all__ = ["RayOptions", "ReplicaOptions", "build", "deployment", "deployment_options", "run"]
