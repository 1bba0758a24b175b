"""A request as the scheduler and block manager see it: token ids and counters, no tensors.

One list holds the prompt and then each generated token (`token_ids`); `num_computed_tokens` says
how many of them have their K/V in the cache. Every step computes the next slice of the list, so a
first prefill, a chunk of a long prompt, a decode, a prompt partly found in the prefix cache and a
request recomputed after preemption are one code path.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kiln.llm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; recomputed when scheduled
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's length
    FINISHED_ABORTED = "abort"  # cancelled

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache when first scheduled (-1: not yet)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in the next step
    stop_reason: int | str | None = None  # the stop token id or string that finished it
    num_preemptions: int = 0
    # tokens sampled by launched steps that the host has not read yet (async scheduling: at most one between
    # engine steps, two while a step launches the next before reading the last); the scheduler gives them
    # positions, the runner takes their ids from the device, update() appends them
    num_inflight: int = 0

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[bytes] = []  # one per full block of token_ids, filled by the block manager

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
