"""The zoo's model table: what each model is, how to build it in torch, and what it takes as input.

Architectures come from `transformers` configs with random, seeded weights (no downloads), plus the
two real-weight models (MobileNetV2 ImageNet, all-MiniLM-L6-v2) and plain-torch models no
transformers class covers (sensor.py: LSTM, bidirectional LSTM and GRU forecasters and a 1D-CNN; recommender.py: a
DCN).
Each full-size model has a small variant (few layers, narrow) that exports and runs in seconds for
CI; the full sizes are marked slow.

Random weights must still give outputs worth comparing: an init that makes every activation ~0
(transformers' std-0.02 convolutions in deep CNNs) or hides whole blocks (ConvNeXt's 1e-6 layer
scale) would let a wrong kernel pass. Such models take an init from _INITS (part of the cache key),
and tests/models/test_zoo.py checks that every CI model's output is finite, spread and
input-dependent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kiln.zoo import mobilenet, recommender, sensor, sentence

SEED = 0


# kind -> the graph inputs (make_inputs draws them)
KINDS = {
    "image": "pixel_values [B, 3, image_size, image_size]",
    "encoder": "input_ids [B, seq], attention_mask [B, seq]",
    "decoder": "input_ids [B, seq]",
    "seq2seq": "input_ids [B, seq], attention_mask [B, seq], decoder_input_ids [B, seq] (one decoder prefill)",
    "audio": "input_features [B, features, seq] (log-mel frames)",
    "waveform": "input_values [B, seq] (raw samples)",
    "sensor": "x [B, seq, features] (a window of readings)",
    "recommender": "dense [B, features], sparse [B, config['fields']] (one id per field)",
}


@dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str  # a key of KINDS: which inputs the graph takes
    description: str
    build: Callable[[], nn.Module]  # the torch model, eval mode, fp32
    config: dict = field(default_factory=dict)  # what defines it: part of the export cache key
    batch: int = 1
    seq: int = 16  # the length of the sequence axis: tokens, frames, samples or steps (see KINDS)
    image_size: int = 224  # for image models
    vocab_size: int = 0  # token ids (text) and categorical ids (recommender) are drawn in [0, vocab_size)
    features: int = 0  # mel bins (audio), readings per step (sensor), dense features (recommender)
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


class _Seq2SeqLogits(nn.Module):
    """The encoder over the source and one decoder prefill over `decoder_input_ids` (no KV cache)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                          use_cache=False).logits  # [B, S_dec, vocab]


