"""The zoo's model table: what each model is, how to build it in torch, and what it takes as input.

Architectures come from `transformers` configs with random, seeded weights (no downloads), plus the
two real-weight models (MobileNetV2 ImageNet, all-MiniLM-L6-v2). Each full-size model has a small
variant (few layers, narrow) that exports and runs in seconds for CI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kiln.zoo import mobilenet, sentence

SEED = 0


@dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str  # "image": pixel_values; "encoder": input_ids + attention_mask; "decoder": input_ids
    description: str
    build: Callable[[], nn.Module]  # the torch model, eval mode, fp32
    config: dict = field(default_factory=dict)  # what defines it: part of the export cache key
    batch: int = 1
    seq: int = 16  # tokens, for text models
    image_size: int = 224  # for image models
    vocab_size: int = 0  # for text models: token ids are drawn in [0, vocab_size)
    slow: bool = False  # heavy: left out of CI (pytest -m "not slow")
    real_weights: bool = False


class _ImageLogits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits  # [B, classes]


class _EncoderHidden(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, S, D]


class _DecoderLogits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits  # [B, S, vocab]


def _init_like_torchvision(model: nn.Module) -> None:
    """transformers' EfficientNet init (std 0.02 for every convolution and BatchNorm scale) shrinks
    the signal ~1e-9 a block: by the head every activation is exactly 0.0, and a comparison of
    zeros proves nothing. torchvision's instead: He normal convolutions (fan out), unit-scale
    BatchNorm, here with random running statistics so that BatchNorm folding is exercised."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=generator)
                m.bias.uniform_(-0.1, 0.1, generator=generator)
                m.running_mean.uniform_(-0.1, 0.1, generator=generator)
                m.running_var.uniform_(0.5, 1.5, generator=generator)
            elif isinstance(m, nn.Linear):
                bound = m.out_features ** -0.5
                m.weight.uniform_(-bound, bound, generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


_INITS: dict[str, Callable[[nn.Module], None]] = {"torchvision": _init_like_torchvision}


def _hf(config_class: str, model_class: str, wrapper: type[nn.Module], config: dict,
        init: str | None = None) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(SEED)  # random weights, the same ones every time
        hf_config = getattr(transformers, config_class)(**config)
        model = getattr(transformers, model_class)(hf_config)
        if init is not None:
            _INITS[init](model)
        return wrapper(model).eval()
    return build


def _spec(name: str, kind: str, description: str, config_class: str, model_class: str, config: dict,
          init: str | None = None, **options) -> ZooModel:
    """init: a weight initialisation replacing transformers' own (a key of _INITS; part of the cache key)."""
    wrapper = {"image": _ImageLogits, "encoder": _EncoderHidden, "decoder": _DecoderLogits}[kind]
    key = {"class": f"{config_class}/{model_class}", **config, **({"init": init} if init else {})}
    return ZooModel(name=name, kind=kind, description=description,
                    build=_hf(config_class, model_class, wrapper, config, init), config=key, **options)


_BERT_TINY = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=256, max_position_embeddings=128)
_GPT2_TINY = dict(vocab_size=1024, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                  bos_token_id=0, eos_token_id=0)
_LLAMA_SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
_LLAMA_TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_VIT_TINY = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, num_labels=10)
_RESNET_TINY = dict(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                    layer_type="bottleneck", num_labels=10)
# transformers' EfficientNet pools its last map with AvgPool2d(hidden_dim, ceil_mode=True): a
# 1280-wide kernel over B0's 7x7 map (and 320 over the small one's 2x2), exported as an AveragePool
# whose kernel is far larger than its input. hidden_dim must equal the top conv's width.
_EFFICIENTNET_B0 = dict(image_size=224, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280,
                        dropout_rate=0.2, num_labels=1000)
# ALBERT shares one layer's weights across every layer (num_hidden_groups=1): the exported graph
# reads the same initializers from each of its layers.
_ALBERT_BASE = dict(vocab_size=30000, embedding_size=128, hidden_size=768, num_hidden_layers=12,
                    num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512)
_ALBERT_TINY = dict(vocab_size=1024, embedding_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=256, max_position_embeddings=128)
_EFFICIENTNET_TINY = dict(image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                          dropout_rate=0.2, num_labels=10)

