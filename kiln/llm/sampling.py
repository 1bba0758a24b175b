"""Choosing each request's next token from its logits, on the logits' device.

Order (vLLM's): repetition / presence / frequency penalties, then greedy rows take the argmax; the
others divide by their temperature, drop tokens under min_p x the top probability, keep the top_k,
keep the smallest set whose probability reaches top_p, and sample by the exponential race
(argmax of p / q, q ~ Exp(1): a categorical draw with no cumulative sum to synchronise).
Log-probabilities are of the raw model logits (before penalties and temperature).

The race's q is a counter-based draw, not a stateful generator: q = -log u with u a hash of (the
request's seed, the position of the token being chosen, the vocabulary index). So a request's sample
depends on its seed and position only: not on its batch, not on how many draws came before (a request
recomputed after preemption draws the same tokens again), and the same tensors computed inside a
captured CUDA graph give exactly what the eager step gives. Requests without a seed get one drawn from
the engine's generator (EngineConfig.seed) the first time they are sampled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from kiln.llm.sampling_params import SamplingParams

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) int64, without int64 overflow (two 16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int64 keys from each row's seed halves and the position of the token it chooses."""
    return mix32(mix32(mix32(seed_hi) ^ seed_lo) ^ (positions & MASK32))


def exponential_race(probs: torch.Tensor, keys: torch.Tensor, vocab_keys: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary of p / q, q = -log u, u = hash(row key, token) in (0, 1): [R] int64."""
    bits = mix32(keys[:, None] ^ vocab_keys[None, :]) >> 8  # 24 bits: exact in fp32
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return (probs / -torch.log(u)).argmax(dim=-1)


def split_seed(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & MASK32, seed >> 32


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] fp32: log-probability of the chosen token
    top_ids: torch.Tensor | None = None  # [R, K] int64
    top_logprobs: torch.Tensor | None = None  # [R, K] fp32


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, apply_min_p: bool = True, apply_top: bool = True) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p as tensors [R] (top_k = vocab, top_p >= 1, min_p = 0: off), so
    that a captured graph can run them with per-row values. Skipping a filter no row uses gives the same
    bits as applying it with its off value."""
    logits = logits / temperature[:, None]
    if apply_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if apply_top:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]  # top-k: ranks past k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
        # top-p: tokens after the kept set reached p (the best always stays); top_p >= 1 keeps all
        drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None):
        self.vocab_size = vocab_size
        self.device = device
        self.seeds: dict[str, int] = {}  # request id -> the seed drawn for a request without its own
        self.random = random.Random(seed)  # seed None: from the OS
        self.vocab_keys = mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9)

    def forget(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)

    def seed_of(self, request_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        seed = self.seeds.get(request_id)
        if seed is None:
            seed = self.seeds[request_id] = self.random.getrandbits(64)
        return seed

    def params_tensors(self, params: list[SamplingParams], request_ids: list[str],
                       positions: list[int]) -> dict[str, np.ndarray]:
        """The per-row sampling values as host arrays (what a captured graph's inputs are filled with)."""
        vocab = self.vocab_size
        seeds = [split_seed(self.seed_of(r, p)) if not p.greedy else (0, 0) for p, r in zip(params, request_ids)]
        return {"temperature": np.array([1.0 if p.greedy else p.temperature for p in params], dtype=np.float32),
                "min_p": np.array([p.min_p for p in params], dtype=np.float32),
                "top_k": np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=np.int64),
                "top_p": np.array([p.top_p for p in params], dtype=np.float32),
                "greedy": np.array([p.greedy for p in params], dtype=np.bool_),
                "seed_lo": np.array([s[0] for s in seeds], dtype=np.int64),
                "seed_hi": np.array([s[1] for s in seeds], dtype=np.int64),
                "positions": np.asarray(positions, dtype=np.int64)}

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                 histories: list[list[int]], num_prompt_tokens: list[int],
                 positions: list[int] | None = None) -> SamplerOutput:
        """logits: [R, V] fp32, one row per token to choose; histories[r]: the row's request's token ids so
        far (prompt then output; the output part is histories[r][num_prompt_tokens[r]:]); positions[r]: the
        position of the token row r chooses (default len(histories[r]), one row per request)."""
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max_logprobs is not None else None
        if any(p.needs_penalties for p in params):
            logits = self._penalize(logits.clone(), params, histories, num_prompt_tokens)
        if all(p.greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            if positions is None:
                positions = [len(h) for h in histories]
            host = self.params_tensors(params, request_ids, positions)
            t = {k: torch.from_numpy(v).to(logits.device) for k, v in host.items()}
            token_ids = self.sample(logits, t, apply_min_p=any(p.min_p > 0 for p in params),
                                    apply_top=bool((host["top_k"] < self.vocab_size).any() or (host["top_p"] < 1).any()))
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if max_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(max_logprobs, dim=-1)
        return out

    def logprobs_only(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]) -> SamplerOutput:
        """The log-probabilities of tokens chosen elsewhere (by a captured graph)."""
        out = SamplerOutput(token_ids=torch.tensor(token_ids, device=logits.device))
        max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if max_logprobs is not None:
            raw = torch.log_softmax(logits, dim=-1)
            out.logprobs = raw.gather(1, out.token_ids[:, None]).squeeze(1)
            if max_logprobs > 0:
                out.top_logprobs, out.top_ids = raw.topk(max_logprobs, dim=-1)
        return out

    def sample(self, logits: torch.Tensor, t: dict[str, torch.Tensor], apply_min_p: bool = True,
               apply_top: bool = True) -> torch.Tensor:
        """Device-only sampling from per-row tensors (params_tensors' keys): what the eager step runs and
        what kiln/llm/cuda_graphs.py captures."""
        greedy_ids = logits.argmax(dim=-1)
        filtered = filter_logits(logits, t["temperature"], t["min_p"], t["top_k"], t["top_p"], apply_min_p, apply_top)
        keys = row_keys(t["seed_lo"], t["seed_hi"], t["positions"])
        sampled = exponential_race(torch.softmax(filtered, dim=-1), keys, self.vocab_keys)
        return torch.where(t["greedy"], greedy_ids, sampled)

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
