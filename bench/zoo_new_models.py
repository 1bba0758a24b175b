"""Models kiln was never tuned for (issue 11): architectures users bring that bench/zoo.py's rows do not cover.

Plain-torch CNNs written out as torchvision writes them (torchvision does not install next to this torch; see
kiln/zoo/mobilenet.py): DenseNet-121, SqueezeNet 1.1, ResNeXt-50 32x4d, ShuffleNetV2 x1.0, MobileNetV3-Large; a
YOLOv5n-style detector (CSP blocks, SPPF, a PAN neck with nearest upsampling, three heads) and a U-Net (transposed
convolutions, skip concatenations); and transformers encoders from configs: CLIP's text encoder, BART-base's encoder,
ELECTRA-small. All random weights, seeded, nothing downloaded.

Random weights must still give outputs worth comparing: the CNNs take He-normal convolutions and BatchNorm statistics
measured on random images (as training leaves them), so the logits depend on the image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

SEED = 0


def _divisible(v: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: the nearest multiple of 8, never more than 10% below v."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _conv_bn(inp: int, out: int, kernel: int, stride: int = 1, groups: int = 1,
             act: type[nn.Module] | None = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(out)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------------------------------ DenseNet-121

class _DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1 (bottleneck) -> BN-ReLU-Conv3x3, its growth concatenated to everything before it."""

    def __init__(self, inp: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(inp), nn.Conv2d(inp, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        return self.conv2(F.relu(self.norm2(self.conv1(F.relu(self.norm1(x))))))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 32, blocks: tuple[int, ...] = (6, 12, 24, 16), init_features: int = 64,
                 bn_size: int = 4, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, init_features, 7, 2, 3, bias=False), nn.BatchNorm2d(init_features),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        channels = init_features
        for i, n in enumerate(blocks):
            self.blocks.append(nn.ModuleList(_DenseLayer(channels + j * growth, growth, bn_size) for j in range(n)))
            channels += n * growth
            if i != len(blocks) - 1:
                self.transitions.append(nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(),
                                                      nn.Conv2d(channels, channels // 2, 1, bias=False),
                                                      nn.AvgPool2d(2, 2)))
                channels //= 2
        self.norm = nn.BatchNorm2d(channels)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            features = [x]
            for layer in block:
                features.append(layer(features))
            x = torch.cat(features, 1)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        x = F.adaptive_avg_pool2d(F.relu(self.norm(x)), 1)
        return self.classifier(torch.flatten(x, 1))


# ------------------------------------------------------------------------------------------------ SqueezeNet 1.1

class _Fire(nn.Module):
    def __init__(self, inp: int, squeeze: int, expand1: int, expand3: int):
        super().__init__()
        self.squeeze = nn.Conv2d(inp, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand1, 1)
        self.expand3 = nn.Conv2d(squeeze, expand3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.squeeze(x))
        return torch.cat([F.relu(self.expand1(x)), F.relu(self.expand3(x))], 1)


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1: max pools with ceil_mode, Fire modules, a 1x1 conv classifier and global average pooling."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, 2), nn.ReLU(), pool(), _Fire(64, 16, 64, 64), _Fire(128, 16, 64, 64), pool(),
            _Fire(128, 32, 128, 128), _Fire(256, 32, 128, 128), pool(), _Fire(256, 48, 192, 192),
            _Fire(384, 48, 192, 192), _Fire(384, 64, 256, 256), _Fire(512, 64, 256, 256))
        self.classifier = nn.Conv2d(512, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.classifier(self.features(x)))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


# ------------------------------------------------------------------------------------------------ ResNeXt-50 32x4d

class _Bottleneck(nn.Module):
    def __init__(self, inp: int, planes: int, stride: int, groups: int, base_width: int):
        super().__init__()
        width = int(planes * base_width / 64) * groups
        self.body = nn.Sequential(_conv_bn(inp, width, 1), _conv_bn(width, width, 3, stride, groups),
                                  _conv_bn(width, planes * 4, 1, act=None))
        self.down = _conv_bn(inp, planes * 4, 1, stride, act=None) if stride != 1 or inp != planes * 4 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.down is None else self.down(x)))


