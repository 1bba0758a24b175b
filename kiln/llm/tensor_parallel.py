"""Tensor parallelism: one process per rank, each holding its slice of every layer (parallel.py says
how the layers split) and of the KV cache's heads.

Rank 0 runs the engine (scheduler, block manager, sampler) in the caller's process; ranks 1.. are
worker processes that build the same model slice and cache and then, every step, receive the scheduled
batch from rank 0 (broadcast) and run the same forward, joining its all-reduces and the final
all-gather of the logits. Block ids are rank 0's decision; every rank's cache has the same blocks.
NCCL between GPUs (rank r on cuda:r), gloo on the CPU (tests). Past one machine, the same workers
could be placed by Ray, as vLLM does: not written yet.
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


def _rank_config(config: EngineConfig, rank: int) -> tuple[EngineConfig, str]:
    use_cuda = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(rank)
        return dataclasses.replace(config, device=f"cuda:{rank}"), "nccl"
    return dataclasses.replace(config, device="cpu"), "gloo"


def _worker(rank: int, size: int, init_method: str, model: str, config: EngineConfig) -> None:
    config, backend = _rank_config(config, rank)
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


class TensorParallelGroup:
    def __init__(self, model: str | Path, config: EngineConfig, size: int):
        if size < 2:
            raise LLMError(f"tensor_parallel must be >= 2 here, got {size}")
        if dist.is_initialized():
            raise LLMError("a torch.distributed process group is already running in this process")
        if torch.cuda.is_available() and config.device != "cpu" and torch.cuda.device_count() < size:
            raise LLMError(f"tensor_parallel {size} needs {size} GPUs, {torch.cuda.device_count()} visible")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_method = f"tcp://127.0.0.1:{port}"
        context = multiprocessing.get_context("spawn")
        self.workers = [context.Process(target=_worker, args=(rank, size, init_method, str(model), config),
                                        name=f"kiln-llm-tp{rank}", daemon=True) for rank in range(1, size)]
        for worker in self.workers:
            worker.start()
        config, backend = _rank_config(config, 0)
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

