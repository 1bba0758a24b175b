"""GPTQ weight rounding (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), for int8 per-channel weights (BuildConfig.gptq, --gptq; off by default).

Round-to-nearest picks each weight's integer alone. A layer's output error on its inputs x is
Σ_rows (ŵ - w)ᵀ H (ŵ - w) with H = E[x xᵀ] over the layer's input rows (a GEMM's rows, a convolution's
input patches), and GPTQ quantizes a row's columns in order, moving each column's rounding error onto the
columns not yet quantized (through the inverse Hessian's upper Cholesky factor U: w[j+1:] -= e/U[j,j]·U[j,j+1:])
so that they compensate it. The scale per output channel stays max|w|/127 (kiln/quant/qdq.py): only the
integers change. Dampening: 1% of H's mean diagonal added to the diagonal; an input column that was 0 on
every row gets 1 there (its weight then rounds to nearest: nothing reads it).

Session 20's lab (bench/quantacc3_lab.py gptq) measured half the INT8 weight error on MobileNetV2 so.

H is one matrix per group of a grouped convolution ([g, K, K], K = C/g·prod(kernel)): a depthwise
convolution's is per channel ([C, k·k, k·k]); a dense one's and a GEMM's one [1, K, K].
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from kiln.errors import KilnError

DAMP = 0.01
CHUNK_ROWS = 1 << 16  # rows of input patches multiplied at once (float64: K·64k·8 bytes)


def _ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    attr = node.attributes.get(name)
    return list(attr.value) if attr is not None else default


class SecondMoment:
    """E[x xᵀ] of one Conv/Gemm/MatMul layer's input rows over every calibration batch, in float64: [g, K, K].

    Conv (2-D, or 1-D as 2-D of height 1): the rows are the input patches the kernel reads (torch's unfold,
    channel-major then kernel position: the order of the weight [O, C/g, *k] flattened), padded as the node
    pads; Gemm/MatMul: the rows of x's last axis."""

    def __init__(self, node: ir.Node):
        self.op = node.op_type
        self.sum: torch.Tensor | None = None
        self.count = 0
        if self.op != "Conv":
            return
        auto_pad = node.attributes.get("auto_pad")
        if auto_pad is not None and auto_pad.value not in ("NOTSET", "VALID"):
            raise KilnError(f"gptq: Conv {node.name!r} has auto_pad {auto_pad.value}: explicit pads only")
        w_shape = node.inputs[1].const_value.shape
        self.kernel = list(w_shape[2:])
        if len(self.kernel) not in (1, 2):
            raise KilnError(f"gptq: Conv {node.name!r} is {len(self.kernel)}-D: 1-D and 2-D convolutions only")
        spatial = len(self.kernel)
        self.groups = node.attributes["group"].value if "group" in node.attributes else 1
        self.strides = _ints(node, "strides", [1] * spatial)
        self.dilations = _ints(node, "dilations", [1] * spatial)
        self.pads = _ints(node, "pads", [0] * 2 * spatial)
        if spatial == 1:  # as 2-D of height 1
            self.kernel, self.strides, self.dilations = [1] + self.kernel, [1] + self.strides, [1] + self.dilations
            self.pads = [0, self.pads[0], 0, self.pads[1]]

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """x as [g, rows, K] (float32) and the number of rows."""
        if self.op != "Conv":
            r = x.reshape(-1, x.shape[-1])
            return r[None], r.shape[0]
        if x.dim() == 3:
            x = x.unsqueeze(2)
        top, left, bottom, right = self.pads[0], self.pads[1], self.pads[2], self.pads[3]
        x = torch.nn.functional.pad(x.float(), (left, right, top, bottom))
        cols = torch.nn.functional.unfold(x, self.kernel, dilation=self.dilations, stride=self.strides)  # [N, C·k, L]
        n, ck, length = cols.shape
        k = ck // self.groups
        g = cols.reshape(n, self.groups, k, length).permute(1, 0, 3, 2).reshape(self.groups, n * length, k)
        return g, n * length

    def observe(self, x: torch.Tensor) -> None:
        if not x.numel():
            return
        g, count = self.rows(x.detach())
        total = None
        for start in range(0, count, CHUNK_ROWS):
            c = g[:, start:start + CHUNK_ROWS].double()
            part = c.transpose(1, 2) @ c
            total = part if total is None else total + part
        self.sum = total if self.sum is None else self.sum + total
        self.count += count

    def value(self) -> np.ndarray:
        """E[x xᵀ]: [g, K, K] (float64)."""
        if self.sum is None:
            return np.zeros((0, 0, 0))
        return (self.sum / self.count).numpy()


class Moments:
    """The SecondMoment of every quantized layer reading one tensor ({layer name: observer})."""

    def __init__(self, layers: dict[str, SecondMoment]):
        self.layers = layers

    def observe(self, x: torch.Tensor) -> None:
        for m in self.layers.values():
            m.observe(x)


def rows_of(w: np.ndarray, op_type: str, channel_axis: int) -> np.ndarray:
    """A weight as [output channels, K] in the order of SecondMoment's columns."""
    if op_type == "Conv":
        return w.reshape(w.shape[0], -1)
    return w.T if channel_axis == 1 else w  # Gemm/MatMul [K, N] -> [N, K]; Gemm transB [N, K]


def round_weights(w: np.ndarray, h: np.ndarray, scale: np.ndarray, qmax: float, damp: float = DAMP) -> np.ndarray:
    """The integers of GPTQ: w [R, K] (R output channels), h [g, K, K] (R/g rows per group), scale [R] -> [R, K]
    in [-qmax, qmax] (float64 holding integers)."""
    rows, k = w.shape
    groups = h.shape[0]
    if h.shape[1:] != (k, k) or rows % groups:
        raise KilnError(f"gptq: a weight of {rows}x{k} and second moments of {h.shape}")
    w = torch.from_numpy(np.asarray(w, np.float64)).clone().reshape(groups, rows // groups, k)
    s = torch.from_numpy(np.asarray(scale, np.float64)).reshape(groups, rows // groups)
    h = torch.from_numpy(np.asarray(h, np.float64)).clone()
    diag = torch.diagonal(h, dim1=1, dim2=2)  # a view: the updates below write into h
    dead = diag == 0
    diag += damp * diag.mean(1, keepdim=True) + dead.double()
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [g, K, K]
    q = torch.zeros_like(w)
    for j in range(k):
        column = w[:, :, j]  # [g, R/g]
        qc = torch.clamp(torch.round(column / s), -qmax, qmax)
        q[:, :, j] = qc
        err = (column - qc * s) / u[:, j, j][:, None]  # [g, R/g]
        w[:, :, j + 1:] -= err[:, :, None] * u[:, None, j, j + 1:]
    return q.reshape(rows, k).numpy()
