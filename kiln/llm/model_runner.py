"""One model step: scheduled requests in, accepted tokens out.

`prepare` flattens the step's requests into one batch (decodes first, for the decode kernel) and
builds the attention metadata; `forward` runs the model and returns fp32 logits for the rows that
choose a token (each sampled request's last row, and one row per draft token); `execute` samples
and verifies drafts. Everything the step needs arrives in the SchedulerOutput: the runner holds no
request state but the seeds it drew for requests without one.

The tensors `prepare` builds are the step's only inputs, so with `cuda_graphs` a decode-only step
replays the graph captured for its batch-size bucket instead (kiln/llm/cuda_graphs.py), with the same
values copied into static buffers; prefill and mixed steps run eagerly.

`launch` runs a decode step through the graphs without waiting for its tokens (async scheduling:
the engine plans the next step meanwhile); `LaunchedStep.result()` waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kiln.llm.attention import AttentionMetadata, prefill_tiles
from kiln.llm.cuda_graphs import DecodeGraphs, LaunchedDecode
from kiln.llm.sampling import Sampler
from kiln.llm.scheduler import PLACEHOLDER, ScheduledRequest, SchedulerOutput


@dataclass
class StepInputs:
    order: list[ScheduledRequest]  # the requests in batch order (decodes first)
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [R] int64: rows of the batch whose logits are needed
    row_owner: list[int]  # [R]: index into order of each logits row
    row_positions: list[int] = field(default_factory=list)  # [R]: the position of the token each row chooses


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens, best first


@dataclass
class StepResult:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # request id -> accepted tokens
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # for requests that asked
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0


@dataclass
class LaunchedStep:
    """A decode step running on the device; its tokens are read back by `result()`."""

    request_ids: list[str]  # batch order
    decode: LaunchedDecode

    def result(self) -> StepResult:
        return StepResult(sampled={i: [t] for i, t in zip(self.request_ids, self.decode.token_ids())})


class ModelRunner:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, vocab_size: int, attention_backend: str = "torch", seed: int | None = None,
                 max_model_len: int | None = None, cuda_graphs: bool = False, max_num_seqs: int = 64,
                 prefill_attention: str = "triton"):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attention_backend = attention_backend
        self.prefill_attention = prefill_attention  # triton | flash (whole prompts): kiln/llm/attention.py
        self.sampler = Sampler(vocab_size, device, seed)
        # the decode kernel's grid from max_model_len, not from the batch: the same bits eager or graphed
        self.max_seq_len = -(-max_model_len // block_size) * block_size if max_model_len else None
        self.graphs = None
        self.num_graph_steps = 0  # decode steps that replayed a graph (tests, bench)
        if cuda_graphs:
            if device.type != "cuda" or attention_backend != "triton" or max_model_len is None:
                raise ValueError("CUDA graphs need a CUDA device, the triton attention backend and max_model_len")
            self.graphs = DecodeGraphs(model, kv_caches, self.sampler, block_size, max_model_len, max_num_seqs, device)
            self.graphs.capture()

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        order = sorted(scheduled, key=lambda s: len(s.token_ids) != 1)  # decodes first (stable)
        size = self.block_size
        token_ids, positions, slots = [], [], []
        query_start, query_lens, seq_lens, rows, owners, row_positions = [], [], [], [], [], []
        max_blocks = max(len(s.block_ids) for s in order)
        tables = np.zeros((len(order), max_blocks), dtype=np.int32)  # padded with the null block
        start = 0
        for b, item in enumerate(order):
            n = len(item.token_ids)
            pos = np.arange(item.start_position, item.start_position + n)
            table = np.asarray(item.block_ids, dtype=np.int64)
            tables[b, :len(table)] = table
            token_ids.append(np.asarray(item.token_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // size] * size + pos % size)
            query_start.append(start)
            query_lens.append(n)
            seq_lens.append(item.start_position + n)
            if item.sample:
                first = start + n - 1 - item.num_draft_tokens
                rows.extend(range(first, start + n))
                owners.extend([b] * (item.num_draft_tokens + 1))
                row_positions.extend(range(item.start_position + first - start + 1, item.start_position + n + 1))
            start += n

        def device_tensor(parts):
            return torch.from_numpy(np.concatenate(parts)).to(self.device)

        meta = AttentionMetadata(
            slot_mapping=device_tensor(slots), query_start=query_start, query_lens=query_lens, seq_lens=seq_lens,
            block_tables=torch.from_numpy(tables).to(self.device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            num_decodes=sum(1 for n in query_lens if n == 1), backend=self.attention_backend,
            max_seq_len=self.max_seq_len, prefill_kernel=self.prefill_attention)
        if self.attention_backend == "triton":
            meta.query_start_tensor = torch.tensor(query_start, dtype=torch.int32, device=self.device)
            meta.query_lens_tensor = torch.tensor(query_lens, dtype=torch.int32, device=self.device)
            meta.prefill_tiles = prefill_tiles(query_lens, meta.num_decodes, self.device)
        return StepInputs(order=order, token_ids=device_tensor(token_ids), positions=device_tensor(positions),
                          meta=meta, logit_rows=torch.tensor(rows, dtype=torch.int64, device=self.device),
                          row_owner=owners, row_positions=row_positions)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """[R, vocab] fp32 logits of the rows that choose a token."""
        hidden = self.model(inputs.token_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logit_rows])

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        result = StepResult()
        if output.empty:
            return result
        scheduled = output.scheduled
        if (self.graphs is not None and len(scheduled) <= self.graphs.buckets[-1]
                and all(len(s.token_ids) == 1 and s.sample for s in scheduled)):
            return self._execute_graphed(scheduled)
        inputs = self.prepare(scheduled)
        if not inputs.row_owner:  # only prefill chunks: nothing to choose yet
            self.forward(inputs)
            return result
        logits = self.forward(inputs)
        owners = [inputs.order[b] for b in inputs.row_owner]
        return self._finish(inputs.order, owners, logits, inputs.row_positions)

    def can_launch(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether the step can run without waiting for its tokens: a decode of every request through the graphs
        (greedy or sampled on the device), no penalties (they read the token history) and no log-probabilities
        (the graph's logits are overwritten by the next replay)."""
        if self.graphs is None or not scheduled or len(scheduled) > self.graphs.buckets[-1]:
            return False
        if not all(len(s.token_ids) == 1 and s.sample for s in scheduled):
            return False
        distinct = {id(s.request.params): s.request.params for s in scheduled}.values()
        return all(not p.needs_penalties and p.logprobs is None for p in distinct)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], previous: LaunchedStep | None) -> LaunchedStep:
        """Replay the decode step without waiting for the GPU (can_launch must hold). Rows whose token is a
        PLACEHOLDER take it from `previous` (the step launched before, still unread): either every row or none."""
        ids = [s.request_id for s in scheduled]
        waiting = [s.token_ids[0] == PLACEHOLDER for s in scheduled]
        if previous is None:
            if any(waiting):
                raise RuntimeError("a decode row's token is still on the device, but no launched step holds it")
            sources = None
        else:
            if not all(waiting):
                raise RuntimeError("a step launched after another must take every row's token from it")
            rows = {request_id: row for row, request_id in enumerate(previous.request_ids)}
            sources = [rows[i] for i in ids]
        params = [s.request.params for s in scheduled]
        sampling = None if all(p.greedy for p in {id(p): p for p in params}.values()) else \
            self.sampler.params_tensors(params, ids, self._next_positions(scheduled))
        self.num_graph_steps += 1
        decode = self.graphs.launch(scheduled, previous.decode if previous is not None else None, sources, sampling)
        return LaunchedStep(ids, decode)

    def _finish(self, order: list[ScheduledRequest], owners: list[ScheduledRequest], logits: torch.Tensor,
                positions: list[int], token_ids: list[int] | None = None) -> StepResult:
        """Sample (unless token_ids came from a graph) and verify drafts."""
        result = StepResult()
        requests = [s.request for s in owners]
        if token_ids is None:
            # each row's history: the request's tokens, then the drafts before that row's position (what the
            # history is if they are accepted, so penalties judge a draft row as the plain step would)
            histories, seen = [], {}
            for s in owners:
                i = seen[s.request_id] = seen.get(s.request_id, -1) + 1
                drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens:] if s.num_draft_tokens else []
                histories.append(s.request.token_ids + drafts[:i] if i else s.request.token_ids)
            sampled = self.sampler(logits, [r.params for r in requests], [r.request_id for r in requests],
                                   histories, [r.num_prompt_tokens for r in requests], positions)
            token_ids = sampled.token_ids.tolist()
        else:
            sampled = self.sampler.logprobs_only(logits, [r.params for r in requests], token_ids)
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_logprobs = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        row = 0
        for item in order:
            if not item.sample:
                continue
            targets = token_ids[row:row + item.num_draft_tokens + 1]  # the model's choice after each position
            drafts = item.token_ids[len(item.token_ids) - item.num_draft_tokens:]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
                accepted += 1
            result.sampled[item.request_id] = targets[:accepted + 1]
            result.num_draft_tokens += len(drafts)
            result.num_accepted_drafts += accepted
            want = item.request.params.logprobs
            if want is not None:
                result.logprobs[item.request_id] = [
                    TokenLogprobs(targets[i], logprobs[row + i],
                                  list(zip(top_ids[row + i][:want], top_logprobs[row + i][:want])) if want else [])
                    for i in range(accepted + 1)]
            row += item.num_draft_tokens + 1
        return result

    def _execute_graphed(self, scheduled: list[ScheduledRequest]) -> StepResult:
        """A pure-decode step: replay the bucket's graphs; sample eagerly from the graph's logits only when a
        request needs penalties (its history) or log-probabilities."""
        self.num_graph_steps += 1
        requests = [s.request for s in scheduled]
        params = [r.params for r in requests]
        distinct = {id(p): p for p in params}.values()  # a batch often shares one SamplingParams
        n = len(scheduled)
        if any(p.needs_penalties for p in distinct):
            bucket, _ = self.graphs.run(scheduled, None)
            return self._finish(scheduled, scheduled, self.graphs.logits[bucket][:n], self._next_positions(scheduled))
        ids = [r.request_id for r in requests]
        sampling = None if all(p.greedy for p in distinct) else self.sampler.params_tensors(
            params, ids, self._next_positions(scheduled))
        bucket, tokens = self.graphs.run(scheduled, sampling)
        token_ids = tokens[:n].tolist()
        if any(p.logprobs is not None for p in distinct):
            return self._finish(scheduled, scheduled, self.graphs.logits[bucket][:n],
                                self._next_positions(scheduled), token_ids)
        return StepResult(sampled={i: [t] for i, t in zip(ids, token_ids)})

    @staticmethod
    def _next_positions(scheduled: list[ScheduledRequest]) -> list[int]:
        """The position of the token each decode row chooses."""
        return [s.start_position + 1 for s in scheduled]
