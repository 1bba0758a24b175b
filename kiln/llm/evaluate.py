"""Perplexity of a text under an engine's model: how quantization's accuracy is reported (the
perplexity delta against the unquantized model on the same fixed text)."""

from __future__ import annotations

import math

import torch

from kiln.llm.config import LLMError
from kiln.llm.engine import LLMEngine
from kiln.llm.request import Request
from kiln.llm.scheduler import ScheduledRequest


@torch.inference_mode()
def token_logprobs(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """log p(token_i | tokens before it) for i >= 1, through the paged cache: [len - 1] fp32.
    Runs between steps (no request may be running: it borrows free blocks)."""
    if engine.has_unfinished():
        raise LLMError("perplexity needs an idle engine")
    if len(token_ids) > engine.max_model_len:
        raise LLMError(f"the text has {len(token_ids)} tokens; max_model_len is {engine.max_model_len}")
    request = Request("perplexity", list(token_ids))
    blocks = engine.block_manager
    budget = engine.config.max_num_batched_tokens
    rows = []
    try:
        for start in range(0, len(token_ids), budget):  # chunked like a long prefill
            chunk = token_ids[start:start + budget]
            if blocks.allocate_slots(request, len(chunk)) is None:
                raise LLMError("the KV cache is too small for this text")
            inputs = engine.runner.prepare([ScheduledRequest(request, chunk, start, blocks.block_ids("perplexity"))])
            inputs.logit_rows = torch.arange(len(chunk), device=engine.device)
            rows.append(torch.log_softmax(engine.runner.forward(inputs), dim=-1))
            request.num_computed_tokens += len(chunk)
    finally:
        blocks.free(request)
    logprobs = torch.cat(rows)[:-1]  # row i predicts token i + 1
    targets = torch.tensor(token_ids[1:], device=logprobs.device)
    return logprobs.gather(1, targets[:, None]).squeeze(1)


def perplexity(engine: LLMEngine, text: str | list[int]) -> float:
    token_ids = engine.encode(text) if isinstance(text, str) else list(text)
    return math.exp(-token_logprobs(engine, token_ids).mean().item())
