"""The offline API, TensorRT-LLM's and vLLM's shape:

    from kiln.llm import LLM, SamplingParams
    llm = LLM("path/to/hf-folder", dtype="bfloat16", kv_cache_memory="4GiB")
    for out in llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32)):
        print(out.outputs[0].text)
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(delta.outputs[0].delta_text, end="")

All prompts of a call run together with in-flight batching; results come back in prompt order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

from kiln.llm.config import EngineConfig, LLMError
from kiln.llm.engine import LLMEngine
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.tensor_parallel import TensorParallelGroup
from kiln.runtime.heap import static_heap

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | Path, *, dtype: str = "auto", tensor_parallel: int = 1,
                 distributed_executor: str = "mp", **engine_options):
        """tensor_parallel=N: N processes (this one is rank 0), one GPU each (gloo on the CPU); close()
        ends them. Scripts that use it must guard their entry point (`if __name__ == "__main__":`).
        distributed_executor: "mp" (local processes) or "ray" (Ray actors: past one machine)."""
        config = EngineConfig(dtype=dtype, **engine_options)
        self._group = None
        if tensor_parallel > 1:
            self._group = TensorParallelGroup(model, config, tensor_parallel, distributed_executor)
            self.engine = self._group.engine
        else:
            self.engine = LLMEngine(model, config)
        self._calls = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device)."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _submit(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None,
                call: int, stream: bool) -> list[list[str]]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.engine.default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise LLMError(f"{len(prompts)} prompts but {len(params)} SamplingParams: give one, or one per prompt")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append([])
                for j in range(p.n):  # n samples of one prompt: n requests (the prefix cache shares the prompt)
                    child = p if p.n == 1 and j == 0 else dataclasses.replace(
                        p, n=1, seed=None if p.seed is None else p.seed + j)
                    ids[-1].append(self.engine.add_request(prompt, child, request_id=f"llm-{call}-{i}-{j}",
                                                           stream=stream))
        except Exception:
            for request_id in itertools.chain.from_iterable(ids):
                self.engine.abort(request_id)
            raise
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt (n samples in its outputs)."""
        prompts = _as_list(prompts)
        # frozen from the requests' admission to the outputs: after an earlier block the collector is due for a full
        # pass, which admitting a large batch outside the freeze would run over the whole heap (kiln/runtime/heap.py)
        with static_heap():
            ids = self._submit(prompts, params, next(self._calls), stream=False)  # outputs only at the end
            final: dict[str, RequestOutput] = {}
            wanted = set(itertools.chain.from_iterable(ids))
            try:
                while wanted - final.keys():
                    for out in self.engine.step():
                        if out.finished and out.request_id in wanted:
                            final[out.request_id] = out
            finally:
                for request_id in wanted - final.keys():
                    self.engine.abort(request_id)
            results = []
            for group in ids:
                first = final[group[0]]
                outputs = [dataclasses.replace(final[r].outputs[0], index=j) for j, r in enumerate(group)]
                results.append(dataclasses.replace(first, request_id=group[0].rsplit("-", 1)[0], outputs=outputs))
        return results

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output every step it produced text (delta_text / delta_token_ids);
        closing the iterator early cancels what is left."""
        prompts = _as_list(prompts)
        with static_heap():  # from the admission on, as generate
            ids = self._submit(prompts, params, next(self._calls), stream=True)
            live = set(itertools.chain.from_iterable(ids))
            try:
                while live:
                    for out in self.engine.step():
                        if out.request_id in live:
                            if out.finished:
                                live.discard(out.request_id)
                            yield out
            finally:
                for request_id in live:
                    self.engine.abort(request_id)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             **template_options) -> list[RequestOutput]:
        """generate() over conversations rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.tokenizer is None:
            raise LLMError(f"{self.engine.path} has no tokenizer.json: chat needs one")
        prompts = [self.tokenizer.encode_chat(c, **template_options) for c in conversations]
        return self.generate(prompts, params)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