class ResNeXt(nn.Module):
    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), groups: int = 32, base_width: int = 4,
                 classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        stages, inp = [], 64
        for i, n in enumerate(layers):
            planes = 64 * 2 ** i
            for j in range(n):
                stages.append(_Bottleneck(inp, planes, 2 if j == 0 and i > 0 else 1, groups, base_width))
                inp = planes * 4
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inp, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ------------------------------------------------------------------------------------------------ ShuffleNetV2

def _channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class _ShuffleUnit(nn.Module):
    def __init__(self, inp: int, out: int, stride: int):
        super().__init__()
        self.stride = stride
        branch = out // 2
        if stride > 1:
            self.branch1 = nn.Sequential(_conv_bn(inp, inp, 3, stride, inp, act=None), _conv_bn(inp, branch, 1))
        self.branch2 = nn.Sequential(_conv_bn(inp if stride > 1 else branch, branch, 1),
                                     _conv_bn(branch, branch, 3, stride, branch, act=None), _conv_bn(branch, branch, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), 1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), 1)
        return _channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self, repeats: tuple[int, ...] = (4, 8, 4), channels: tuple[int, ...] = (24, 116, 232, 464, 1024),
                 classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, channels[0], 3, 2), nn.MaxPool2d(3, 2, 1))
        units, inp = [], channels[0]
        for n, out in zip(repeats, channels[1:]):
            units += [_ShuffleUnit(inp, out, 2)] + [_ShuffleUnit(out, out, 1) for _ in range(n - 1)]
            inp = out
        self.units = nn.Sequential(*units)
        self.last = _conv_bn(inp, channels[-1], 1)
        self.fc = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.last(self.units(self.stem(x)))
        return self.fc(x.mean([2, 3]))


# ------------------------------------------------------------------------------------------------ MobileNetV3-Large

