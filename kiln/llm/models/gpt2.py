"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v, GELU (tanh) MLP, head tied to the
token embedding. transformers stores its linear layers as Conv1D ([in, out]): transposed at load."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.attention import AttentionMetadata, paged_attention, write_kv
from kiln.llm.config import ModelConfig
from kiln.llm.models.layers import ColumnLinear, RowLinear, VocabEmbedding
from kiln.llm.models.loading import WeightLoader
from kiln.llm.parallel import TensorParallel


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int):
        super().__init__()
        what, d = f"h.{index}.attn", config.head_dim
        self.num_heads = tp.shard(config.num_heads, f"{what} heads")[1]
        self.head_dim = d
        self.scale = d ** -0.5 / ((index + 1) if config.attention_scale_by_layer else 1)
        self.c_attn = ColumnLinear(config.hidden_size, [config.hidden_size] * 3, True, tp, f"{what}.c_attn")
        self.c_proj = RowLinear(config.hidden_size, config.hidden_size, True, tp, f"{what}.c_proj")

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.c_attn(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        out = paged_attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.c_proj(out.reshape(num_tokens, -1))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int):
        super().__init__()
        self.c_fc = ColumnLinear(config.hidden_size, [config.intermediate_size], True, tp, f"h.{index}.mlp.c_fc")
        self.c_proj = RowLinear(config.intermediate_size, config.hidden_size, True, tp, f"h.{index}.mlp.c_proj")
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, index: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config, tp, index)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config, tp, index)

    def forward(self, x, kv_cache, meta):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, max_position: int):
        super().__init__()
        self.config = config
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, tp, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.requires_grad_(False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(token_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head or self.wte).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        loader = WeightLoader(self, source)
        for name, tensor in weights:
            path, _, kind = name.removeprefix("transformer.").rpartition(".")
            leaf = path.rpartition(".")[2]
            if path.endswith(".attn") and kind in ("bias", "masked_bias"):
                loader.skip(name)  # older checkpoints store the causal mask
            elif path == "lm_head" and self.lm_head is None:
                loader.skip(name)
            elif leaf in ("c_attn", "c_fc", "c_proj"):
                conv = tensor.t() if kind == "weight" else tensor  # Conv1D [in, out] -> Linear [out, in]
                if leaf == "c_attn":
                    for part, piece in enumerate(conv.chunk(3, dim=0)):
                        loader.load(name, path, kind, piece, part)
                else:
                    loader.load(name, path, kind, conv)
            else:
                loader.load(name, path, kind, tensor)
        loader.finish()
