"""kiln.llm: an LLM runtime — paged KV cache, in-flight batching, prefix caching, speculative n-gram
decoding, an OpenAI-compatible server. See docs/llm.md.

    from kiln.llm import LLM, SamplingParams
    LLM("hf-folder").generate("Hello", SamplingParams(max_tokens=16, temperature=0))
"""

from kiln.llm.config import EngineConfig, LLMError, ModelConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.llm import LLM
from kiln.llm.outputs import CompletionOutput, RequestOutput
from kiln.llm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "LLMError"]
