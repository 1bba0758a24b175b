"""The OpenAI API's request bodies (the fields kiln honours, vLLM's extras included) and how they
become SamplingParams. Unknown fields are ignored, as OpenAI's server ignores them; fields kiln
cannot honour (logit_bias, suffix, best_of != n, tools) are refused with a 400 naming them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from kiln.llm.config import LLMError
from kiln.llm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise LLMError("logit_bias is not supported by kiln")
        if self.stream_options is not None and not self.stream:
            raise LLMError("stream_options is only allowed with stream: true")

        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=pick(self.temperature, defaults.temperature), top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k), min_p=pick(self.min_p, defaults.min_p),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.suffix:
            raise LLMError("suffix is not supported by kiln")
        if self.best_of is not None and self.best_of != self.n:
            raise LLMError(f"best_of {self.best_of} != n {self.n} is not supported by kiln")
        if self.echo and self.stream:
            raise LLMError("echo with stream is not supported by kiln")

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise LLMError("prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):  # content parts: text only
            kinds = {part.get("type") for part in content}
            if kinds - {"text"}:
                raise LLMError(f"message content of type {sorted(kinds - {'text'})} is not supported (text only)")
            content = "".join(part.get("text", "") for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    response_format: dict | None = None

    def check(self) -> None:
        if self.tools:
            raise LLMError("tools are not supported by kiln")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise LLMError(f"response_format {self.response_format.get('type')!r} is not supported by kiln")
        if self.top_logprobs and not self.logprobs:
            raise LLMError("top_logprobs needs logprobs: true")


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "abort"]
