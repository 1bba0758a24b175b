"""What kiln reads from a Hugging Face model folder's config.json, and the runtime's own settings.

`ModelConfig.from_folder` turns config.json (and generation_config.json) into one typed record the
model code reads by field, whichever transformers version wrote it: RoPE parameters come either as
transformers 5's `rope_parameters` or as the older `rope_theta` + `rope_scaling`. Anything kiln
cannot run faithfully (an unknown architecture, dynamic NTK RoPE whose frequencies depend on the
longest sequence seen so far) is refused here, by name, before any weight is read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError


class LLMError(KilnError):
    """An LLM folder, request or setting kiln cannot use; the message says which and what to do."""


# model_type -> the model family kiln runs it with (kiln/llm/models/)
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int | None = None  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale (None: from factor / mscale)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # config.json's (llama, mistral, qwen2, gpt2)
    family: str  # the kiln model that runs it (llama, gpt2)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias
    mlp_bias: bool = False
    rope: RopeConfig | None = None  # None: learned positions (GPT-2)
    sliding_window: int | None = None  # Mistral: a query sees the last `sliding_window` keys
    attention_scale_by_layer: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx
    dtype: str | None = None  # the checkpoint's dtype (torch name, e.g. "bfloat16")
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict = field(default_factory=dict)  # generation_config.json's sampling fields
    quantization_config: dict | None = None  # a pre-quantized checkpoint's (kiln/llm/prequantized reads it)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise LLMError(f"{folder} has no config.json: give a Hugging Face model folder "
                           "(config.json, *.safetensors, tokenizer.json)")
        raw = json.loads(path.read_text())
        generation_path = folder / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_dict(raw, generation, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None, source: str = "config.json") -> ModelConfig:
        generation = generation or {}
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise LLMError(f"{source}: model_type {model_type!r} is not one kiln runs; supported: "
                           f"{', '.join(sorted(FAMILIES))}")
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bos = generation.get("bos_token_id", raw.get("bos_token_id"))
        defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                    if generation.get(k) is not None}
        if generation.get("do_sample") is False:  # the checkpoint asks for greedy decoding unless told otherwise
            defaults["temperature"] = 0.0
        common = dict(model_type=model_type, family=FAMILIES[model_type], vocab_size=raw["vocab_size"],
                      tie_word_embeddings=raw.get("tie_word_embeddings", model_type == "gpt2"),
                      dtype=raw.get("dtype", raw.get("torch_dtype")), bos_token_id=bos, eos_token_ids=eos_ids,
                      generation_defaults=defaults,
                      # older compressed-tensors checkpoints name it compression_config
                      quantization_config=raw.get("quantization_config") or raw.get("compression_config"))
        if model_type == "gpt2":
            hidden, heads = raw["n_embd"], raw["n_head"]
            act = raw.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
                raise LLMError(f"{source}: GPT-2 activation_function {act!r} is not supported (gelu_new, gelu)")
            return cls(hidden_size=hidden, intermediate_size=raw.get("n_inner") or 4 * hidden,
                       num_layers=raw["n_layer"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                       max_position_embeddings=raw["n_positions"], norm_eps=raw.get("layer_norm_epsilon", 1e-5),
                       hidden_act=act, qkv_bias=True, o_bias=True, mlp_bias=True, rope=None,
                       attention_scale_by_layer=bool(raw.get("scale_attn_by_inverse_layer_idx")), **common)
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise LLMError(f"{source}: hidden_act {act!r} is not supported for {model_type} (silu)")
        bias = bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None  # Qwen2 writes a window size it does not use unless use_sliding_window
        return cls(hidden_size=hidden, intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
                   head_dim=raw.get("head_dim") or hidden // heads,
                   max_position_embeddings=raw.get("max_position_embeddings", 2048),
                   norm_eps=raw.get("rms_norm_eps", 1e-6), hidden_act=act,
                   qkv_bias=bias or model_type == "qwen2", o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)),
                   rope=_rope(raw, source), sliding_window=window, **common)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in elements (multiply by the cache dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _rope(raw: dict, source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})  # transformers >= 5
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "dynamic":
        raise LLMError(f"{source}: dynamic NTK RoPE changes with the longest sequence seen so far, so a request's "
                       "result would depend on the others in its batch; kiln does not run it")
    if kind not in ROPE_TYPES:
        raise LLMError(f"{source}: rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise LLMError(f"{source}: partial_rotary_factor {params['partial_rotary_factor']} is not supported")
    original = params.get("original_max_position_embeddings")
    if kind == "yarn" and params.get("factor") is None:
        raise LLMError(f"{source}: yarn RoPE needs a factor")
    return RopeConfig(theta=float(params.get("rope_theta", 10000.0)), kind=kind,
                      factor=float(params.get("factor") or 1.0),
                      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                      original_max_position=original, beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1), attention_factor=params.get("attention_factor"),
                      mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                      truncate=params.get("truncate", True))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_bytes(value: int | str) -> int:
    """'2GiB', '512MB', '1.5G' or a plain int -> bytes (K/M/G/T are powers of 1024, as GPU memory is counted)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise LLMError(f"memory size {value!r}: expected a number with an optional unit, e.g. '2GiB' or '512MiB'")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(number * 1024**power)


DEFAULT_KV_CACHE_MEMORY = "1GiB"


