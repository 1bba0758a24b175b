"""What a request gives back, step by step: text and token ids (cumulative and the step's delta),
log-probabilities, why it finished, and its timings. Plain data (the server serialises it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.llm.model_runner import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything so far (stop strings cut off)
    token_ids: list[int]
    delta_text: str = ""  # what this step added (held back while it could still become a stop string)
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it (None for EOS)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    metrics: RequestMetrics | None = None
