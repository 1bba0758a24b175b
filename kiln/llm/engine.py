"""LLMEngine: the loop every front end drives. One `step()` is schedule -> run -> postprocess:

    scheduler.schedule()        which tokens of which requests (kiln/llm/scheduler.py, plain Python)
    runner.execute(...)         one model step over the paged KV cache, sampling on the device
    scheduler.update(...)       append tokens, finish on EOS / stop tokens / length, free blocks
    _process(...)               incremental text, stop strings, log-probabilities -> RequestOutputs

With async scheduling (on with CUDA graphs), a decode step (greedy or sampled on the device; not with penalties
or log-probabilities) is launched and its tokens are read only in the next `step()`, after that step's own
launch: the host schedules, stages and launches step n+1 while the GPU runs step n, then appends step n's
tokens and builds its outputs while the GPU runs step n+1 (vLLM's
async scheduling, TensorRT-LLM's overlap scheduler). A request that ends on EOS at step n has one wasted row
in step n+1; its output is dropped. The engine plans ahead only when the next step cannot admit or preempt
(otherwise it first reads the launched step's tokens), so the scheduler sees tokens in flight only as
decodes of running requests.

Loading builds the model from config.json on the chosen device and dtype, reads the safetensors,
and sizes the KV cache from the budget the user gives (EngineConfig.kv_cache_memory or num_kv_blocks).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.llm.block_manager import BlockManager
from kiln.llm.config import EngineConfig, LLMError, ModelConfig, parse_bytes
from kiln.llm.kv_cache import KVCacheSpec, allocate_kv_cache
from kiln.llm.model_runner import LaunchedStep, ModelRunner, StepResult, TokenLogprobs
from kiln.llm.models import build_model, default_dtype
from kiln.llm.models.layers import ColumnLinear, RowLinear, materialize_weight
from kiln.llm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.llm.parallel import SINGLE, TensorParallel
from kiln.llm.prequantized import convert_weights, read_format
from kiln.llm.quantization import attach_checkpoint_weights, quantize_model
from kiln.llm.request import Request, RequestStatus
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kiln.llm.spec_decode import propose_ngram
from kiln.llm.tokenizer import IncrementalDetokenizer, Tokenizer
from kiln.llm.weights import iterate_weights

log = logging.getLogger("kiln.llm")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, checkpoint: str | None, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":  # the checkpoint's on a GPU; fp32 on the CPU, where half precision is emulated and slow
        return DTYPES.get(checkpoint or "float32", torch.float32) if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise LLMError(f"dtype {name!r}: expected auto, float32, bfloat16 or float16")
    return DTYPES[name]


@torch.no_grad()
def _dummy_weights(model: torch.nn.Module, seed: int | None) -> None:
    """Random weights in place of a checkpoint (load_format="dummy"): matrices N(0, 0.02), norms and biases
    as built (ones, zeros). Made on the model's device: an 8B model in a second on a GPU."""
    generator = None
    for module in model.modules():
        if isinstance(module, (ColumnLinear, RowLinear)):
            materialize_weight(module)
    for p in model.parameters():
        if p.dim() > 1:
            if generator is None:
                generator = torch.Generator(device=p.device).manual_seed(0 if seed is None else seed)
            p.normal_(0.0, 0.02, generator=generator)


