"""Decoder models kiln runs, by family (config.py's FAMILIES maps a model_type to one)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from kiln.llm.config import ModelConfig
from kiln.llm.models.gpt2 import GPT2LMHeadModel
from kiln.llm.models.llama import LlamaForCausalLM
from kiln.llm.parallel import SINGLE, TensorParallel

MODELS = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}


def build_model(config: ModelConfig, max_position: int, tp: TensorParallel = SINGLE) -> nn.Module:
    """An empty model (weights to load) on the current default device and dtype."""
    model = MODELS[config.family](config, tp, max_position)
    return model.requires_grad_(False).eval()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside the block (build_model makes its parameters in it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