class _AudioEncoderHidden(nn.Module):
    """An encoder-decoder speech model's encoder alone (the decoder's weights are dropped)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features=input_features).last_hidden_state  # [B, frames / 2, D]


class _WaveformHidden(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.model(input_values=input_values).last_hidden_state  # [B, frames, D]


class _Detections(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(pixel_values=pixel_values)
        return out.logits, out.pred_boxes  # [B, queries, classes + 1], [B, queries, 4] (cx, cy, w, h in 0..1)


def _init_like_torchvision(model: nn.Module, image_size: int = 0) -> None:
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


def _init_with_calibrated_batchnorm(model: nn.Module, image_size: int) -> None:
    """torchvision's init, then every BatchNorm's running statistics measured on random images, as
    training leaves them: the mean and variance the layer really sees. torchvision's fan-out He init
    alone still loses the signal in depthwise convolutions (fan out counts all C*k*k outputs, a
    depthwise output reads k*k inputs): EfficientNet's and MobileViT's logits then came from the
    BatchNorm shifts alone, the same for every image (rows of a batch equal to 3e-8). With measured
    statistics each BatchNorm renormalises, and the logits depend on the image."""
    _init_like_torchvision(model)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    generator = torch.Generator().manual_seed(SEED)
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the calibration batches
        m.train()  # batch statistics and running updates in the BatchNorms only; dropout stays off
    with torch.no_grad():
        for _ in range(4):
            model(pixel_values=torch.randn(8, 3, image_size, image_size, generator=generator))  # [8, 3, H, W]
    for m in norms:
        m.momentum = 0.1
        m.eval()


def _init_torch_default(model: nn.Module, image_size: int = 0) -> None:
    """torch's own init for every Linear and convolution (uniform in ±1/sqrt(fan_in)) in place of
    transformers' std 0.02: Swin's and YOLOS's heads otherwise output ~0.01 (YOLOS's boxes all 0.5
    to 3e-4), too small for a fixed fp32 tolerance to tell a wrong kernel from rounding. (YOLOS takes
    torchvision's init: its wider uniform heads spread the boxes 5x more than this one.)"""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            m.reset_parameters()  # draws from torch's global generator, seeded by _hf


def _init_he_convolutions(model: nn.Module, image_size: int = 0) -> None:
    """He normal (fan in) convolutions, transformers' init elsewhere. Whisper's std-0.02 input
    convolutions make the audio ~0.05 of the sinusoidal positions they are added to: the encoder's
    output then hardly depends on the audio (two inputs' outputs differ by 2% of their spread)."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv1d, nn.Conv2d)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


# name -> init(model, image_size): the names are part of the export cache key
_INITS: dict[str, Callable[[nn.Module, int], None]] = {
    "torchvision": _init_like_torchvision,
    "torchvision+calibrated_batchnorm": _init_with_calibrated_batchnorm,
    "torch_default": _init_torch_default,
    "he_convolutions": _init_he_convolutions,
}


def _hf(config_class: str, model_class: str, wrapper: type[nn.Module], config: dict,
        init: str | None = None, image_size: int = 0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(SEED)  # random weights, the same ones every time
        hf_config = getattr(transformers, config_class)(**config)
        model = getattr(transformers, model_class)(hf_config)
        if init is not None:
            _INITS[init](model, image_size)
        return wrapper(model).eval()
    return build


_WRAPPERS: dict[str, type[nn.Module]] = {
    "image": _ImageLogits, "encoder": _EncoderHidden, "decoder": _DecoderLogits, "seq2seq": _Seq2SeqLogits,
    "audio": _AudioEncoderHidden, "waveform": _WaveformHidden,
}


def _spec(name: str, kind: str, description: str, config_class: str, model_class: str, config: dict,
          init: str | None = None, wrapper: type[nn.Module] | None = None, **options) -> ZooModel:
    """init: a weight initialisation replacing transformers' own (a key of _INITS; part of the cache key).
    wrapper: what the exported graph returns, when not the kind's usual output (detection: logits and boxes)."""
    wrapper = wrapper or _WRAPPERS[kind]
    key = {"class": f"{config_class}/{model_class}", **config, **({"init": init} if init else {})}
    if wrapper is not _WRAPPERS[kind]:
        key["outputs"] = wrapper.__name__
    return ZooModel(name=name, kind=kind, description=description,
                    build=_hf(config_class, model_class, wrapper, config, init, options.get("image_size", 224)),
                    config=key, **options)


def _torch(name: str, kind: str, description: str, build: Callable[..., nn.Module], config: dict,
           **options) -> ZooModel:
    """A plain torch model: build(SEED, **config) returns it in eval mode."""
    key = {"arch": f"{build.__module__}.{build.__name__}", **config}
    return ZooModel(name=name, kind=kind, description=description, build=lambda: build(SEED, **config),
                    config=key, **options)


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

# ConvNeXt's layer scale starts at 1e-6: every block's output is multiplied by it, so the blocks add
# ~1e-6 to the residual stream and a wrong depthwise conv or LayerNorm would pass the comparisons.
# A trained ConvNeXt's scales are ~0.1-1; 0.5 makes each block count.
_CONVNEXT_T = dict(layer_scale_init_value=0.5, num_labels=1000)
_CONVNEXT_TINY = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], layer_scale_init_value=0.5,
                      image_size=64, num_labels=10)
_REGNET_TINY = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], groups_width=8,
                    layer_type="y", num_labels=10)
