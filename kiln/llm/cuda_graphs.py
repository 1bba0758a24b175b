"""The decode step captured as CUDA graphs, one per batch-size bucket, replayed for pure-decode steps.

A decode step of an 8B model is ~300 kernel launches; at batch 1 the GPU needs ~4 ms for its weight
reads and the launches alone take about as long from Python. Capturing the step makes it one launch.
What a step depends on is in static buffers sized for the largest bucket, filled on the host and
copied in before each replay: token ids, positions, slot mapping, block tables (full width:
max_model_len / block_size), sequence lengths, and the sampling values per row. A batch of n requests
runs in the smallest bucket >= n (1, 2, 4, 8, ... max_num_seqs); rows past n are padding: token 0 at
position 0, writing its K/V into slot 0 of the null block 0 (which no request ever reads) and
attending over that one key.

Per bucket b two graphs share one memory pool (captured largest first, so smaller buckets reuse the
pool's blocks): the forward (embedding -> layers with paged decode attention -> logits -> the greedy
argmax) and sampling on the device (temperature, min-p, top-k, top-p, the counter-based exponential
race of kiln/llm/sampling.py, with per-row seeds). They run the same torch code the eager step runs,
and the decode kernel's grid is max_model_len's in both, so a replay gives the eager step's tokens.
Steps with penalties or log-probabilities replay the forward, then sample eagerly from its logits.
Prefill and mixed steps run eagerly. The pool's size is measured at capture (`memory_bytes`).

`launch` is the replay for async scheduling: nothing waits for the GPU. The step's token ids for rows whose
token the previous launch sampled are gathered on the device from that launch's output (the host never saw
them); the sampled ids go back by an asynchronous copy into pinned memory (two slots: one step's tokens are
read while the next step's copy is queued) and an event says when they are there. The host's staging buffers
are pinned and copied without waiting, so before they are filled again the previous launch's copies must
have been read: an event recorded after them is waited on (by then the GPU is a step past them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kiln.llm.attention import AttentionMetadata
from kiln.llm.sampling import Sampler

log = logging.getLogger("kiln.llm")


@dataclass
class LaunchedDecode:
    """A decode step replayed without waiting: its sampled ids on the device and, once `event` has passed, in
    pinned host memory."""

    tokens: torch.Tensor  # [bucket] int64 on the device: the next launch gathers its input ids from here
    host: torch.Tensor  # [n] int64, pinned
    event: torch.cuda.Event | None  # None on the CPU (the copy was synchronous)

    def token_ids(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


SAMPLING_FIELDS = ("temperature", "min_p", "top_k", "top_p", "greedy", "seed_lo", "seed_hi", "positions")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch (max_batch itself last when it is not a power of two)."""
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, sampler: Sampler, block_size: int, max_model_len: int,
                 max_batch: int, device: torch.device):
        self.model, self.kv_caches, self.sampler = model, kv_caches, sampler
        self.device = device
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)  # block-table columns
        self.max_seq_len = self.width * block_size
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        # host staging (pinned: copies overlap nothing, but skip a bounce buffer) and device buffers
        pin = device.type == "cuda"
        self.host_ints = torch.zeros((4, n), dtype=torch.int64, pin_memory=pin)  # ids, positions, slots, seq lens
        self.host_tables = torch.zeros((n, self.width), dtype=torch.int32, pin_memory=pin)
        self.table_rows: list[list[int]] = [[0] for _ in range(n)]  # the blocks each host_tables row holds
        self.ints = torch.zeros((4, n), dtype=torch.int64, device=device)
        self.ints[3] = 1
        self.tables = torch.zeros((n, self.width), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.sampling = {k: torch.zeros(n, dtype=torch.bool if k == "greedy" else
                                        torch.float32 if k in ("temperature", "min_p", "top_p") else torch.int64,
                                        device=device) for k in SAMPLING_FIELDS}
        self.sampling["temperature"].fill_(1.0)
        self.sampling["top_k"].fill_(sampler.vocab_size)
        self.sampling["top_p"].fill_(1.0)
        # async scheduling (launch): source rows of the previous launch's tokens, the sampled ids' way back
        self.host_sources = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.sources = torch.zeros(n, dtype=torch.int64, device=device)
        self.host_tokens = torch.zeros((2, n), dtype=torch.int64, pin_memory=pin)
        self.host_sampling = {k: torch.zeros(n, dtype=v.dtype, pin_memory=pin) for k, v in self.sampling.items()}
        self.num_launches = 0
        self.staged_event = None  # recorded after the last launch's copies from the staging buffers
        self.forward_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy_ids: dict[int, torch.Tensor] = {}
        self.sampled_ids: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(slot_mapping=self.ints[2, :b], query_start=list(range(b)), query_lens=[1] * b,
                                 seq_lens=[1] * b, block_tables=self.tables[:b], seq_lens_tensor=self.seq_lens[:b],
                                 num_decodes=b, backend="triton", max_seq_len=self.max_seq_len)
        hidden = self.model(self.ints[0, :b], self.ints[1, :b], self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _sample(self, b: int) -> torch.Tensor:
        t = {k: v[:b] for k, v in self.sampling.items()}
        return self.sampler.sample(self.logits[b], t)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so that the difference below is the graphs' pool and outputs alone
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm up off the capture (Triton compiles, cuBLAS picks kernels)
                for _ in range(2):
                    logits, _ = self._forward(b)
                    self.logits[b] = logits
                    self._sample(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[b], self.greedy_ids[b] = self._forward(b)
            self.forward_graphs[b] = graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.sampled_ids[b] = self._sample(b)
            self.sample_graphs[b] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' blocks outside the pool
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - started
        log.info("kiln llm: decode captured as CUDA graphs for batch sizes %s in %.1f s, %.1f MiB of graph memory",
                 self.buckets, self.capture_seconds, self.memory_bytes / 2**20)

    def time_replay(self, batch: int, repeats: int = 20) -> float:
        """Milliseconds of GPU time per replay of the forward graph holding `batch` rows (CUDA events)."""
        graph = self.forward_graphs[self.bucket(batch)]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    def stage(self, items) -> int:
        """Fill the host staging buffers for the step's decode requests (ScheduledRequest, one token each) and
        return the bucket. Block-table rows are kept between steps: a row whose blocks still begin with what it
        holds gets only its new blocks (one every block_size steps), so a steady batch writes almost nothing.
        Columns past a row's own blocks may hold another request's old ids: the decode kernel reads a row only
        up to its sequence length, and padding rows keep column 0 the null block."""
        n = len(items)
        b = self.bucket(n)
        ints, tables, size = self.host_ints.numpy(), self.host_tables.numpy(), self.block_size
        rows = self.table_rows
        for i, item in enumerate(items):
            blocks, held = item.block_ids, rows[i]
            if blocks != held:
                if blocks[:len(held)] == held:
                    tables[i, len(held):len(blocks)] = blocks[len(held):]
                else:
                    tables[i, :len(blocks)] = blocks
                rows[i] = list(blocks)
        for i in range(n, b):  # padding: token 0 at position 0 in slot 0 of the null block, one key
            if rows[i] != [0]:
                tables[i, 0] = 0
                rows[i] = [0]
        positions = np.fromiter((item.start_position for item in items), np.int64, n)
        ints[0, :n] = np.fromiter((item.token_ids[0] for item in items), np.int64, n)
        ints[1, :n] = positions
        ints[2, :n] = tables[np.arange(n), positions // size].astype(np.int64) * size + positions % size
        ints[3, :n] = positions + 1
        ints[:, n:b] = 0
        ints[3, n:b] = 1
        return b

    def run(self, items, sampling: dict[str, np.ndarray] | None) -> tuple[int, torch.Tensor]:
        """items: the step's decode requests (ScheduledRequest, one token each). Replays the bucket's forward
        and, with `sampling` (Sampler.params_tensors of the rows), its sampling graph. Returns (bucket,
        token ids [bucket] on the device: greedy when sampling is None)."""
        n = len(items)
        self._wait_staged()
        b = self.stage(items)
        self._copy_staged(b)
        self.seq_lens[:b].copy_(self.ints[3, :b])
        self.forward_graphs[b].replay()
        if sampling is None:
            return b, self.greedy_ids[b]
        for key, values in sampling.items():
            target = self.sampling[key]
            target[:n].copy_(torch.from_numpy(values), non_blocking=False)
        self.sample_graphs[b].replay()
        return b, self.sampled_ids[b]

    def launch(self, items, previous: LaunchedDecode | None = None, sources: list[int] | None = None,
               sampling: dict[str, np.ndarray] | None = None) -> LaunchedDecode:
        """Replay the decode step of `items` without waiting for the GPU (async scheduling): greedy, or with
        `sampling` (Sampler.params_tensors of the rows) through the sampling graph.

        previous: the last launch, whose sampled ids are every row's input token: row i's is
        previous.tokens[sources[i]]."""
        n = len(items)
        self._wait_staged()
        b = self.stage(items)
        if previous is not None:
            self.host_sources.numpy()[:n] = sources
        for key, values in (sampling or {}).items():
            self.host_sampling[key].numpy()[:n] = values
        self._copy_staged(b)
        for key in sampling or ():
            self.sampling[key][:n].copy_(self.host_sampling[key][:n], non_blocking=True)
        if previous is not None:
            self.sources[:n].copy_(self.host_sources[:n], non_blocking=True)
            torch.index_select(previous.tokens, 0, self.sources[:n], out=self.ints[0, :n])  # ids [n], on the device
        staged = self._record()
        self.seq_lens[:b].copy_(self.ints[3, :b])
        self.forward_graphs[b].replay()
        if sampling is not None:
            self.sample_graphs[b].replay()
        tokens = self.greedy_ids[b] if sampling is None else self.sampled_ids[b]
        host = self.host_tokens[self.num_launches % 2, :n]
        self.num_launches += 1
        host.copy_(tokens[:n], non_blocking=True)
        self.staged_event = staged
        return LaunchedDecode(tokens, host, self._record())

    def _copy_staged(self, b: int) -> None:
        """The staged ids, positions, slots, lengths (all columns: [4, bucket] of [4, max] is strided, and torch
        copies a strided pinned tensor through a pageable contiguous one, which CUDA may copy synchronously)
        and the bucket's block-table rows, without waiting."""
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.tables[:b].copy_(self.host_tables[:b], non_blocking=True)

    def _wait_staged(self) -> None:
        """The last launch's copies have read the pinned staging buffers (before they are filled again)."""
        if self.staged_event is not None:
            self.staged_event.synchronize()
            self.staged_event = None

    def _record(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event
