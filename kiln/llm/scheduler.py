"""In-flight batching: which tokens of which requests the next model step computes (plain Python).

Every step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests go first, oldest first: each gets its next slice of tokens — one
token (plus draft tokens) when decoding, the next chunk when its prompt is longer than the budget
left. When the block manager cannot give a running request its slots, the newest running request is
preempted (its blocks freed, to be recomputed: it goes back to the front of the queue) until it can,
or the request itself is the newest and waits. Then, if nothing was preempted, waiting requests are
admitted in arrival order, each starting after the prefix the cache already holds, as long as budget,
seats and blocks last. Prefill chunks and decodes share one step.

`update` takes what the step sampled, appends it, and finishes requests that hit EOS, a stop token,
max_tokens or the model's length; `finish` (stop strings, cancellation) frees a request's blocks at once.

Async scheduling (the engine plans step n+1 while the GPU runs step n): `launched` records a step whose
sampled tokens are still on the device: its tokens count as computed and each request holds one token in
flight (`Request.num_inflight`). The next `schedule` gives that token its position and a PLACEHOLDER id (the
runner takes the id from the device) and leaves out a request its in-flight token will finish by length;
`update(..., launched=True)` then appends the tokens. A token in flight is never hashed into the prefix
cache (only known tokens are), and the engine schedules ahead only when no request can be admitted or
preempted, so neither ever meets a placeholder.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.llm.block_manager import BlockManager
from kiln.llm.config import LLMError
from kiln.llm.request import Request, RequestStatus

PLACEHOLDER = -1  # the id of a token sampled on the device and not yet read by the host


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: what the model runner needs, and nothing it would have to look up."""

    request: Request  # read-only for the runner: sampling params and token history (penalties)
    token_ids: list[int]  # the tokens computed this step: the next slice of request.token_ids, then drafts
    start_position: int  # position of token_ids[0] (= the request's num_computed_tokens)
    block_ids: list[int]  # the request's whole block table
    num_draft_tokens: int = 0  # trailing token_ids that are unverified speculative drafts
    sample: bool = True  # False for a prefill chunk that does not reach the end of the known tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to the queue this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id

    # -- requests in and out ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise LLMError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_model_len
        if request.num_prompt_tokens == 0:
            raise LLMError(f"request {request.request_id!r}: the prompt is empty")
        if request.num_prompt_tokens >= limit:
            raise LLMError(f"request {request.request_id!r}: the prompt has {request.num_prompt_tokens} tokens, "
                           f"the model's length limit is {limit} (prompt and output): shorten the prompt")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Finish a request now (cancelled, or stopped by a stop string): its blocks are free on return."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        blocks = self.block_manager
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            request = running[i]
            if request.num_inflight and self._finishes_by_length(request):
                i += 1  # its token in flight ends it: no row for it
                continue
            num_new = min(len(request.token_ids) + request.num_inflight + len(request.spec_token_ids)
                          - request.num_computed_tokens, budget)
            while blocks.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                output.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself: nothing newer left to take blocks from
            output.scheduled.append(self._slice(request, num_new))
            budget -= num_new
            i += 1
        if output.preempted:
            return output  # no admissions in a step that had to preempt: blocks are short
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_computed = blocks.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if blocks.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            output.scheduled.append(self._slice(request, num_new))
            budget -= num_new
        return output

    def _slice(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        token_ids = request.token_ids
        known = token_ids[start:start + num_new]
        end = len(token_ids)
        if request.num_inflight:  # the tokens in flight follow the known ones
            end += request.num_inflight
            known += [PLACEHOLDER] * (min(start + num_new, end) - max(start, len(token_ids)))
        sample = start + len(known) == end
        num_drafts = num_new - len(known)
        if num_drafts:
            known += request.spec_token_ids[:num_drafts]
        return ScheduledRequest(request, known, start, self.block_manager.block_ids(request.request_id)[:],
                                num_drafts, sample)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_inflight = 0  # recomputed from its known tokens (update skips a request not running)
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the step -----------------------------------------------------------------------
    def launched(self, output: SchedulerOutput) -> None:
        """The step runs with its sampled tokens left on the device (async scheduling): its tokens are computed,
        and each request's next token is in flight until `update(output, sampled, launched=True)`."""
        for item in output.scheduled:
            if item.num_draft_tokens or not item.sample:
                raise LLMError(f"request {item.request_id!r}: only decode steps without drafts run ahead")
            request = item.request
            request.num_computed_tokens += len(item.token_ids)
            request.num_inflight += 1

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]], launched: bool = False) -> list[Request]:
        """Record what the step computed and sampled; returns the requests it finished (blocks freed).

        `sampled[id]` lists the tokens a request accepted this step: one, or with drafts the accepted
        drafts and then the model's own next token. launched: `launched(output)` already counted the
        computed tokens; the sampled ones leave flight."""
        finished = []
        running = RequestStatus.RUNNING
        for item in output.scheduled:
            request = item.request
            if request.status is not running:
                continue  # finished while the step ran (cancelled, or ended by its token the step before)
            tokens = sampled.get(request.request_id, ()) if item.sample else ()
            if launched:
                request.num_inflight -= 1
            else:
                num_rejected = item.num_draft_tokens - (len(tokens) - 1) if tokens else item.num_draft_tokens
                request.num_computed_tokens += len(item.token_ids) - num_rejected
            if request.spec_token_ids:
                request.spec_token_ids = []
            for token in tokens:
                request.append_token(token)
                status = self._stop_status(request, token)
                if status is not None:
                    self.finish(request.request_id, status)
                    finished.append(request)
                    break
        return finished

    def _finishes_by_length(self, request: Request) -> bool:
        """Whether the tokens in flight end the request by max_tokens or the model's length (_stop_status's test)."""
        num_tokens = len(request.token_ids) + request.num_inflight
        max_tokens = request.params.max_tokens
        return (max_tokens is not None and num_tokens - len(request.prompt_token_ids) >= max_tokens) or \
            num_tokens >= self.config.max_model_len

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        num_tokens = len(request.token_ids)
        num_output = num_tokens - len(request.prompt_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = None  # OpenAI: finish_reason "stop", no stop_reason for EOS
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
