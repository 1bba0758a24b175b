"""Signal processing: DFT, STFT, window functions, MelWeightMatrix.

ONNX carries complex values as a trailing axis of 2 (real, imaginary); a trailing axis of 1
is a real signal. torch.fft does the transforms (CPU and CUDA), computed in
float64, as the reference does (exact zeros stay zeros).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ops._util import from_numpy, scalar, torch_dtype
from kiln.ops.registry import register


def _to_complex(x: torch.Tensor) -> torch.Tensor:
    """[..., 1] real or [..., 2] (re, im) -> complex [...]."""
    x = x.double()  # float64 like the reference: float32 FFTs leave ~1e-6 noise in exact zeros
    if x.shape[-1] == 1:
        return x[..., 0].to(torch.complex128)
    return torch.complex(x[..., 0].contiguous(), x[..., 1].contiguous())


def _from_complex(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.view_as_real(z.resolve_conj()).to(dtype)


@register("DFT", min_opset=17)
def dft(ctx, input, dft_length=None, axis_input=None, *, axis=1, inverse=0, onesided=0):
    """opset 17: axis is an attribute (default 1); opset 20: an optional input (default -2)."""
    if ctx.opset >= 20:
        axis = -2 if axis_input is None else int(scalar(axis_input))
    axis = axis % input.dim()
    if dft_length is not None:
        n = int(scalar(dft_length))
    elif inverse and onesided:
        n = 2 * (input.shape[axis] - 1)
    else:
        n = input.shape[axis]
    z = _to_complex(input)
    if inverse and onesided:  # one-sided spectrum -> real signal
        real = torch.fft.irfft(z, n=n, dim=axis)
        return real.unsqueeze(-1).to(input.dtype)
    out = torch.fft.ifft(z, n=n, dim=axis) if inverse else torch.fft.fft(z, n=n, dim=axis)
    if onesided:
        out = out.narrow(axis, 0, n // 2 + 1)
    return _from_complex(out, input.dtype)


@register("STFT", min_opset=17)
def stft(ctx, signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """signal [B, T, 1|2] -> [B, frames, bins, 2]; frames = 1 + (T - frame_length) // step."""
    step = int(scalar(frame_step))
    if frame_length is not None:
        length = int(scalar(frame_length))
    elif window is not None:
        length = window.shape[0]
    else:
        raise ValueError("STFT needs a window or a frame_length")
    z = _to_complex(signal)  # [B, T]
    frames = z.unfold(1, length, step)  # [B, frames, length]
    if window is not None:
        frames = frames * window.to(frames.real.dtype)
    spectrum = torch.fft.fft(frames, n=length, dim=-1)
    if onesided:
        spectrum = spectrum[..., : length // 2 + 1]
    return _from_complex(spectrum, signal.dtype)


def _window(size, output_datatype: int, periodic: int, coefficients: list[float]) -> torch.Tensor:
    """Generalized cosine window: w[n] = sum_k (-1)^k a_k cos(2πkn / N), N = size or size-1."""
    n_total = int(scalar(size))
    denominator = n_total if periodic else n_total - 1
    n = torch.arange(n_total, dtype=torch.float64)
    w = torch.zeros(n_total, dtype=torch.float64)
    for k, a in enumerate(coefficients):
        w += (-1) ** k * a * torch.cos(2 * math.pi * k * n / denominator)
    device = size.device if isinstance(size, torch.Tensor) else None
    return w.to(dtype=torch_dtype(output_datatype), device=device)


@register("HannWindow", min_opset=17)
def hann_window(ctx, size, *, output_datatype=1, periodic=1):
    return _window(size, output_datatype, periodic, [0.5, 0.5])


@register("HammingWindow", min_opset=17)
def hamming_window(ctx, size, *, output_datatype=1, periodic=1):
    return _window(size, output_datatype, periodic, [25 / 46, 1 - 25 / 46])


@register("BlackmanWindow", min_opset=17)
def blackman_window(ctx, size, *, output_datatype=1, periodic=1):
    return _window(size, output_datatype, periodic, [0.42, 0.5, 0.08])


@register("MelWeightMatrix", min_opset=17)
def mel_weight_matrix(ctx, num_mel_bins, dft_length, sample_rate, lower_edge_hertz,
                      upper_edge_hertz, *, output_datatype=1):
    """[dft_length // 2 + 1, num_mel_bins] triangular filters, evenly spaced on the mel scale."""
    bins, length = int(scalar(num_mel_bins)), int(scalar(dft_length))
    rate = scalar(sample_rate)
    low, high = scalar(lower_edge_hertz), scalar(upper_edge_hertz)
    low_mel = 2595 * np.log1p(low / 700) / np.log(10)
    high_mel = 2595 * np.log1p(high / 700) / np.log(10)
    points = np.arange(0, bins + 2)
    mel_step = (high_mel - low_mel) / points.shape[0]
    hertz = 700 * np.expm1((points * mel_step + low_mel) / 2595 * np.log(10))
    edges = (((length + 1) * hertz) // rate).astype(int)  # filter edges as DFT bin indices
    out = np.zeros((length // 2 + 1, bins))
    for i in range(bins):
        left, center, right = edges[i], edges[i + 1], edges[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            for j in range(left, center + 1):
                out[j, i] = (j - left) / (center - left)
        for j in range(center, right):
            out[j, i] = (right - j) / (right - center)
    torch_type = torch_dtype(output_datatype)
    return from_numpy(out).to(torch_type) if torch_type is not None else out