_DEIT_SMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                   num_labels=1000)
_DEIT_TINY = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, num_labels=10)
# Two blocks per stage: the second of each pair attends in shifted windows (roll + masked attention).
_SWIN_T = dict(drop_path_rate=0.0, num_labels=1000)
_SWIN_TINY = dict(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                  drop_path_rate=0.0, num_labels=10)
_MOBILEVIT_S = dict(num_labels=1000)
_MOBILEVIT_TINY = dict(image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 96],
                       expand_ratio=2.0, num_labels=10)
_DISTILBERT_TINY = dict(vocab_size=1024, dim=64, n_layers=2, n_heads=4, hidden_dim=256, max_position_embeddings=128)
_ROBERTA_BASE = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1)
_ROBERTA_TINY = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1)
_T5_SMALL = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
_T5_TINY = dict(vocab_size=1024, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
# Qwen2 / Mistral / Phi-3 at llama_small's size (8 layers, 512 wide, vocab 32000) for the slow runs;
# Qwen2's QKV projections carry biases, Mistral's sliding window is shorter than the sequence (the
# window mask is exercised), Phi-3 fuses QKV and gate/up into one weight each.
_QWEN2_SMALL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
_QWEN2_TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_MISTRAL_SMALL = dict(_QWEN2_SMALL, num_key_value_heads=4, sliding_window=64)
_MISTRAL_TINY = dict(_QWEN2_TINY, sliding_window=8)
_PHI3_SMALL = dict(vocab_size=32064, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                   original_max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_PHI3_TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                  original_max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Whisper's encoder takes exactly 2 * max_source_positions mel frames (30 s of audio for the real ones).
_WHISPER_BASE = dict(num_mel_bins=80, d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                     decoder_layers=6, decoder_attention_heads=8, decoder_ffn_dim=2048, max_source_positions=1500)
_WHISPER_TINY = dict(vocab_size=1024, num_mel_bins=16, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                     encoder_ffn_dim=128, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=128,
                     max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=0,
                     eos_token_id=0, decoder_start_token_id=0, begin_suppress_tokens=None)
_WAV2VEC2_BASE = dict(num_labels=2)
_WAV2VEC2_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      conv_dim=[32, 32, 32], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3],
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
# YOLOS-Ti's shape (hustvl/yolos-tiny) at 512x512 instead of 800x1333. transformers' std-0.02 heads put
# every box at 0.5 +- 3e-4 and the logits under 0.005: torchvision's init spreads them (boxes std 0.15).
_YOLOS_TI = dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                 image_size=[512, 512], num_detection_tokens=100, num_labels=91)
_YOLOS_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                   image_size=[64, 64], patch_size=8, num_detection_tokens=10, num_labels=10)
# DETR on transformers' own ResNet (no timm): the backbone's last stage -> a 1x1 projection -> an
# encoder over the feature map with sine positions -> a decoder over learned object queries. Its
# BatchNorms are frozen copies (DetrFrozenBatchNorm2d) at 0/1 statistics; torchvision's He convolutions
# keep the signal through them.
_DETR_R50 = dict(backbone_config={"model_type": "resnet", "out_features": ["stage4"]}, num_queries=100,
                 num_labels=91, dropout=0.0)
_DETR_TINY = dict(backbone_config={"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [32, 64, 128, 256],
                                   "depths": [1, 1, 1, 1], "layer_type": "basic", "out_features": ["stage4"]},
                  d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=128, decoder_ffn_dim=128, num_queries=10, num_labels=10, dropout=0.0)
