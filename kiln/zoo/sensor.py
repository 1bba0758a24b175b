"""Sensor-data models written in plain torch (no transformers class fits): recurrent forecasters (LSTM, bidirectional
LSTM, GRU), a 1D-CNN and a causal TCN, all over a window of readings `x: [batch, steps, features]`, as users write them.

torch.onnx.export(dynamo=True) turns each nn.LSTM layer into an ONNX LSTM node and each Conv1d into a
Conv with one spatial axis, so these exercise kiln's recurrent and 1D-convolution paths end to end.
"""

from __future__ import annotations

import torch
from torch import nn


class LSTMForecaster(nn.Module):
    """A stacked LSTM over the window and a linear head on the last step: the next `horizon` values."""

    def __init__(self, features: int = 16, hidden: int = 128, layers: int = 2, horizon: int = 1):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)  # y: [B, S, H]
        return self.head(y[:, -1])  # [B, horizon]


class RecurrentForecaster(nn.Module):
    """A stacked recurrent body (nn.LSTM or nn.GRU, one or two directions) over the window and a linear head on the
    last step. torch.onnx.export writes a bidirectional layer as one ONNX node whose Y [S, 2, N, H] a Transpose and a
    Reshape turn into the next layer's [S, N, 2·H] input."""

    def __init__(self, cell: str = "GRU", features: int = 16, hidden: int = 128, layers: int = 2, horizon: int = 1,
                 bidirectional: bool = False):
        super().__init__()
        kind = {"LSTM": nn.LSTM, "GRU": nn.GRU}[cell]
        self.body = kind(features, hidden, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.body(x)  # y: [B, S, D·H]
        return self.head(y[:, -1])  # [B, horizon]


class _ConvBlock(nn.Sequential):
    def __init__(self, inp: int, out: int, kernel: int, stride: int = 1, dilation: int = 1):
        padding = dilation * (kernel - 1) // 2
        super().__init__(nn.Conv1d(inp, out, kernel, stride, padding, dilation=dilation, bias=False),
                         nn.BatchNorm1d(out), nn.ReLU())


class TemporalCNN(nn.Module):
    """A 1D-CNN activity classifier: a wide stem, strided blocks, dilated residual blocks (a TCN's
    receptive field without recurrence), global average pooling over time, a linear head."""

    def __init__(self, features: int = 16, widths: tuple[int, ...] = (32, 64, 128), classes: int = 6):
        super().__init__()
        layers: list[nn.Module] = [_ConvBlock(features, widths[0], kernel=7)]
        channels = widths[0]
        for width in widths[1:]:
            layers.append(_ConvBlock(channels, width, kernel=5, stride=2))
            channels = width
        self.stem = nn.Sequential(*layers)
        self.residual = nn.ModuleList(_ConvBlock(channels, channels, kernel=3, dilation=d) for d in (2, 4))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x.transpose(1, 2))  # [B, F, S] -> [B, C, S / 2^(len(widths)-1)]
        for block in self.residual:
            y = y + block(y)  # [B, C, S']
        return self.head(y.mean(dim=2))  # [B, classes]


class _CausalBlock(nn.Module):
    """Two causal dilated convolutions, each followed by ReLU, and the residual (a 1x1 convolution where the width
    changes). Causal as the TCN reference code writes it: padded (k-1)·d on both sides, the last (k-1)·d steps cut
    off, so that step t reads steps t - (k-1)·d .. t only."""

    def __init__(self, inp: int, out: int, kernel: int, dilation: int):
        super().__init__()
        self.cut = (kernel - 1) * dilation
        self.conv1 = nn.Conv1d(inp, out, kernel, padding=self.cut, dilation=dilation)
        self.conv2 = nn.Conv1d(out, out, kernel, padding=self.cut, dilation=dilation)
        self.down = nn.Conv1d(inp, out, 1) if inp != out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, S]
        y = torch.relu(self.conv1(x)[:, :, :-self.cut])
        y = torch.relu(self.conv2(y)[:, :, :-self.cut])
        return torch.relu(y + (x if self.down is None else self.down(x)))