@dataclass
class EngineConfig:
    """The runtime's settings: every one has a stated default; none is guessed from free memory."""

    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available
    kv_cache_memory: int | str = DEFAULT_KV_CACHE_MEMORY  # the KV cache's budget; kiln never takes "90% of the GPU"
    kv_cache_dtype: str = "auto"  # auto: the model's dtype | fp8: E4M3, unit scale (twice the tokens per byte)
    num_kv_blocks: int | None = None  # or exactly this many blocks (overrides kv_cache_memory)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per model step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output; default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"  # torch (reference, any device) | triton (paged decode kernel) | auto
    # with the triton backend, steps whose prefill requests are all whole prompts (no cached prefix, no sliding
    # window): triton (the paged prefill kernel) | flash (torch's flash attention over variable-length prompts, K/V
    # read back from the cache); the default comes from KILN_LLM_PREFILL, else triton
    prefill_attention: str = field(default_factory=lambda: os.environ.get("KILN_LLM_PREFILL", "triton"))
    quantization: str | None = None  # fp8 | int8 | int4: quantize the projections' weights at load
    quantization_group_size: int = 128  # int4's group of input features
    speculative_ngram: int = 0  # draft tokens proposed per step by n-gram prompt lookup (0: off)
    ngram_min: int = 1
    ngram_max: int = 3
    # or by a smaller draft model of the same vocabulary (a Hugging Face-format folder): tokens per step, and
    # its own KV cache budget (default: kv_cache_memory)
    speculative_model: str | None = None
    speculative_tokens: int = 4
    speculative_kv_cache_memory: int | str | None = None
    seed: int | None = None  # the global generator's seed, for requests without their own
    # decode steps replayed as CUDA graphs per batch-size bucket; auto: on for CUDA + triton on one GPU
    cuda_graphs: bool | str = "auto"
    # plan step n+1 on the host while the GPU runs step n (greedy decode steps through the CUDA graphs; see
    # kiln/llm/engine.py); auto: on with CUDA graphs unless drafts are proposed (they need the last tokens)
    async_scheduling: bool | str = "auto"
    load_format: str = "safetensors"  # safetensors | dummy (random weights, for benchmarks: no checkpoint read)
    # decode rows (<= 16) through the linear layers on CUDA: auto (cuBLAS or kiln's Triton GEMV, whichever timed
    # faster at engine start, per weight shape and rows bucket) | cublas | triton (kiln/llm/decode_gemv.py);
    # the default comes from the KILN_LLM_GEMV environment variable, else auto
    gemv: str = field(default_factory=lambda: os.environ.get("KILN_LLM_GEMV", "auto"))
    # a JSON file (kiln's TimingCache) that keeps those timings across processes; default KILN_LLM_GEMV_CACHE
    gemv_timing_cache: str | None = field(default_factory=lambda: os.environ.get("KILN_LLM_GEMV_CACHE") or None)
    # decode rows (<= 16) of a Llama-family model on one GPU with each layer's norms, residual adds and SwiGLU fused
    # into its GEMVs: auto (per rows bucket where that timed faster at engine start) | on | off
    # (kiln/llm/decode_fusion.py); the default comes from KILN_LLM_FUSE (auto, on/1, off/0), else auto
    decode_fusion: str = field(default_factory=lambda: os.environ.get("KILN_LLM_FUSE", "auto"))

    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)

    def check(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise LLMError(f"block_size {self.block_size}: expected a power of two (e.g. 16)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise LLMError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise LLMError(f"attention_backend {self.attention_backend!r}: expected auto, torch or triton")
        if self.prefill_attention not in ("triton", "flash"):
            raise LLMError(f"prefill_attention {self.prefill_attention!r} (or KILN_LLM_PREFILL): expected triton or "
                           "flash")
        if self.quantization not in (None, "fp8", "int8", "int4"):
            raise LLMError(f"quantization {self.quantization!r}: expected fp8, int8 or int4 (or none)")
        if self.speculative_ngram < 0 or not 1 <= self.ngram_min <= self.ngram_max:
            raise LLMError("speculative_ngram must be >= 0 and 1 <= ngram_min <= ngram_max")
        if self.speculative_model is not None:
            if self.speculative_ngram:
                raise LLMError("speculative_model and speculative_ngram: choose one proposer")
            if self.speculative_tokens < 1:
                raise LLMError(f"speculative_tokens must be >= 1, got {self.speculative_tokens}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise LLMError(f"kv_cache_dtype {self.kv_cache_dtype!r}: expected auto or fp8")
        if self.cuda_graphs not in (True, False, "auto"):
            raise LLMError(f"cuda_graphs {self.cuda_graphs!r}: expected true, false or auto")
        if self.async_scheduling not in (True, False, "auto"):
            raise LLMError(f"async_scheduling {self.async_scheduling!r}: expected true, false or auto")
        if self.gemv not in ("auto", "cublas", "triton"):
            raise LLMError(f"gemv {self.gemv!r} (or KILN_LLM_GEMV): expected auto, cublas or triton")
        if self.decode_fusion not in ("auto", "on", "off", "1", "0"):
            raise LLMError(f"decode_fusion {self.decode_fusion!r} (or KILN_LLM_FUSE): expected auto, on (1) or off (0)")
        if self.load_format not in ("safetensors", "dummy"):
            raise LLMError(f"load_format {self.load_format!r}: expected safetensors or dummy")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