_LSTM_FORECASTER = dict(features=16, hidden=128, layers=2, horizon=1)
_BILSTM_FORECASTER = dict(cell="LSTM", features=16, hidden=128, layers=2, horizon=1, bidirectional=True)
_GRU_FORECASTER = dict(cell="GRU", features=16, hidden=128, layers=2, horizon=1)
_TEMPORAL_CNN = dict(features=16, widths=[32, 64, 128], classes=6)
_CAUSAL_TCN = dict(features=16, channels=64, levels=4, kernel=3, horizon=1)
_DCN = dict(dense=13, fields=26, vocab=100_000, dim=32, cross_layers=4, mlp=[1024, 1024, 512])
_DCN_TINY = dict(dense=13, fields=26, vocab=1000, dim=8, cross_layers=2, mlp=[64, 32])

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
    _spec("efficientnet_b0", "image", "EfficientNet-B0 224, random weights (calibrated BatchNorm)",
          "EfficientNetConfig", "EfficientNetForImageClassification", _EFFICIENTNET_B0,
          init="torchvision+calibrated_batchnorm", slow=True),
    _spec("efficientnet_tiny", "image", "EfficientNet, width 0.25, one block per stage, 64px images",
          "EfficientNetConfig", "EfficientNetForImageClassification", _EFFICIENTNET_TINY,
          init="torchvision+calibrated_batchnorm", batch=2, image_size=64),
    _spec("convnext_t", "image", "ConvNeXt-T 224, random weights (layer scale 0.5)", "ConvNextConfig",
          "ConvNextForImageClassification", _CONVNEXT_T, slow=True),
    _spec("convnext_tiny", "image", "ConvNeXt, 4 stages 16-128 wide, 64px images (layer scale 0.5)",
          "ConvNextConfig", "ConvNextForImageClassification", _CONVNEXT_TINY, batch=2, image_size=64),
    _spec("regnet_y_040", "image", "RegNetY (transformers' default: 4.0GF shape) 224, random weights",
          "RegNetConfig", "RegNetForImageClassification", {"num_labels": 1000},
          init="torchvision+calibrated_batchnorm", slow=True),
    _spec("regnet_tiny", "image", "RegNetY, 4 stages 16-128 wide, group width 8, SE, 64px images",
          "RegNetConfig", "RegNetForImageClassification", _REGNET_TINY, init="torchvision+calibrated_batchnorm",
          batch=2, image_size=64),
    _spec("deit_small", "image", "DeiT-S/16 224, random weights", "DeiTConfig", "DeiTForImageClassification",
          _DEIT_SMALL, slow=True),
    _spec("deit_tiny", "image", "DeiT, 32px images, 8px patches, 2 layers, 64 wide", "DeiTConfig",
          "DeiTForImageClassification", _DEIT_TINY, batch=2, image_size=32),
    _spec("swin_t", "image", "Swin-T 224, random weights", "SwinConfig", "SwinForImageClassification", _SWIN_T,
          init="torch_default", slow=True),
    _spec("swin_tiny", "image", "Swin, 32px images, 2 stages of 2 blocks (shifted windows of 4), 16-32 wide",
          "SwinConfig", "SwinForImageClassification", _SWIN_TINY, init="torch_default", batch=2, image_size=32),
    _spec("mobilevit_s", "image", "MobileViT-S 256, random weights", "MobileViTConfig",
          "MobileViTForImageClassification", _MOBILEVIT_S, init="torchvision+calibrated_batchnorm",
          image_size=256, slow=True),
    _spec("mobilevit_tiny", "image", "MobileViT, 64px images, transformer blocks 32-64 wide", "MobileViTConfig",
          "MobileViTForImageClassification", _MOBILEVIT_TINY, init="torchvision+calibrated_batchnorm", batch=2,
          image_size=64),
    _spec("distilbert_base", "encoder", "DistilBERT-base uncased shape, random weights", "DistilBertConfig",
          "DistilBertModel", {}, seq=128, vocab_size=30522, slow=True),
    _spec("distilbert_tiny", "encoder", "DistilBERT, 2 layers, 64 wide", "DistilBertConfig", "DistilBertModel",
          _DISTILBERT_TINY, batch=2, vocab_size=1024),
    _spec("roberta_base", "encoder", "RoBERTa-base shape, random weights", "RobertaConfig", "RobertaModel",
          _ROBERTA_BASE, seq=128, vocab_size=50265, slow=True),
    _spec("roberta_tiny", "encoder", "RoBERTa, 2 layers, 64 wide", "RobertaConfig", "RobertaModel", _ROBERTA_TINY,
          batch=2, vocab_size=1024),
    _spec("t5_small_encoder", "encoder", "T5-small's encoder, random weights", "T5Config", "T5EncoderModel",
          _T5_SMALL, seq=128, vocab_size=32128, slow=True),
    _spec("t5_encoder_tiny", "encoder", "T5 encoder, 2 layers, 64 wide", "T5Config", "T5EncoderModel", _T5_TINY,
          batch=2, vocab_size=1024),
    _spec("t5_small", "seq2seq", "T5-small encoder + one decoder prefill (LM logits), random weights", "T5Config",
          "T5ForConditionalGeneration", _T5_SMALL, seq=128, vocab_size=32128, slow=True),
    _spec("t5_tiny", "seq2seq", "T5, 2+2 layers, 64 wide: encoder + one decoder prefill (LM logits)", "T5Config",
          "T5ForConditionalGeneration", _T5_TINY, batch=2, vocab_size=1024),
    _spec("qwen2_small", "decoder", "Qwen2, 8 layers, 512 wide, GQA 8/2 heads, QKV biases, random weights",
          "Qwen2Config", "Qwen2ForCausalLM", _QWEN2_SMALL, seq=128, vocab_size=32000, slow=True),
    _spec("qwen2_tiny", "decoder", "Qwen2, 2 layers, 64 wide, GQA 4/2 heads, QKV biases", "Qwen2Config",
          "Qwen2ForCausalLM", _QWEN2_TINY, batch=2, vocab_size=1024),
    _spec("mistral_small", "decoder", "Mistral, 8 layers, 512 wide, GQA 8/4, sliding window 64 < seq 128",
          "MistralConfig", "MistralForCausalLM", _MISTRAL_SMALL, seq=128, vocab_size=32000, slow=True),
    _spec("mistral_tiny", "decoder", "Mistral, 2 layers, 64 wide, GQA 4/2, sliding window 8 < seq 16",
          "MistralConfig", "MistralForCausalLM", _MISTRAL_TINY, batch=2, vocab_size=1024),
    _spec("phi3_small", "decoder", "Phi-3, 8 layers, 512 wide, fused QKV and gate/up, random weights",
          "Phi3Config", "Phi3ForCausalLM", _PHI3_SMALL, seq=128, vocab_size=32064, slow=True),
    _spec("phi3_tiny", "decoder", "Phi-3, 2 layers, 64 wide, fused QKV and gate/up", "Phi3Config",
          "Phi3ForCausalLM", _PHI3_TINY, batch=2, vocab_size=1024),
    _spec("whisper_base_encoder", "audio", "Whisper-base's encoder, 80 mel bins x 3000 frames (30 s), random weights",
          "WhisperConfig", "WhisperModel", _WHISPER_BASE, init="he_convolutions", seq=3000, features=80, slow=True),
    _spec("whisper_encoder_tiny", "audio", "Whisper encoder, 2 layers, 64 wide, 16 mel bins x 64 frames",
          "WhisperConfig", "WhisperModel", _WHISPER_TINY, init="he_convolutions", batch=2, seq=64, features=16),
    _spec("wav2vec2_base", "waveform", "Wav2Vec2-base, 1 s of 16 kHz audio, random weights", "Wav2Vec2Config",
          "Wav2Vec2Model", _WAV2VEC2_BASE, seq=16000, slow=True),
    _spec("wav2vec2_tiny", "waveform", "Wav2Vec2, 3 conv layers 32 wide, 2 transformer layers 64 wide, 1600 samples",
          "Wav2Vec2Config", "Wav2Vec2Model", _WAV2VEC2_TINY, batch=2, seq=1600),
    _spec("yolos_ti", "image", "YOLOS-Ti shape at 512x512, 100 detection tokens, random weights", "YolosConfig",
          "YolosForObjectDetection", _YOLOS_TI, init="torchvision", wrapper=_Detections, image_size=512, slow=True),
    _spec("yolos_tiny", "image", "YOLOS, 64px images, 8px patches, 2 layers, 64 wide, 10 detection tokens",
          "YolosConfig", "YolosForObjectDetection", _YOLOS_TINY, init="torchvision", wrapper=_Detections, batch=2,
          image_size=64),
    _spec("detr_r50", "image", "DETR with a ResNet-50 backbone at 512x512, 100 queries, random weights",
          "DetrConfig", "DetrForObjectDetection", _DETR_R50, init="torchvision", wrapper=_Detections, image_size=512,
          slow=True),
    _spec("detr_tiny", "image", "DETR, ResNet 16-256 backbone, 64px images, 1+2 layers 64 wide, 10 queries",
          "DetrConfig", "DetrForObjectDetection", _DETR_TINY, init="torchvision", wrapper=_Detections, batch=2,
          image_size=64),
    _torch("lstm_forecaster", "sensor", "2-layer LSTM forecaster, 16 readings -> 128 hidden, 96 steps",
           sensor.lstm_forecaster, _LSTM_FORECASTER, batch=8, seq=96, features=16),
    _torch("bilstm_forecaster", "sensor", "2-layer bidirectional LSTM forecaster, 16 readings -> 2x128 hidden, 96 steps",
           sensor.recurrent_forecaster, _BILSTM_FORECASTER, batch=8, seq=96, features=16),
    _torch("gru_forecaster", "sensor", "2-layer GRU forecaster, 16 readings -> 128 hidden, 96 steps",
           sensor.recurrent_forecaster, _GRU_FORECASTER, batch=8, seq=96, features=16),
    _torch("cnn1d", "sensor", "1D-CNN activity classifier: stem, strided and dilated residual blocks, 96 steps",
           sensor.temporal_cnn, _TEMPORAL_CNN, batch=8, seq=96, features=16),
    _torch("tcn", "sensor", "causal TCN forecaster: 4 residual blocks of dilated Conv1d (1, 2, 4, 8), 64 wide, 96 steps",
           sensor.causal_tcn, _CAUSAL_TCN, batch=8, seq=96, features=16),
    _torch("dcn", "recommender", "DCN-v2: 26 fields x 100k ids x 32, 4 cross layers, MLP 1024-1024-512",
           recommender.dcn, _DCN, batch=256, vocab_size=100_000, features=13, slow=True),
    _torch("dcn_tiny", "recommender", "DCN-v2: 26 fields x 1000 ids x 8, 2 cross layers, MLP 64-32",
           recommender.dcn, _DCN_TINY, batch=16, vocab_size=1000, features=13),
]}


