"""A ResNet bottleneck at the channel counts a test gives: every layer kind of ResNet-50 in one small model (a
strided stem with Relu, MaxPool, the 1x1 reduce, the 3x3, the 1x1 expand, a projection shortcut, the residual
Add -> Relu, global average pooling, the classifier)."""

from __future__ import annotations

import torch


class Bottleneck(torch.nn.Module):
    """stem: the stem's output channels (the block's input); width: the 3x3's channels; out: the block's output."""

    def __init__(self, stem: int, width: int, out: int, classes: int = 10):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, stem, 3, stride=2, padding=1)
        self.reduce = torch.nn.Conv2d(stem, width, 1)
        self.conv = torch.nn.Conv2d(width, width, 3, padding=1)
        self.expand = torch.nn.Conv2d(width, out, 1)
        self.shortcut = torch.nn.Conv2d(stem, out, 1)
        self.fc = torch.nn.Linear(out, classes)

    def forward(self, x):  # x: [N, 3, H, W]
        x = torch.nn.functional.max_pool2d(torch.relu(self.stem(x)), 3, 2, 1)  # [N, stem, H/4, W/4]
        y = self.expand(torch.relu(self.conv(torch.relu(self.reduce(x)))))  # [N, out, H/4, W/4]
        return self.fc(torch.relu(y + self.shortcut(x)).mean(dim=(2, 3)))  # [N, classes]