class CausalTCN(nn.Module):
    """A temporal convolutional network (Bai, Kolter and Koltun, 2018) as sensor forecasters use it: residual blocks of
    causal dilated convolutions, the dilation doubling per block (receptive field 1 + 2·(k-1)·(2^levels - 1) steps), a
    linear head on the last step."""

    def __init__(self, features: int = 16, channels: int = 64, levels: int = 4, kernel: int = 3, horizon: int = 1):
        super().__init__()
        self.blocks = nn.Sequential(*(_CausalBlock(features if i == 0 else channels, channels, kernel, 2 ** i)
                                      for i in range(levels)))
        self.head = nn.Linear(channels, horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(x.transpose(1, 2))  # [B, F, S] -> [B, C, S]
        return self.head(y[:, :, -1])  # [B, horizon]


def init_like_keras(lstm: nn.LSTM | nn.GRU, generator: torch.Generator) -> None:
    """Keras' LSTM init (what many forecasters are trained from): Glorot-uniform input weights and
    orthogonal recurrent weights per gate, zero biases but 1 on the forget gate. torch's uniform(±1/sqrt(H))
    leaves the second layer's pre-activations ~0.04: its output is mostly biases, and the forecast
    moved by 0.02 between two input windows against 0.07 of offset."""
    is_lstm = isinstance(lstm, nn.LSTM)
    with torch.no_grad():
        for name, weight in lstm.named_parameters():
            # torch's gate order: LSTM input, forget, cell, output; GRU reset, update, new
            gates = weight.chunk(4 if is_lstm else 3, dim=0)
            if name.startswith("weight_ih"):
                for gate in gates:
                    nn.init.xavier_uniform_(gate, generator=generator)
            elif name.startswith("weight_hh"):
                for gate in gates:
                    nn.init.orthogonal_(gate, generator=generator)
            else:
                weight.zero_()
                if is_lstm and name.startswith("bias_ih"):
                    gates[1].fill_(1.0)


def calibrate_batchnorm(model: nn.Module, features: int, generator: torch.Generator, steps: int = 96) -> None:
    """Random BatchNorm affine parameters, and running statistics measured on random windows, as
    training leaves them. With torch's default init and BatchNorm's 0/1 statistics each block shrinks
    the signal, and the logits came out the same for every window to 2%."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    model.eval()
    with torch.no_grad():
        for m in norms:
            m.weight.uniform_(0.5, 1.5, generator=generator)
            m.bias.uniform_(-0.1, 0.1, generator=generator)
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the calibration batches
            m.train()  # batch statistics in the BatchNorms only
        for _ in range(4):
            model(torch.randn(8, steps, features, generator=generator))  # [8, S, F]
    for m in norms:
        m.momentum = 0.1
        m.eval()


def lstm_forecaster(seed: int, **config) -> LSTMForecaster:
    torch.manual_seed(seed)
    model = LSTMForecaster(**config)
    init_like_keras(model.lstm, torch.Generator().manual_seed(seed))
    return model.eval()


def recurrent_forecaster(seed: int, **config) -> RecurrentForecaster:
    """The zoo's bidirectional LSTM and GRU forecasters (Keras' init, as lstm_forecaster)."""
    torch.manual_seed(seed)
    model = RecurrentForecaster(**config)
    init_like_keras(model.body, torch.Generator().manual_seed(seed))
    return model.eval()


def temporal_cnn(seed: int, **config) -> TemporalCNN:
    torch.manual_seed(seed)
    model = TemporalCNN(**config)
    calibrate_batchnorm(model, config.get("features", 16), torch.Generator().manual_seed(seed))
    return model.eval()


def causal_tcn(seed: int, **config) -> CausalTCN:
    torch.manual_seed(seed)
    return CausalTCN(**config).eval()