def make_inputs(model: ZooModel, *, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs of the model's kind (KINDS): token ids in range (some rows padded), images,
    audio, sensor windows, or a recommender's dense features and categorical ids."""
    rng = np.random.default_rng(seed)
    if model.kind == "image":
        return {"pixel_values": rng.standard_normal((batch, 3, model.image_size, model.image_size), np.float32)}
    if model.kind == "audio":
        return {"input_features": rng.standard_normal((batch, model.features, seq), np.float32)}
    if model.kind == "waveform":
        return {"input_values": rng.standard_normal((batch, seq), np.float32)}
    if model.kind == "sensor":
        return {"x": rng.standard_normal((batch, seq, model.features), np.float32)}
    if model.kind == "recommender":
        return {"dense": rng.standard_normal((batch, model.features), np.float32),
                "sparse": rng.integers(0, model.vocab_size, (batch, model.config["fields"]), dtype=np.int64)}
    input_ids = rng.integers(0, model.vocab_size, (batch, seq), dtype=np.int64)
    if model.kind == "decoder":
        return {"input_ids": input_ids}
    attention_mask = np.ones((batch, seq), np.int64)
    for row in range(1, batch):  # rows after the first end in padding, so masking is exercised
        attention_mask[row, rng.integers(seq // 2, seq):] = 0
    if model.kind == "seq2seq":
        decoder_input_ids = rng.integers(0, model.vocab_size, (batch, seq), dtype=np.int64)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_input_ids}
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
