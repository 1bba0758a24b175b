"""Llama-family decoders (Llama 2/3, Mistral, Qwen2/2.5): RMSNorm, RoPE, grouped-query attention,
SwiGLU; Qwen2's q/k/v bias; Mistral's sliding window; tied embeddings.

Checkpoint names are transformers' (model.layers.N.self_attn.q_proj.weight, ...); q/k/v and gate/up
are fused into one GEMM each at load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.attention import AttentionMetadata, paged_attention, write_kv
from kiln.llm.config import ModelConfig
from kiln.llm.models import layers
from kiln.llm.models.layers import ColumnLinear, RMSNorm, Rotary, RowLinear, VocabEmbedding
from kiln.llm.models.loading import WeightLoader
from kiln.llm.parallel import TensorParallel


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, rotary: Rotary, what: str):
        super().__init__()
        d = config.head_dim
        self.num_heads = tp.shard(config.num_heads, f"{what} attention heads")[1]
        self.num_kv_heads = tp.shard(config.num_kv_heads, f"{what} key/value heads")[1]
        self.head_dim = d
        self.scale = d ** -0.5
        self.sliding_window = config.sliding_window
        self.rotary = rotary
        self.qkv_proj = ColumnLinear(config.hidden_size, [config.num_heads * d, config.num_kv_heads * d,
                                                          config.num_kv_heads * d], config.qkv_bias, tp, f"{what}.qkv")
        self.o_proj = RowLinear(config.num_heads * d, config.hidden_size, config.o_bias, tp, f"{what}.o_proj")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] normed -> [T, hidden]."""
        return self.o_proj(self.attend(self.qkv_proj(x), positions, kv_cache, meta))

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """qkv: [T, (Hq + 2·Hkv)·D] projected -> RoPE, k and v into the cache, attention: [T, Hq·D]."""
        return self.attention(self.rope_and_cache(qkv, positions, kv_cache, meta), kv_cache, meta)

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                       meta: AttentionMetadata) -> torch.Tensor:
        """qkv: [T, (Hq + 2·Hkv)·D] -> rotated q [T, Hq, D]; rotated k and v written into the cache."""
        num_tokens, d = qkv.shape[0], self.head_dim
        if layers.FUSED and qkv.is_cuda:  # RoPE and the cache writes in one kernel
            from kiln.llm.kernels.fused import rope_kv_write  # here: a CPU run never imports triton
            return rope_kv_write(qkv, positions, meta.slot_mapping, self.rotary.cos, self.rotary.sin,
                                 kv_cache[0], kv_cache[1], self.num_heads, self.num_kv_heads, d)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = self.rotary(positions, q.view(num_tokens, self.num_heads, d), k.view(num_tokens, self.num_kv_heads, d))
        v = v.view(num_tokens, self.num_kv_heads, d)  # q: [T, Hq, D]; k, v: [T, Hkv, D]
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return q

    def attention(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D] rotated, this step's k and v in the cache -> [T, Hq·D]."""
        out = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, what: str):
        super().__init__()
        self.intermediate = tp.shard(config.intermediate_size, f"{what} intermediate")[1]
        self.gate_up_proj = ColumnLinear(config.hidden_size, [config.intermediate_size] * 2, config.mlp_bias, tp,
                                         f"{what}.gate_up")
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, tp, f"{what}.down")

    def forward(self, x: torch.Tensor | layers.FP8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if layers.FUSED and gate_up.is_cuda:
            from kiln.llm.kernels.fused import silu_mul, silu_mul_fp8
            if layers.takes_fp8_rows(self.down_proj, gate_up.shape[0]):  # SwiGLU and the quantization in one pass
                return self.down_proj(layers.FP8Rows(*silu_mul_fp8(gate_up), gate_up.dtype))
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, rotary: Rotary, index: int):
        super().__init__()
        what = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, tp, rotary, what)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, tp, what)

    def forward(self, x, h, positions, kv_cache, meta, next_norm: RMSNorm, next_fp8: bool = False):
        """x: the residual stream, h: this layer's normed input -> (x, the next norm of x): each residual add
        is fused with the norm after it (one kernel on CUDA). Where an FP8 GEMM reads a norm's rows
        (layers.takes_fp8_rows; next_fp8 for the next norm's reader) they come quantized from the norm's kernel."""
        fp8 = layers.takes_fp8_rows(self.mlp.gate_up_proj, x.shape[0])
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, positions, kv_cache, meta), fp8)
        return next_norm.add_forward(x, self.mlp(h), next_fp8)

    def fused_forward(self, x, positions, kv_cache, meta, fusion, configs):
        """x: the residual stream [T, hidden] -> the next one, in the four GEMVs of kiln/llm/decode_fusion.py
        (`fusion`, at `configs`): each norm folded into the projection after it, each residual add into the
        projection before it, SwiGLU into gate_up, and where configs.rope, RoPE and the cache write into qkv."""
        attn, mlp = self.self_attn, self.mlp
        if configs.rope:  # RoPE and the cache write in the q|k|v GEMV's epilogue too
            q = fusion.normed_rope(attn, self.input_layernorm, x, configs.qkv, positions, kv_cache, meta.slot_mapping)
            attended = attn.attention(q, kv_cache, meta)
        else:
            qkv = fusion.normed(attn.qkv_proj, self.input_layernorm, x, configs.qkv)
            attended = attn.attend(qkv, positions, kv_cache, meta)
        x = fusion.residual(attn.o_proj, attended, x, configs.o)
        act = fusion.normed(mlp.gate_up_proj, self.post_attention_layernorm, x, configs.gate_up, swiglu=True)
        return fusion.residual(mlp.down_proj, act, x, configs.down)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, max_position: int):
        super().__init__()
        self.config = config
        rotary = Rotary(config.rope, config.head_dim, max_position, config.max_position_embeddings)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaLayer(config, tp, rotary, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.decode_fusion = None  # kiln/llm/decode_fusion.py's DecodeFusion where engine start chose it

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """token_ids, positions: [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(token_ids)
        configs = self.decode_fusion.configs_for(x.shape[0]) if self.decode_fusion is not None else None
        if configs is not None:  # decode rows with the small kernels fused into the GEMVs
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer.fused_forward(x, positions, kv_cache, meta, self.decode_fusion, configs)
            return self.norm(x)
        # each layer's input norm quantizes its rows where its q|k|v GEMM is FP8 (never the final norm: the LM head
        # is bf16)
        fp8 = [layers.takes_fp8_rows(layer.self_attn.qkv_proj, x.shape[0]) for layer in self.layers] + [False]
        h = self.layers[0].input_layernorm(x, fp8[0])
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, kv_cache, next_norm, next_fp8 in zip(self.layers, kv_caches, norms, fp8[1:]):
            x, h = layer(x, h, positions, kv_cache, meta, next_norm, next_fp8)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> fp32 logits [R, vocab]."""
        return (self.lm_head or self.embed_tokens).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        loader = WeightLoader(self, source)
        for name, tensor in weights:
            path, _, kind = name.removeprefix("model.").rpartition(".")
            owner, _, leaf = path.rpartition(".")
            if leaf in QKV and owner.endswith("self_attn"):
                loader.load(name, f"{owner}.qkv_proj", kind, tensor, QKV[leaf])
            elif leaf in GATE_UP and owner.endswith("mlp"):
                loader.load(name, f"{owner}.gate_up_proj", kind, tensor, GATE_UP[leaf])
            elif path == "lm_head" and self.lm_head is None:
                loader.skip(name)  # a tied checkpoint may store the head anyway: the embedding is the head
            elif path.endswith("rotary_emb"):
                loader.skip(name)  # a precomputed inv_freq: kiln computes its own from config.json
            else:
                loader.load(name, path, kind, tensor)
        loader.finish()


QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
GATE_UP = {"gate_proj": 0, "up_proj": 1}