class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        squeeze = _divisible(channels // 4)
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * scale


class _MobileV3Block(nn.Module):
    def __init__(self, inp: int, kernel: int, expanded: int, out: int, se: bool, act: type[nn.Module], stride: int):
        super().__init__()
        self.residual = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expanded != inp:
            layers.append(_conv_bn(inp, expanded, 1, act=act))
        layers.append(_conv_bn(expanded, expanded, kernel, stride, expanded, act=act))
        if se:
            layers.append(_SqueezeExcite(expanded))
        layers.append(_conv_bn(expanded, out, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV3Large(nn.Module):
    RE, HS = nn.ReLU, nn.Hardswish
    # input, kernel, expanded, output, squeeze-excite, activation, stride (torchvision's table)
    SETTINGS = [(16, 3, 16, 16, False, RE, 1), (16, 3, 64, 24, False, RE, 2), (24, 3, 72, 24, False, RE, 1),
                (24, 5, 72, 40, True, RE, 2), (40, 5, 120, 40, True, RE, 1), (40, 5, 120, 40, True, RE, 1),
                (40, 3, 240, 80, False, HS, 2), (80, 3, 200, 80, False, HS, 1), (80, 3, 184, 80, False, HS, 1),
                (80, 3, 184, 80, False, HS, 1), (80, 3, 480, 112, True, HS, 1), (112, 3, 672, 112, True, HS, 1),
                (112, 5, 672, 160, True, HS, 2), (160, 5, 960, 160, True, HS, 1), (160, 5, 960, 160, True, HS, 1)]

    def __init__(self, classes: int = 1000, last_channel: int = 1280):
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, 16, 3, 2, act=nn.Hardswish),
                                      *(_MobileV3Block(*s) for s in self.SETTINGS),
                                      _conv_bn(160, 960, 1, act=nn.Hardswish))
        self.classifier = nn.Sequential(nn.Linear(960, last_channel), nn.Hardswish(), nn.Linear(last_channel, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


# ------------------------------------------------------------------------------------------ YOLOv5n-style detector

class _C3(nn.Module):
    """YOLOv5's CSP block: two 1x1 branches, n bottlenecks (1x1, 3x3, residual) on one, concatenated, a 1x1 after."""

    def __init__(self, inp: int, out: int, n: int, shortcut: bool = True):
        super().__init__()
        hidden = out // 2
        self.cv1, self.cv2 = _conv_bn(inp, hidden, 1, act=nn.SiLU), _conv_bn(inp, hidden, 1, act=nn.SiLU)
        self.m = nn.ModuleList(nn.Sequential(_conv_bn(hidden, hidden, 1, act=nn.SiLU),
                                             _conv_bn(hidden, hidden, 3, act=nn.SiLU)) for _ in range(n))
        self.shortcut = shortcut
        self.cv3 = _conv_bn(2 * hidden, out, 1, act=nn.SiLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv1(x)
        for m in self.m:
            y = y + m(y) if self.shortcut else m(y)
        return self.cv3(torch.cat((y, self.cv2(x)), 1))


class _SPPF(nn.Module):
    def __init__(self, inp: int, out: int):
        super().__init__()
        hidden = inp // 2
        self.cv1, self.cv2 = _conv_bn(inp, hidden, 1, act=nn.SiLU), _conv_bn(hidden * 4, out, 1, act=nn.SiLU)
        self.pool = nn.MaxPool2d(5, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.pool(x)
        y2 = self.pool(y1)
        return self.cv2(torch.cat((x, y1, y2, self.pool(y2)), 1))


class YoloV5(nn.Module):
    """YOLOv5 v6's layout at width `w` (n: 16..256) and depth (1, 2, 3, 1 bottlenecks): a CSP-Darknet backbone, SPPF,
    a PAN neck, and 1x1 heads on strides 8/16/32 whose (x, y, w, h, objectness, classes) per anchor go through a
    sigmoid and are flattened to [B, anchors x cells, 5 + classes], as the exported detectors output them."""

    def __init__(self, w: int = 16, depth: tuple[int, ...] = (1, 2, 3, 1), classes: int = 80, anchors: int = 3):
        super().__init__()
        c = [w, 2 * w, 4 * w, 8 * w, 16 * w]
        self.b0 = _conv_bn(3, c[0], 6, 2, act=nn.SiLU)  # (YOLOv5 pads the 6x6 stem by 2)
        self.b0[0].padding = (2, 2)
        self.b1 = nn.Sequential(_conv_bn(c[0], c[1], 3, 2, act=nn.SiLU), _C3(c[1], c[1], depth[0]))
        self.b2 = nn.Sequential(_conv_bn(c[1], c[2], 3, 2, act=nn.SiLU), _C3(c[2], c[2], depth[1]))  # P3
        self.b3 = nn.Sequential(_conv_bn(c[2], c[3], 3, 2, act=nn.SiLU), _C3(c[3], c[3], depth[2]))  # P4
        self.b4 = nn.Sequential(_conv_bn(c[3], c[4], 3, 2, act=nn.SiLU), _C3(c[4], c[4], depth[3]), _SPPF(c[4], c[4]))
        self.lat4 = _conv_bn(c[4], c[3], 1, act=nn.SiLU)
        self.up4 = _C3(2 * c[3], c[3], depth[0], shortcut=False)
        self.lat3 = _conv_bn(c[3], c[2], 1, act=nn.SiLU)
        self.out3 = _C3(2 * c[2], c[2], depth[0], shortcut=False)
        self.down3 = _conv_bn(c[2], c[2], 3, 2, act=nn.SiLU)
        self.out4 = _C3(2 * c[2], c[3], depth[0], shortcut=False)
        self.down4 = _conv_bn(c[3], c[3], 3, 2, act=nn.SiLU)
        self.out5 = _C3(2 * c[3], c[4], depth[0], shortcut=False)
        self.outputs = 5 + classes
        self.anchors = anchors
        self.heads = nn.ModuleList(nn.Conv2d(ch, anchors * self.outputs, 1) for ch in (c[2], c[3], c[4]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p3 = self.b2(self.b1(self.b0(x)))
        p4 = self.b3(p3)
        l4 = self.lat4(self.b4(p4))
        n4 = self.up4(torch.cat((F.interpolate(l4, scale_factor=2.0, mode="nearest"), p4), 1))
        l3 = self.lat3(n4)
        o3 = self.out3(torch.cat((F.interpolate(l3, scale_factor=2.0, mode="nearest"), p3), 1))
        o4 = self.out4(torch.cat((self.down3(o3), l3), 1))
        o5 = self.out5(torch.cat((self.down4(o4), l4), 1))
        per_scale = []
        for head, feature in zip(self.heads, (o3, o4, o5)):
            y = head(feature)  # [B, A * O, H, W]
            b, _, h, w = y.shape
            y = y.view(b, self.anchors, self.outputs, h, w).permute(0, 1, 3, 4, 2)  # [B, A, H, W, O]
            per_scale.append(y.reshape(b, -1, self.outputs).sigmoid())
        return torch.cat(per_scale, 1)  # [B, cells x anchors, 5 + classes]


# ------------------------------------------------------------------------------------------------ U-Net

class UNet(nn.Module):
    """Ronneberger et al.'s U-Net with padded convolutions and BatchNorm (as segmentation repos write it): 4 levels
    down (two 3x3 conv-BN-ReLU, 2x2 max pool), up by 2x2 transposed convolutions, skip concatenations, a 1x1 head."""

    def __init__(self, channels: int = 3, classes: int = 2, base: int = 32, levels: int = 4):
        super().__init__()
        double = lambda i, o: nn.Sequential(_conv_bn(i, o, 3), _conv_bn(o, o, 3))  # noqa: E731
        widths = [base * 2 ** i for i in range(levels + 1)]
        self.down = nn.ModuleList([double(channels, widths[0])] +
                                  [double(widths[i], widths[i + 1]) for i in range(levels)])
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2) for i in reversed(range(levels)))
        self.merge = nn.ModuleList(double(2 * widths[i], widths[i]) for i in reversed(range(levels)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()
        for up, merge in zip(self.up, self.merge):
            x = merge(torch.cat((skips.pop(), up(x)), 1))
        return self.head(x)  # [B, classes, H, W]


# ------------------------------------------------------------------------------------------------ transformers encoders

class _TextEncoder(nn.Module):
    """A transformers encoder (or an encoder-decoder's encoder alone) -> last_hidden_state [B, S, D]."""

    def __init__(self, model: nn.Module, encoder_of_seq2seq: bool):
        super().__init__()
        self.encoder = model.get_encoder() if encoder_of_seq2seq else model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _transformers(config_class: str, model_class: str, config: dict,
                  encoder_of_seq2seq: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(SEED)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        return _TextEncoder(model, encoder_of_seq2seq).eval()
    return build


def _calibrated(make: Callable[[], nn.Module], image_size: int, channels: int = 3) -> Callable[[], nn.Module]:
    """torchvision's init (He normal fan-out convolutions, unit BatchNorm scales, small Linear weights), then every
    BatchNorm's running statistics measured on random images: without them the deep plain stacks (DenseNet,
    SqueezeNet) lose the signal, and the logits come out the same for every image."""
    def build() -> nn.Module:
        torch.manual_seed(SEED)
        model = make()
        generator = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=generator)
                    if m.bias is not None:
                        m.bias.uniform_(-0.1, 0.1, generator=generator)
                elif isinstance(m, nn.BatchNorm2d):
                    m.weight.uniform_(0.5, 1.5, generator=generator)
                    m.bias.uniform_(-0.1, 0.1, generator=generator)
                elif isinstance(m, nn.Linear):
                    bound = m.in_features ** -0.5
                    m.weight.uniform_(-bound, bound, generator=generator)
                    nn.init.zeros_(m.bias)
        norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the calibration batches
            m.train()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, channels, image_size, image_size, generator=generator))
        for m in norms:
            m.momentum = 0.1
            m.eval()
        return model.eval()
    return build


@dataclass(frozen=True)
class NewModel:
    name: str
    description: str
    build: Callable[[], nn.Module]
    config: dict  # what defines it: the export cache key
    kind: str  # "image" (pixel_values / x [B, 3, S, S]) or "text" (input_ids, attention_mask [B, S])
    size: int  # image side or sequence length
    batches: tuple[int, ...]  # the batch sizes the bench runs
    vocab: int = 0

    def inputs(self, batch: int, seed: int = SEED) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        if self.kind == "image":
            return {"x": rng.standard_normal((batch, 3, self.size, self.size), np.float32)}
        ids = rng.integers(0, self.vocab, (batch, self.size), dtype=np.int64)
        mask = np.ones((batch, self.size), np.int64)
        for row in range(1, batch):  # rows after the first end in padding, so masking is exercised
            mask[row, rng.integers(self.size // 2, self.size):] = 0
        return {"input_ids": ids, "attention_mask": mask}


_CLIP_TEXT = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=8, max_position_embeddings=77)
_BART_BASE = dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, max_position_embeddings=1024)
_ELECTRA_SMALL = dict(vocab_size=30522, embedding_size=128, hidden_size=256, num_hidden_layers=12,
                      num_attention_heads=4, intermediate_size=1024)

MODELS: dict[str, NewModel] = {m.name: m for m in [
    NewModel("densenet121", "DenseNet-121 224 (growth 32, blocks 6-12-24-16)", _calibrated(DenseNet, 224),
             {"arch": "densenet121"}, "image", 224, (1,)),
    NewModel("squeezenet1_1", "SqueezeNet 1.1 224", _calibrated(SqueezeNet, 224), {"arch": "squeezenet1_1"},
             "image", 224, (1, 8)),
    NewModel("resnext50", "ResNeXt-50 32x4d 224", _calibrated(ResNeXt, 224), {"arch": "resnext50_32x4d"},
             "image", 224, (1,)),
    NewModel("shufflenet_v2", "ShuffleNetV2 x1.0 224", _calibrated(ShuffleNetV2, 224), {"arch": "shufflenet_v2_x1_0"},
             "image", 224, (1, 8)),
    NewModel("mobilenet_v3", "MobileNetV3-Large 224 (hardswish, SE)", _calibrated(MobileNetV3Large, 224),
             {"arch": "mobilenet_v3_large"}, "image", 224, (1, 8)),
    NewModel("yolov5n", "YOLOv5n-style detector 416 (CSP, SPPF, PAN, 3 heads, 80 classes)",
             _calibrated(YoloV5, 416), {"arch": "yolov5n", "w": 16}, "image", 416, (1,)),
    NewModel("unet", "U-Net 256, 32-512 wide, 4 levels, transposed convolutions", _calibrated(UNet, 256),
             {"arch": "unet", "base": 32}, "image", 256, (1,)),
    NewModel("clip_text", "CLIP ViT-B/32's text encoder (12 layers, 512 wide, causal), 77 tokens",
             _transformers("CLIPTextConfig", "CLIPTextModel", _CLIP_TEXT), {"class": "CLIPTextModel", **_CLIP_TEXT},
             "text", 77, (1, 8), vocab=49408),
    NewModel("bart_encoder", "BART-base's encoder (6 layers, 768 wide), 128 tokens",
             _transformers("BartConfig", "BartModel", _BART_BASE, encoder_of_seq2seq=True),
             {"class": "BartModel/encoder", **_BART_BASE},
             "text", 128, (1, 8), vocab=50265),
    NewModel("electra_small", "ELECTRA-small discriminator body (12 layers, 256 wide), 128 tokens",
             _transformers("ElectraConfig", "ElectraModel", _ELECTRA_SMALL),
             {"class": "ElectraModel", **_ELECTRA_SMALL},
             "text", 128, (1, 8), vocab=30522),
]}


def export(name: str, batch: int):
    """The cached ONNX export of `name` at `batch` (kiln.zoo's cache: exported once per set of versions)."""
    from kiln.zoo import cached_export, export_module, offline

    model = MODELS[name]

    def run_export(folder):
        with offline():
            return export_module(model.build(), model.inputs(batch), folder)

    return cached_export(f"new-{name}", {**model.config, "batch": batch, "size": model.size}, run_export)
