"""Choosing each request's next token from its logits, on the logits' device.

Order (vLLM's): repetition / presence / frequency penalties, then greedy rows take the argmax; the
others divide by their temperature, drop tokens under min_p x the top probability, keep the top_k,
keep the smallest set whose probability reaches top_p, and sample by the exponential race
(argmax of p / q, q ~ Exp(1): a categorical draw with no cumulative sum to synchronise). A request
with a seed draws its q from its own generator, so what it samples does not depend on its batch.
Log-probabilities are of the raw model logits (before penalties and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.llm.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] fp32: log-probability of the chosen token
    top_ids: torch.Tensor | None = None  # [R, K] int64
    top_logprobs: torch.Tensor | None = None  # [R, K] fp32


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None):
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}  # request id -> its own, for seeded requests
        self.default_generator = torch.Generator(device=device)
        if seed is None:
            self.default_generator.seed()
        else:
            self.default_generator.manual_seed(seed)

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self.generators.get(request_id)
        if generator is None:
            generator = self.generators[request_id] = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        return generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                 histories: list[list[int]], num_prompt_tokens: list[int]) -> SamplerOutput:
        """logits: [R, V] fp32, one row per token to choose; histories[r]: the row's request's token ids so
        far (prompt then output; the output part is histories[r][num_prompt_tokens[r]:])."""
        device, rows = logits.device, len(params)
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max_logprobs is not None else None
        if any(p.needs_penalties for p in params):
            logits = self._penalize(logits.clone(), params, histories, num_prompt_tokens)
        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(logits, params, request_ids, greedy)
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if max_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(max_logprobs, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        greedy_ids = logits.argmax(dim=-1)
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
        logits = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        if any(top_k) or any(p.top_p < 1 for p in params):
            logits = self._top_k_top_p(logits, top_k, [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        unseeded = [r for r, p in enumerate(params) if p.seed is None]
        if unseeded:
            q[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=device).exponential_(
                generator=self.default_generator)
        for r, p in enumerate(params):
            if p.seed is not None:
                q[r].exponential_(generator=self._generator(request_ids[r], p.seed))
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=device), greedy_ids, sampled)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        device = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=device)[None, :]
        k = torch.tensor([k if k else vocab for k in top_k], device=device)
        drop = ranks >= k[:, None]  # top-k: ranks past k
        p = torch.tensor(top_p, device=device)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
        drop |= before >= p[:, None]  # top-p: tokens after the kept set reached p (the best always stays)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _penalize(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                  num_prompt_tokens: list[int]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        rows = len(params)
        width = max(len(h) for h in histories)
        padded = np.full((rows, width), vocab, dtype=np.int64)  # pad with an extra column, dropped below
        is_output = np.zeros((rows, width), dtype=np.float32)
        for r, (history, prompt) in enumerate(zip(histories, num_prompt_tokens)):
            padded[r, :len(history)] = history
            is_output[r, prompt:len(history)] = 1
        ids = torch.from_numpy(padded).to(device)
        seen = torch.zeros((rows, vocab + 1), device=device).scatter_(1, ids, 1.0)[:, :vocab] > 0
        counts = torch.zeros((rows, vocab + 1), device=device).scatter_add_(
            1, ids, torch.from_numpy(is_output).to(device))[:, :vocab]
        repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)  # seen anywhere: prompt or output (HF, vLLM)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        return logits - frequency * counts - presence * (counts > 0).float()
