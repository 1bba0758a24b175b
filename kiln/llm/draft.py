"""Speculative decoding's second proposer: a smaller draft model of the same vocabulary.

For each greedy request in decode, the draft model proposes k tokens by its own greedy decoding; the target
model verifies them all in its next step (kiln/llm/engine.py, as the n-gram drafts are verified) and keeps the
ones its own greedy choice agrees with, plus its next token: the output is exactly the target's greedy decoding,
in fewer target steps the more often the draft agrees.

The draft keeps its own paged KV cache (its own budget, blocks of the target's size). Per request it remembers
which tokens its cache holds; at the next proposal the longest prefix of those that the request still has (the
accepted drafts, and everything before) is kept, and only the rest is computed: the new target token, and the
drafts the target rejected are recomputed with the tokens that replaced them. All requests of a step are
proposed together: one draft step computes every request's missing tokens (a prefill-like chunk each), then
k - 1 batched decode steps. A request the draft cache has no room for gets no drafts that step (it decodes as
without speculation); a finished request's blocks are freed at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.llm.config import LLMError, ModelConfig
from kiln.llm.kv_cache import KVCacheSpec, allocate_kv_cache
from kiln.llm.model_runner import ModelRunner
from kiln.llm.models import build_model, default_dtype
from kiln.llm.request import Request
from kiln.llm.scheduler import ScheduledRequest
from kiln.llm.weights import iterate_weights

log = logging.getLogger("kiln.llm")


@dataclass
class _Sequence:
    """What the draft's cache holds for one request: the tokens at positions 0.. and their blocks."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(self, path: str | Path, *, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                 kv_dtype: torch.dtype, max_model_len: int, block_size: int, kv_cache_bytes: int, attention_backend: str):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise LLMError(f"speculative_model {str(path)!r}: no config.json there (a Hugging Face-format folder)")
        self.model_config = config = ModelConfig.from_folder(self.path)
        if config.vocab_size != target.vocab_size:
            raise LLMError(f"speculative_model {self.path.name}: its vocabulary has {config.vocab_size} tokens, the "
                           f"target's {target.vocab_size}: a draft must share the target's tokenizer")
        if config.max_position_embeddings < max_model_len:
            raise LLMError(f"speculative_model {self.path.name}: max_position_embeddings "
                           f"{config.max_position_embeddings} is shorter than max_model_len {max_model_len}")
        with torch.device(device), default_dtype(dtype):
            self.model = build_model(config, max_model_len)
        self.model.load_weights(iterate_weights(self.path), source=str(self.path))
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, block_size, kv_dtype)
        num_blocks = spec.blocks_for_budget(kv_cache_bytes)
        self.kv_caches = allocate_kv_cache(spec, num_blocks, device)
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block padded tables point at
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, device, config.vocab_size,
                                  attention_backend, None, max_model_len=max_model_len, cuda_graphs=False)
        self.sequences: dict[str, _Sequence] = {}
        log.info("kiln llm: draft model %s (%s), %d KV blocks", self.path.name, config.model_type, num_blocks)

    def forget(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.free.extend(reversed(sequence.blocks))

    def _reserve(self, sequence: _Sequence, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(sequence.blocks)
        if needed > len(self.free):
            return False
        sequence.blocks.extend(self.free.pop() for _ in range(max(needed, 0)))
        return True

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """{request id: up to k draft tokens} for (request, k) pairs; k >= 1."""
        steps: list[tuple[Request, _Sequence, int]] = []
        first: list[ScheduledRequest] = []
        for request, k in wanted:
            tokens = request.token_ids
            sequence = self.sequences.setdefault(request.request_id, _Sequence())
            keep = 0
            for have, now in zip(sequence.tokens, tokens[:-1]):  # the last token is always computed again
                if have != now:
                    break
                keep += 1
            if not self._reserve(sequence, len(tokens) + k - 1):
                self.forget(request.request_id)  # its blocks go to the requests that fit; it decodes undrafted
                continue
            sequence.tokens = list(tokens)
            steps.append((request, sequence, k))
            first.append(ScheduledRequest(request, tokens[keep:], keep, sequence.blocks))
        if not first:
            return {}
        drafts: dict[str, list[int]] = {request.request_id: [] for request, _, _ in steps}
        scheduled = first
        for step in range(max(k for _, _, k in steps)):
            inputs = self.runner.prepare(scheduled)
            chosen = self.runner.forward(inputs).argmax(dim=-1).tolist()  # one row per request, in inputs.order
            following = []
            by_id = {request.request_id: (request, sequence, k) for request, sequence, k in steps}
            for item, token in zip(inputs.order, chosen):
                request, sequence, k = by_id[item.request_id]
                drafts[request.request_id].append(token)
                if step + 1 < k:
                    position = len(sequence.tokens)
                    sequence.tokens.append(token)
                    following.append(ScheduledRequest(request, [token], position, sequence.blocks))
            if not following:
                break
            scheduled = following
        return drafts
