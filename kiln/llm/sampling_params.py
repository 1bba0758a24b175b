"""SamplingParams: how one request's tokens are chosen and when it stops (plain Python, no torch).

The fields and their meaning follow vLLM's SamplingParams, which the OpenAI server maps onto:
temperature 0 is greedy; top_k 0 or -1, top_p 1 and min_p 0 switch those filters off; a seed gives
the request its own generator, so its samples do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.llm.config import LLMError


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt (the server's `n`; LLM.generate submits n requests)
    max_tokens: int | None = 16  # None: up to the model's length limit
    min_tokens: int = 0  # EOS and stop tokens are ignored before this many tokens
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: seen tokens' positive logits / p, negative ones * p
    presence_penalty: float = 0.0  # OpenAI: - p for each token already generated
    frequency_penalty: float = 0.0  # OpenAI: - p * count of each token generated
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (not part of the output)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # also return the sampled token's log-probability and this many top ones
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            problems.append(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if self.stop and not self.detokenize:
            problems.append("stop strings need detokenize=True (they are matched in the text)")
        if problems:
            raise LLMError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