MODELS: dict[str, ZooModel] = {m.name: m for m in [
    ZooModel("mobilenet_v2", "image", "MobileNetV2 1.0, torchvision ImageNet weights",
             build=mobilenet.pretrained, config={"arch": "torchvision-mobilenet_v2", "weights": "b0353104"},
             real_weights=True),
    ZooModel("minilm", "encoder", "all-MiniLM-L6-v2 sentence embeddings (mean pooling + L2 norm), real weights",
             build=sentence.pretrained, config={"arch": "sentence-transformers/all-MiniLM-L6-v2"},
             batch=8, seq=32, vocab_size=30522, real_weights=True),
    _spec("resnet50", "image", "ResNet-50, random weights", "ResNetConfig", "ResNetForImageClassification",
          {"num_labels": 1000}, slow=True),
    _spec("resnet_tiny", "image", "ResNet (bottleneck, 4 stages of 1 block, 16-256 wide)",
          "ResNetConfig", "ResNetForImageClassification", _RESNET_TINY, image_size=64),
    _spec("bert_base", "encoder", "BERT-base uncased shape, random weights", "BertConfig", "BertModel",
          {}, seq=128, vocab_size=30522, slow=True),
    _spec("bert_tiny", "encoder", "BERT, 2 layers, 64 wide", "BertConfig", "BertModel", _BERT_TINY,
          batch=2, vocab_size=1024),
    _spec("gpt2", "decoder", "GPT-2 small (124M), random weights", "GPT2Config", "GPT2LMHeadModel",
          {}, seq=128, vocab_size=50257, slow=True),
    _spec("gpt2_tiny", "decoder", "GPT-2, 2 layers, 64 wide", "GPT2Config", "GPT2LMHeadModel", _GPT2_TINY,
          batch=2, vocab_size=1024),
    _spec("llama_small", "decoder", "Llama, 8 layers, 512 wide, GQA 8/4 heads, random weights",
          "LlamaConfig", "LlamaForCausalLM", _LLAMA_SMALL, seq=128, vocab_size=32000, slow=True),
    _spec("llama_tiny", "decoder", "Llama, 2 layers, 64 wide, GQA 4/2 heads", "LlamaConfig", "LlamaForCausalLM",
          _LLAMA_TINY, batch=2, vocab_size=1024),
    _spec("vit_b16", "image", "ViT-B/16 224, random weights", "ViTConfig", "ViTForImageClassification",
          {"num_labels": 1000}, slow=True),
    _spec("vit_tiny", "image", "ViT, 32px images, 8px patches, 2 layers, 64 wide", "ViTConfig",
          "ViTForImageClassification", _VIT_TINY, batch=2, image_size=32),
    _spec("albert_base", "encoder", "ALBERT-base v2 shape (12 layers sharing one layer's weights), random weights",
          "AlbertConfig", "AlbertModel", _ALBERT_BASE, seq=128, vocab_size=30000, slow=True),
    _spec("albert_tiny", "encoder", "ALBERT, 4 layers sharing one layer's weights, 64 wide", "AlbertConfig",
          "AlbertModel", _ALBERT_TINY, batch=2, vocab_size=1024),
    _spec("efficientnet_b0", "image", "EfficientNet-B0 224, random weights (torchvision's init)", "EfficientNetConfig",
          "EfficientNetForImageClassification", _EFFICIENTNET_B0, init="torchvision", slow=True),
    _spec("efficientnet_tiny", "image", "EfficientNet, width 0.25, one block per stage, 64px images",
          "EfficientNetConfig", "EfficientNetForImageClassification", _EFFICIENTNET_TINY, init="torchvision",
          batch=2, image_size=64),
]}


def make_inputs(model: ZooModel, *, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs of the model's kind: token ids in range (some rows padded), or images."""
    rng = np.random.default_rng(seed)
    if model.kind == "image":
        return {"pixel_values": rng.standard_normal((batch, 3, model.image_size, model.image_size), np.float32)}
    input_ids = rng.integers(0, model.vocab_size, (batch, seq), dtype=np.int64)
    if model.kind == "decoder":
        return {"input_ids": input_ids}
    attention_mask = np.ones((batch, seq), np.int64)
    for row in range(1, batch):  # rows after the first end in padding, so masking is exercised
        attention_mask[row, rng.integers(seq // 2, seq):] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def example_inputs(model: ZooModel, *, batch: int, seq: int) -> dict[str, np.ndarray]:
    """The deterministic input exported with the model: a real photo / real sentences where we have them."""
    if model.name == "mobilenet_v2":
        import skimage.data

        image = mobilenet.preprocess(skimage.data.chelsea())
        return {"pixel_values": np.repeat(image, batch, axis=0)}
    if model.name == "minilm":
        sentences = [sentence.SENTENCES[i % len(sentence.SENTENCES)] for i in range(batch)]
        return sentence.tokenize(sentences, seq)
    return make_inputs(model, batch=batch, seq=seq, seed=SEED)
