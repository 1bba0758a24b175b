"""Tensor parallelism: one process per rank, each holding its slice of every layer (parallel.py says
how the layers split) and of the KV cache's heads.

Rank 0 runs the engine (scheduler, block manager, sampler) in the caller's process; ranks 1.. are
worker processes that build the same model slice and cache and then, every step, receive the scheduled
batch from rank 0 (broadcast) and run the same forward, joining its all-reduces and the final
all-gather of the logits. Block ids are rank 0's decision; every rank's cache has the same blocks.
NCCL between GPUs (rank r on cuda:r), gloo on the CPU (tests).

executor="ray" places ranks 1.. as Ray actors instead of local processes, as vLLM does past one machine:
one actor per rank in a placement group (one GPU each, or one CPU without GPUs; "PACK" fills a node first,
spilling to others), rank 0 in the caller's process; the ranks meet at rank 0's node address. Ray is an
optional dependency, imported only here. An actor sees its one GPU as cuda:0 (Ray sets
CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.llm.config import EngineConfig, LLMError
from kiln.llm.engine import LLMEngine
from kiln.llm.parallel import TensorParallel
from kiln.llm.scheduler import SchedulerOutput

TIMEOUT = datetime.timedelta(seconds=300)  # a rank that died fails the others' collectives instead of hanging them


def _rank_config(config: EngineConfig, rank: int, local_device: int | None = None) -> tuple[EngineConfig, str]:
    use_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        index = rank if local_device is None else local_device
        torch.cuda.set_device(index)
        return dataclasses.replace(config, device=f"cuda:{index}"), "nccl"
    return dataclasses.replace(config, device="cpu"), "gloo"


def _worker(rank: int, size: int, init_method: str, model: str, config: EngineConfig,
            local_device: int | None = None) -> None:
    config, backend = _rank_config(config, rank, local_device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)
    try:
        runner = LLMEngine(model, config, tp=TensorParallel(rank, size)).runner
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            runner.forward(runner.prepare(box[0]))
    finally:
        dist.destroy_process_group()


class BroadcastingRunner:
    """Rank 0's runner: sends each step's batch to the workers, then runs its own share."""

    def __init__(self, runner):
        self.runner = runner

    def execute(self, output: SchedulerOutput):
        if not output.empty:
            dist.broadcast_object_list([output.scheduled], src=0)
        return self.runner.execute(output)

    def __getattr__(self, name):
        return getattr(self.runner, name)


class _RayWorkers:
    """Ranks 1.. as Ray actors in a placement group; each runs _worker until rank 0 broadcasts the end."""

    def __init__(self, size: int, model: str, config: EngineConfig, gpus: bool):
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise LLMError("executor='ray' needs Ray: pip install 'ray[default]'") from e
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        self.ray = ray
        bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        self.group = placement_group([bundle] * (size - 1), strategy="PACK")
        ray.get(self.group.ready(), timeout=120)
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self.init_method = f"tcp://{host}:{port}"

        @ray.remote
        class Rank:
            def run(self, rank, size, init_method, model, config, local_device):
                _worker(rank, size, init_method, model, config, local_device)

        self.actors = [Rank.options(num_cpus=1, num_gpus=1 if gpus else 0, scheduling_strategy=
                                    PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                                     placement_group_bundle_index=rank - 1)).remote()
                       for rank in range(1, size)]
        self.runs = [actor.run.remote(rank, size, self.init_method, model, config, 0 if gpus else None)
                     for rank, actor in zip(range(1, size), self.actors)]

    def join(self) -> None:
        try:
            self.ray.get(self.runs, timeout=60)
        except Exception:  # noqa: BLE001  a rank that failed or hung: its actor is killed below either way
            pass
        for actor in self.actors:
            self.ray.kill(actor)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        self.actors, self.runs = [], []


class TensorParallelGroup:
    def __init__(self, model: str | Path, config: EngineConfig, size: int, executor: str = "mp"):
        if size < 2:
            raise LLMError(f"tensor_parallel must be >= 2 here, got {size}")
        if executor not in ("mp", "ray"):
            raise LLMError(f"executor {executor!r}: expected mp (local processes) or ray")
        if dist.is_initialized():
            raise LLMError("a torch.distributed process group is already running in this process")
        gpus = torch.cuda.is_available() and config.device != "cpu"
        if executor == "mp" and gpus and torch.cuda.device_count() < size:
            raise LLMError(f"tensor_parallel {size} needs {size} GPUs, {torch.cuda.device_count()} visible")
        self.workers, self.ray_workers = [], None
        if executor == "ray":
            self.ray_workers = _RayWorkers(size, str(model), config, gpus)
            init_method = self.ray_workers.init_method
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_method = f"tcp://127.0.0.1:{port}"
            context = multiprocessing.get_context("spawn")
            self.workers = [context.Process(target=_worker, args=(rank, size, init_method, str(model), config),
                                            name=f"kiln-llm-tp{rank}", daemon=True) for rank in range(1, size)]
            for worker in self.workers:
                worker.start()
        config, backend = _rank_config(config, 0, 0 if executor == "ray" else None)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=size, timeout=TIMEOUT)
        try:
            self.engine = LLMEngine(model, config, tp=TensorParallel(0, size))
        except BaseException:
            self.close()
            raise
        self.engine.runner = BroadcastingRunner(self.engine.runner)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0)
            finally:
                dist.destroy_process_group()
        for worker in self.workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
        self.workers = []
        if self.ray_workers is not None:
            self.ray_workers.join()
            self.ray_workers = None

