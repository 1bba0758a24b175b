"""The OpenAI-compatible HTTP API over an AsyncLLM (FastAPI):

    POST /v1/completions        prompt(s) -> text; SSE with stream: true
    POST /v1/chat/completions   messages through the model's chat template -> message; SSE
    GET  /v1/models             the one model served
    POST /tokenize, /detokenize vLLM's shape
    GET  /health, /metrics      liveness; Prometheus text

Streams end with `data: [DONE]`; with stream_options.include_usage every chunk carries "usage": null
and a last chunk (no choices) carries the counts, as OpenAI's API does. Errors are
{"error": {"message", "type", "param", "code"}}: 400 for a request kiln refuses, 404 for another
model's name, 429 when the queue is full, 500 when the engine failed. A client that disconnects
has its request cancelled and its KV blocks freed at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.llm.async_engine import AsyncLLM, EngineDeadError
from kiln.llm.config import LLMError
from kiln.llm.model_runner import TokenLogprobs
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.server.metrics import CONTENT_TYPE, LLMMetrics
from kiln.llm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kiln.version import __version__


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


@dataclass
class _Choice:
    """One completion being produced: its request, its place in the answer, the latest output."""

    request_id: str
    index: int  # choices[index]: prompt_index * n + sample
    sample: int  # which of the prompt's n samples
    prompt_tokens: int
    echo: str | None = None  # completions with echo: the prompt's text, put before the completion
    output: RequestOutput | None = None


def build_app(llm: AsyncLLM, model_name: str, metrics: LLMMetrics, max_pending: int = 1024) -> FastAPI:
    engine = llm.engine
    tokenizer = engine.tokenizer
    app = FastAPI(title="kiln llm", version=__version__)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return _error(e.status, e.message, e.kind, e.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}"
                             for err in e.errors())
        return _error(400, problems or "invalid request", "BadRequestError")

    @app.exception_handler(LLMError)
    async def llm_error(_, e: LLMError):
        return _error(400, str(e), "BadRequestError")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{model_name}`.",
                           "NotFoundError", "model")

    def check_capacity(count: int) -> None:
        if engine.scheduler.num_unfinished + count > max_pending:
            raise APIError(429, f"{engine.scheduler.num_unfinished} requests in flight; the limit is {max_pending}: "
                                "retry later", "RateLimitError")

    @app.get("/health")
    async def health():
        if llm.dead is not None:
            raise APIError(500, f"the engine failed: {llm.dead}", "InternalServerError")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kiln", "root": str(engine.path), "parent": None,
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages")
        if body.messages is not None:
            tokens = tokenizer.encode_chat([m.as_template_input() for m in body.messages], body.add_generation_prompt)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        need_tokenizer()
        bad = [t for t in body.tokens if not 0 <= t < engine.model_config.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def need_tokenizer() -> None:
        if tokenizer is None:
            raise APIError(400, f"{engine.path} has no tokenizer.json: only token-id prompts are served")

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)

    # -- completions --------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check()
        defaults = engine.default_sampling_params()
        params = body.sampling_params(defaults, body.max_tokens, body.logprobs)
        prompts = body.prompts()
        if any(isinstance(p, str) for p in prompts):
            need_tokenizer()
        # requests are refused before anything runs: each prompt is checked here
        encoded = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else tokenizer.decode(p) if tokenizer else "" for p in prompts]
        return await run(request, body, "cmpl", "text_completion", encoded, params, echo)

    # -- chat ---------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check()
        need_tokenizer()
        messages = [m.as_template_input() for m in body.messages]
        prompt = tokenizer.encode_chat(messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(engine.default_sampling_params(), max_tokens, logprobs)
        return await run(request, body, "chatcmpl", "chat.completion", [prompt], params)

    async def run(request: Request, body, prefix: str, kind: str, prompts: list[list[int]], params: SamplingParams,
                  echo: list[str | None] | None = None):
        limit, vocab = engine.max_model_len, engine.model_config.vocab_size
        for tokens in prompts:
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
            if len(tokens) >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                    f"has {len(tokens)} tokens: shorten it.", param="prompt")
            if params.max_tokens is not None and len(tokens) + params.max_tokens > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                    f"{len(tokens) + params.max_tokens} tokens ({len(tokens)} in the prompt, "
                                    f"{params.max_tokens} for the completion): lower max_tokens.", param="max_tokens")
        check_capacity(len(prompts) * params.n)
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        choices, streams = [], []
        for i, tokens in enumerate(prompts):
            for j in range(params.n):
                child = params if params.n == 1 else _child(params, j)
                choice = _Choice(f"{response_id}-{i}-{j}", i * params.n + j, j, len(tokens),
                                 echo[i] if echo is not None else None)
                choices.append(choice)
                streams.append(llm.generate(tokens, child, choice.request_id))
        chat = kind == "chat.completion"
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(sse(request, response_id, kind, choices, streams, chat, include_usage),
                                     media_type="text/event-stream")
        return await until_done(request, _collect(choices, streams), lambda: respond(response_id, kind, choices, chat))

    async def _collect(choices: list[_Choice], streams: list[AsyncIterator[RequestOutput]]) -> None:
        async def drain(choice, stream):
            async for output in stream:
                choice.output = output
        await asyncio.gather(*(drain(c, s) for c, s in zip(choices, streams)))

    async def until_done(request: Request, work, answer):
        """Run `work`; cancel it (and so the requests: the streams abort) if the client goes away."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task not in done:
            task.cancel()
            return Response(status_code=499)
        try:
            task.result()
        except LLMError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            raise APIError(500, str(e), "InternalServerError") from None
        return answer()

    def respond(response_id: str, kind: str, choices: list[_Choice], chat: bool):
        out_choices = []
        completion_tokens = 0
        for choice in choices:
            completion = choice.output.outputs[0]
            completion_tokens += len(completion.token_ids)
            entry = {"index": choice.index, "finish_reason": completion.finish_reason, "logprobs": None}
            if chat:
                entry["message"] = {"role": "assistant", "content": completion.text}
                if completion.logprobs is not None:
                    entry["logprobs"] = chat_logprobs(completion.logprobs)
            else:
                prefix = choice.echo or ""
                entry["text"] = prefix + completion.text
                entry["stop_reason"] = completion.stop_reason
                if completion.logprobs is not None:
                    entry["logprobs"] = completion_logprobs(completion.logprobs, len(prefix))
            out_choices.append(entry)
        return {"id": response_id, "object": kind, "created": int(time.time()), "model": model_name,
                "choices": out_choices, "usage": usage(choices, completion_tokens)}

    def usage(choices: list[_Choice], completion_tokens: int) -> dict:
        prompt_tokens = sum(c.prompt_tokens for c in choices if c.sample == 0)  # each prompt once
        cached = sum(c.output.num_cached_tokens for c in choices if c.output is not None and c.sample == 0)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def completion_logprobs(items: list[TokenLogprobs], offset: int) -> dict:
        texts = [token_text(t.token_id) for t in items]
        offsets, position = [], offset
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {"tokens": texts, "token_logprobs": [t.logprob for t in items],
                "top_logprobs": [{token_text(i): lp for i, lp in t.top} for t in items], "text_offset": offsets}

    def chat_logprobs(items: list[TokenLogprobs]) -> dict:
        def entry(token_id, logprob):
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in items]}

    async def sse(request: Request, response_id: str, kind: str, choices: list[_Choice],
                  streams: list[AsyncIterator[RequestOutput]], chat: bool, include_usage: bool):
        chunk_kind = "chat.completion.chunk" if chat else kind
        created_at = int(time.time())
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice, stream):
            try:
                async for output in stream:
                    await merged.put((choice, output))
            except Exception as e:  # refused or engine failure: reported in the stream
                await merged.put((choice, e))
            finally:
                await merged.put((choice, None))

        tasks = [asyncio.ensure_future(pump(c, s)) for c, s in zip(choices, streams)]

        def chunk(choice_entries, usage_value=None, with_usage=include_usage):
            body = {"id": response_id, "object": chunk_kind, "created": created_at, "model": model_name,
                    "choices": choice_entries}
            if with_usage:
                body["usage"] = usage_value
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in choices])
            open_streams = len(choices)
            completion_tokens = 0
            while open_streams:
                choice, item = await merged.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, Exception):
                    status = 500 if isinstance(item, EngineDeadError) else 400
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': type(item).__name__, 'param': None, 'code': status}})}\n\n"
                    continue
                choice.output = item
                completion = item.outputs[0]
                completion_tokens += len(completion.delta_token_ids)
                if not completion.delta_text and not completion.finished and not completion.delta_logprobs:
                    continue
                entry = {"index": choice.index, "finish_reason": completion.finish_reason, "logprobs": None}
                if chat:
                    entry["delta"] = {"content": completion.delta_text} if completion.delta_text else {}
                    if completion.delta_logprobs:
                        entry["logprobs"] = chat_logprobs(completion.delta_logprobs)
                else:
                    entry["text"] = completion.delta_text
                    entry["stop_reason"] = completion.stop_reason
                    if completion.delta_logprobs:
                        entry["logprobs"] = completion_logprobs(completion.delta_logprobs, 0)
                yield chunk([entry])
            if include_usage:
                yield chunk([], usage(choices, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): cancel what is left; each stream aborts its request
            for task in tasks:
                task.cancel()

    return app


def _child(params: SamplingParams, j: int) -> SamplingParams:
    return dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