@dataclass
class EngineStats:
    """Counters the server's /metrics reads (cumulative since start)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests


@dataclass
class _State:
    """Per-request output state: detokenizer, text so far, what was sent."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    text: str = ""
    stream: bool = True  # an output every step it has tokens (else only when it finishes: LLM.generate)
    sent_text: int = 0
    sent_tokens: int = 0  # output tokens sent in RequestOutputs
    num_counted: int = 0  # output tokens counted in the stats and metrics
    num_detokenized: int = 0  # output tokens given to the detokenizer
    logprobs: list[TokenLogprobs] | None = None
    sent_logprobs: int = 0


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, tp: TensorParallel = SINGLE,
                 observer: Callable[[str, dict], None] | None = None):
        self.path = Path(model)
        self.config = config = config or EngineConfig()
        config.check()
        self.model_config = ModelConfig.from_folder(self.path)
        self.tokenizer = Tokenizer(self.path) if (self.path / "tokenizer.json").is_file() else None
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.dtype, self.device)
        max_position = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or max_position
        if self.max_model_len > max_position:
            raise LLMError(f"max_model_len {self.max_model_len} is longer than the model's max_position_embeddings "
                           f"{max_position}")
        if config.attention_backend == "auto":
            config.attention_backend = "triton" if self.device.type == "cuda" else "torch"
        # a pre-quantized checkpoint: its format is checked here, before any weight is read
        self.checkpoint_format = read_format(self.model_config.quantization_config, str(self.path / "config.json"))
        if self.checkpoint_format is not None:
            if config.quantization:
                raise LLMError(f"{self.path} is already quantized ({self.checkpoint_format.name}): leave "
                               f"quantization unset (got {config.quantization!r}) to load its weights as they are")
            if self.model_config.family != "llama":
                raise LLMError(f"{self.path}: pre-quantized {self.model_config.model_type} checkpoints are not "
                               "supported (Llama, Mistral and Qwen2 are)")
        started = time.perf_counter()
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = build_model(self.model_config, self.max_model_len, tp)
        if config.load_format == "dummy":
            _dummy_weights(self.model, config.seed)
        elif self.checkpoint_format is not None:
            self.model.load_weights(convert_weights(iterate_weights(self.path), self.checkpoint_format),
                                    source=str(self.path))
            attach_checkpoint_weights(self.model)
        else:
            self.model.load_weights(iterate_weights(self.path), source=str(self.path))
        if config.quantization:
            quantize_model(self.model, config.quantization, config.quantization_group_size)
        self.gemv_decisions = []  # kiln/llm/decode_gemv.py: which kernel each weight shape's decode rows run
        if self.device.type == "cuda" and config.gemv != "cublas":
            from kiln.builder.timing_cache import TimingCache
            from kiln.llm.decode_gemv import GemvTuner  # here: CPU runs never import triton

            tuned = time.perf_counter()
            cache = TimingCache(config.gemv_timing_cache) if config.gemv_timing_cache else None
            self.gemv_decisions = GemvTuner(config.gemv, cache).tune(self.model, self.dtype, config.max_num_seqs)
            log.info("kiln llm: decode GEMVs (%s) chosen in %.1f s", config.gemv, time.perf_counter() - tuned)
        self.fusion_decisions = []  # kiln/llm/decode_fusion.py: per rows bucket, fused decode layers or not
        if self.device.type == "cuda":
            from kiln.llm.decode_fusion import FusionTuner  # here: CPU runs never import triton

            tuned = time.perf_counter()
            self.fusion_decisions = FusionTuner(config.decode_fusion).tune(self.model, self.dtype, config.max_num_seqs)
            log.info("kiln llm: decode fusion (%s) chosen in %.1f s", config.decode_fusion, time.perf_counter() - tuned)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        spec = KVCacheSpec(self.model_config.num_layers, self.model_config.num_kv_heads // tp.size,
                           self.model_config.head_dim, config.block_size, self.kv_dtype)
        num_blocks = config.num_kv_blocks or spec.blocks_for_budget(config.kv_cache_bytes())
        if (num_blocks - 1) * config.block_size < self.max_model_len:
            raise LLMError(f"the KV cache holds {(num_blocks - 1) * config.block_size} tokens, less than one request "
                           f"of max_model_len {self.max_model_len}: raise kv_cache_memory or lower max_model_len")
        self.kv_cache_spec, self.num_kv_blocks = spec, num_blocks
        self.kv_caches = allocate_kv_cache(spec, num_blocks, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, config.enable_chunked_prefill),
                                   self.block_manager)
        graphs = config.cuda_graphs
        if graphs == "auto":
            graphs = self.device.type == "cuda" and config.attention_backend == "triton" and tp.size == 1
        elif graphs and (self.device.type != "cuda" or config.attention_backend != "triton" or tp.size > 1):
            raise LLMError("cuda_graphs needs a CUDA device, the triton attention backend and one GPU "
                           "(tensor-parallel ranks run their steps eagerly)")
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device,
                                  self.model_config.vocab_size, config.attention_backend, config.seed,
                                  max_model_len=self.max_model_len, cuda_graphs=bool(graphs),
                                  max_num_seqs=config.max_num_seqs, prefill_attention=config.prefill_attention)
        speculative = bool(config.speculative_ngram) or config.speculative_model is not None
        if config.async_scheduling is True and (not graphs or speculative):
            raise LLMError("async_scheduling needs cuda_graphs and no speculative decoding (drafts are proposed "
                           "from the tokens of the step before)")
        self.async_scheduling = bool(graphs) and not speculative if config.async_scheduling == "auto" \
            else config.async_scheduling
        self._launched: tuple[SchedulerOutput, LaunchedStep] | None = None  # a step whose tokens are unread
        self.draft = None
        if config.speculative_model is not None:
            if tp.size > 1:
                raise LLMError("speculative_model with tensor parallelism is not supported yet")
            from kiln.llm.draft import DraftModel

            self.draft = DraftModel(config.speculative_model, target=self.model_config, device=self.device,
                                    dtype=self.dtype, kv_dtype=self.kv_dtype, max_model_len=self.max_model_len,
                                    block_size=config.block_size,
                                    kv_cache_bytes=parse_bytes(config.speculative_kv_cache_memory
                                                               or config.kv_cache_memory),
                                    attention_backend=config.attention_backend)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.states: dict[str, _State] = {}
        self.stats = EngineStats()
        self.observer = observer  # (event, fields): "first_token", "token", "finished" (server metrics)
        self._ids = itertools.count()
        self._never_scheduled: set[str] = set()  # request ids without a first_scheduled_time yet
        log.info("kiln llm: %s (%s) on %s in %s, %d KV blocks of %d tokens (%.2f GiB), loaded in %.1f s",
                 self.path.name, self.model_config.model_type, self.device, self.dtype, num_blocks, config.block_size,
                 num_blocks * spec.bytes_per_block / 2**30, time.perf_counter() - started)

    # -- requests -----------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with generation_config.json's sampling defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.model_config.generation_defaults)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise LLMError(f"{self.path} has no tokenizer.json: give prompts as token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, stream: bool = True) -> str:
        """stream=False: step() gives this request's RequestOutput once, when it finishes, its text decoded then
        in one piece (unless stop strings need the text every step); building an output every step costs the
        host ~4 us a request, which at batch 256 is a tenth of a decode step's GPU time."""
        params = params or self.default_sampling_params()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise LLMError(f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise LLMError(f"request {request_id!r}: stop strings need a tokenizer ({self.path} has none)")
        request = Request(request_id, token_ids, params, self.eos_token_ids,
                          arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.scheduler.add(request)
        detokenizer = (IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                       if params.detokenize and self.tokenizer is not None else None)
        self.states[request_id] = _State(request, prompt if isinstance(prompt, str) else None, detokenizer,
                                         RequestMetrics(request.arrival_time), stream=stream,
                                         logprobs=[] if params.logprobs is not None else None)
        self._never_scheduled.add(request_id)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request: its blocks are free when this returns. False if it was not running or waiting."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id, "abort")
        return request is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model step; returns the outputs of the requests it advanced. With async scheduling a launched
        step's outputs come from the next call (so a call may return those of the step before)."""
        launched, outputs = self._launched, []
        if launched is not None and not self._can_plan_ahead():
            self._launched = None  # read its tokens first; then this call runs the next step as usual
            outputs = self._complete(*launched)
            launched = None
        scheduled = self.scheduler.schedule()
        self.stats.num_preemptions += len(scheduled.preempted)
        if scheduled.empty:
            self._launched = None
            return self._complete(*launched) if launched is not None else outputs
        self._mark_scheduled(scheduled)
        if self.async_scheduling and self.runner.can_launch(scheduled.scheduled):
            step = self.runner.launch(scheduled.scheduled, launched[1] if launched is not None else None)
            self.scheduler.launched(scheduled)
            self._launched = (scheduled, step)
            return outputs + self._complete(*launched) if launched is not None else outputs
        if launched is not None:  # _can_plan_ahead promised a launchable step
            raise RuntimeError("a step planned ahead of a launched one cannot be launched")
        result = self.runner.execute(scheduled)
        self.stats.draft_tokens += result.num_draft_tokens
        self.stats.accepted_draft_tokens += result.num_accepted_drafts
        self.scheduler.update(scheduled, result.sampled)
        outputs += self._outputs(scheduled, result)
        if self.config.speculative_ngram or self.draft is not None:
            self._propose_drafts()
        return outputs

    def _can_plan_ahead(self) -> bool:
        """Whether the next step can be scheduled while the launched one's tokens are unread: no request can be
        admitted (none waits) or preempted (a free block for each running request, each needing at most one),
        and every running request has its token in flight, so the step is a decode of them all (launchable:
        the launched step held the same requests)."""
        scheduler = self.scheduler
        running = scheduler.running
        return (not scheduler.waiting and self.block_manager.num_free_blocks >= len(running)
                and scheduler.config.max_num_batched_tokens >= len(running)
                and all(r.num_inflight for r in running))

    def _complete(self, scheduled: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the GPU if it is not done), append them, build outputs."""
        result = launched.result()
        self.scheduler.update(scheduled, result.sampled, launched=True)
        return self._outputs(scheduled, result)

    def _mark_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.monotonic()
        if self._never_scheduled:  # no loop over the batch once every request has run
            for item in scheduled.scheduled:
                request_id = item.request.request_id
                if request_id in self._never_scheduled:
                    self._never_scheduled.discard(request_id)
                    self.states[request_id].metrics.first_scheduled_time = now

    def _outputs(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        states, sampled, logprobs = self.states, result.sampled, result.logprobs
        for item in scheduled.scheduled:
            request_id = item.request.request_id
            state = states.get(request_id)  # gone: finished before a launched step's tokens came back
            if state is not None and sampled.get(request_id):
                output = self._process(state, logprobs.get(request_id), now)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _process(self, state: _State, logprobs: list[TokenLogprobs] | None, now: float) -> RequestOutput | None:
        """Count the step's tokens; the request's RequestOutput, or None while a request that is not streamed
        runs on (it gets one when it finishes)."""
        request, params, metrics = state.request, state.request.params, state.metrics
        num_output = len(request.token_ids) - len(request.prompt_token_ids)
        num_new = num_output - state.num_counted  # the update may have dropped tokens after a stop
        state.num_counted = num_output
        self.stats.generation_tokens += num_new
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.stats.prompt_tokens += request.num_prompt_tokens
            self._observe("first_token", ttft=now - metrics.arrival_time)
        elif num_new and self.observer is not None:
            self._observe("token", itl=now - metrics.last_token_time, count=num_new)
        metrics.last_token_time = now
        if state.logprobs is not None and logprobs:
            state.logprobs.extend(logprobs[:num_new])
        if not (state.stream or params.stop or request.status.finished):
            return None
        if state.detokenizer is not None:
            kept = request.output_token_ids[state.num_detokenized:]
            state.num_detokenized = num_output
            checked = len(state.text)
            state.text += state.detokenizer.add(kept)
            if request.status.finished:
                state.text += state.detokenizer.flush()
            if params.stop and request.num_output_tokens >= params.min_tokens:
                self._check_stop_strings(state, checked)
        finished = request.status.finished
        if not (state.stream or finished):
            return None
        hold = 0 if finished or not params.stop else max(len(s) for s in params.stop) - 1
        visible = state.text[:max(len(state.text) - hold, state.sent_text)]
        delta_text, state.sent_text = visible[state.sent_text:], len(visible)
        output_ids = request.output_token_ids
        delta_ids, state.sent_tokens = output_ids[state.sent_tokens:], len(output_ids)
        delta_logprobs = None
        if state.logprobs is not None:
            delta_logprobs, state.sent_logprobs = state.logprobs[state.sent_logprobs:], len(state.logprobs)
        completion = CompletionOutput(0, visible if not finished else state.text, output_ids, delta_text, delta_ids,
                                      state.logprobs, delta_logprobs, request.status.finish_reason,
                                      request.stop_reason)
        if finished:
            metrics.finished_time = now
            metrics.num_preemptions = request.num_preemptions
            self._forget(request.request_id, request.status.finish_reason)
            self._observe("finished", e2e=now - metrics.arrival_time, reason=request.status.finish_reason,
                          prompt_tokens=request.num_prompt_tokens, generation_tokens=request.num_output_tokens,
                          ttft=metrics.first_token_time - metrics.arrival_time)
        return RequestOutput(request.request_id, state.prompt, request.prompt_token_ids, [completion], finished,
                             max(request.num_cached_tokens, 0), metrics)

    def _check_stop_strings(self, state: _State, checked: int) -> None:
        """Cut the text at the first stop string that ends in its new part; finish the request there."""
        params, text = state.request.params, state.text
        search_from = max(0, checked - max(len(s) for s in params.stop) + 1)
        found = [(i, s) for s in params.stop if (i := text.find(s, search_from)) >= 0]
        if not found:
            return
        index, stop = min(found)
        state.text = text[:index + len(stop)] if params.include_stop_str_in_output else text[:index]
        request = state.request
        request.stop_reason = stop
        if request.status.finished:  # the same step also hit EOS or the length: the stop string came first
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _forget(self, request_id: str, reason: str | None) -> None:
        self._never_scheduled.discard(request_id)
        if self.states.pop(request_id, None) is not None and reason is not None:
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self.runner.sampler.forget(request_id)
        if self.draft is not None:
            self.draft.forget(request_id)

    def _observe(self, event: str, **fields) -> None:
        if self.observer is not None:
            self.observer(event, fields)

    def _propose_drafts(self) -> None:
        config = self.config
        wanted: list[tuple[Request, int]] = []
        for request in self.scheduler.running:
            params = request.params
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # a request mid-prefill has none
            room = self.max_model_len - request.num_tokens
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens)
            k = min(config.speculative_tokens if self.draft is not None else config.speculative_ngram, room - 1)
            if k > 0 and self.draft is not None:
                wanted.append((request, k))
            elif k > 0:
                request.spec_token_ids = propose_ngram(request.token_ids, k, config.ngram_min, config.ngram_max)
        if wanted:
            for request, _ in wanted:
                request.spec_token_ids = []
            by_id = {request.request_id: request for request, _ in wanted}
            for request_id, drafts in self.draft.propose(wanted).items():
                by_id[request_id].spec_token_ids = drafts
