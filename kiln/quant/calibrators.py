"""Calibrators: from the values a tensor takes on calibration data to the range (amax) its
quantization covers, symmetric around 0 as TensorRT quantizes activations.

    minmax       amax = max |x| seen: nothing clipped, coarse steps when there are outliers
    percentile   amax = the p-th percentile of |x| (99.99 by default): the rare outliers clipped
    mse          the amax with the smallest squared error of the quantized values (clipping + rounding)
    entropy      TensorRT's: the amax whose quantized distribution is closest (KL divergence) to the
                 observed one, over a histogram of |x| (2048 bins, 128 levels: int8's positive half; 256
                 for a one-sided activation quantized to uint8 over [0, amax], `one_sided`)

A histogram's range grows as larger values arrive: bins are merged pairwise, doubling the range,
so every value seen is counted without a second pass over the data.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BINS = 2048
LEVELS = 128  # int8 symmetric: 0..127 positive levels (and 127 negative)
ONE_SIDED_LEVELS = 256  # uint8 over [0, amax] (a Relu's, a ReLU6's output): all 256 codes on |x| = x


class Calibrator:
    """Collects one tensor's values (observe) and gives the range to quantize (amax)."""

    name = ""

    def observe(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def amax(self) -> float:
        raise NotImplementedError


class MinMax(Calibrator):
    name = "minmax"

    def __init__(self):
        self._max = 0.0

    def observe(self, x: torch.Tensor) -> None:
        if x.numel():
            self._max = max(self._max, float(x.detach().abs().max()))

    def amax(self) -> float:
        return self._max


class Histogram(Calibrator):
    """|x| counted in BINS equal bins over [0, width * BINS); the width doubles when a value falls outside."""

    def __init__(self):
        self.counts = np.zeros(BINS, np.float64)
        self.width = 0.0

    def observe(self, x: torch.Tensor) -> None:
        values = x.detach().abs().float().reshape(-1)
        if not values.numel():
            return
        top = float(values.max())
        if self.width == 0.0:
            self.width = (top if top > 0 else 1.0) / BINS
        while top >= self.width * BINS:  # merge pairs of bins: the range doubles
            self.counts = self.counts.reshape(-1, 2).sum(1)
            self.counts = np.concatenate([self.counts, np.zeros(BINS // 2)])
            self.width *= 2
        hist = torch.histc(values, bins=BINS, min=0.0, max=self.width * BINS).double().numpy()
        hist[0] -= float((values == 0).sum())  # exact zeros (a ReLU's half) quantize exactly: not counted
        self.counts += hist

    def edges(self) -> np.ndarray:
        return np.arange(1, BINS + 1) * self.width  # upper edge of each bin


class Percentile(Histogram):
    name = "percentile"

    def __init__(self, percentile: float = 99.99):
        super().__init__()
        self.percentile = percentile

    def amax(self) -> float:
        total = self.counts.sum()
        if total == 0:
            return 0.0
        cumulative = np.cumsum(self.counts) / total
        index = int(np.searchsorted(cumulative, self.percentile / 100.0))
        return float(self.edges()[min(index, BINS - 1)])


class Entropy(Histogram):
    """TensorRT's entropy calibration (KL divergence between the observed and the quantized distribution),
    with two refinements: exact zeros are left out of the histogram (they quantize exactly, and a ReLU's
    spike at 0 would otherwise pull the range in), and the candidate distribution is smoothed where it is
    empty but the reference is not (else a sparse tail makes every divergence infinite)."""

    name = "entropy"

    def __init__(self, levels: int = LEVELS):
        super().__init__()
        self.levels = levels  # the quantized grid's steps over [0, amax]: 128 (int8), 256 (uint8, one-sided)

    def amax(self) -> float:
        counts, levels = self.counts, self.levels
        if counts.sum() == 0:
            return 0.0
        last = int(np.nonzero(counts)[0][-1]) + 1
        if last <= levels:  # every value fits the levels exactly: nothing to clip
            return float(last * self.width)
        best, best_kl = last, math.inf
        for i in range(levels, last + 1, max(1, (last - levels) // 256)):
            reference = counts[:i].copy()
            reference[i - 1] += counts[i:].sum()  # what is clipped lands in the last bin
            # quantize the first i bins into `levels` levels (np.array_split's grouping), then spread
            # each level back over its non-empty bins
            sizes = np.full(levels, i // levels)
            sizes[: i % levels] += 1
            level = np.repeat(np.arange(levels), sizes)  # bin -> its level
            chunk = counts[:i]
            nonzero = chunk > 0
            sums = np.bincount(level, weights=chunk, minlength=levels)
            filled = np.bincount(level, weights=nonzero, minlength=levels)
            per_bin = np.divide(sums, filled, out=np.zeros(levels), where=filled > 0)
            candidate = np.where(nonzero, per_bin[level], 0.0)
            kl = _kl(reference, candidate)
            if kl < best_kl:
                best, best_kl = i, kl
        return float((best + 0.5) * self.width)


class MSE(Histogram):
    """The amax whose quantization of the observed values has the smallest mean squared error, clipping
    and rounding together (TensorRT ModelOpt's "mse" calibrator), over the histogram of |x|: each bin's
    values taken at its centre, quantized to `levels` uniform steps over [0, amax] (int8: 127; uint8 over
    [0, amax]: 255) or, fp8, to E4M3's grid scaled so that 448 lands on amax. The candidates are the
    upper edges of the bins from 1/64 of the observed maximum up to it (128 of them, evenly spaced)."""

    name = "mse"
    CANDIDATES = 128

    def __init__(self, levels: int = LEVELS - 1, fp8: bool = False):
        super().__init__()
        self.levels, self.fp8 = levels, fp8

    def amax(self) -> float:
        counts = self.counts
        if counts.sum() == 0:
            return 0.0
        nonzero = np.nonzero(counts)[0]
        last = int(nonzero[-1]) + 1  # the bins up to the largest value seen
        used = nonzero[nonzero < last]
        centres = (used + 0.5) * self.width
        weights = counts[used]
        first = max(1, last // 64)
        candidates = np.unique(np.linspace(first, last, self.CANDIDATES).round().astype(np.int64))
        amaxes = candidates * self.width  # [K]
        x = centres[None, :] / amaxes[:, None]  # [K, bins] in units of amax
        if self.fp8:
            import ml_dtypes
            scaled = np.minimum(x * FP8_MAX, FP8_MAX).astype(np.float32)
            q = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / FP8_MAX
        else:
            q = np.minimum(np.round(x * self.levels), self.levels) / self.levels
        errors = (((x - q) * amaxes[:, None]) ** 2 * weights[None, :]).sum(1)
        return float(amaxes[int(np.argmin(errors))])


FP8_MAX = 448.0


def _smooth(d: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """A distribution with eps moved onto each empty bin from the non-empty ones (MXNet/TVM's smoothing)."""
    zeros = d == 0
    n_zero, n_nonzero = int(zeros.sum()), int((~zeros).sum())
    if n_zero == 0 or n_nonzero == 0:
        return d
    return d + eps * zeros - (eps * n_zero / n_nonzero) * ~zeros


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    if p.sum() == 0 or q.sum() == 0:
        return math.inf
    p = _smooth(p / p.sum())
    q = _smooth(q / q.sum())
    mask = p > 0
    if np.any(q[mask] <= 0):
        return math.inf
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


CALIBRATORS = {"minmax": MinMax, "percentile": Percentile, "entropy": Entropy, "mse": MSE}


def make(name: str, one_sided: bool = False, fp8: bool = False) -> Calibrator:
    """The calibrator `name`; one_sided: the activation is quantized to uint8 over [0, amax] (entropy's KL
    search then compares against 256 levels, not int8's 128: TensorRT's 128 assumes a symmetric grid;
    mse's against 255 steps, not 127); fp8: to E4M3 (mse's error is measured on that grid)."""
    if name not in CALIBRATORS:
        raise ValueError(f"no calibrator {name!r}; kiln has {sorted(CALIBRATORS)}")
    if name == "entropy":
        return Entropy(ONE_SIDED_LEVELS if one_sided else LEVELS)
    if name == "mse":
        return MSE(ONE_SIDED_LEVELS - 1 if one_sided else LEVELS - 1, fp8)
    return CALIBRATORS[name]()


class PerChannel:
    """One range per channel (axis 1 of an NCHW activation), for the inputs of depthwise convolutions,
    whose output channel c reads input channel c only, so that a per-channel input scale folds into the
    layer's per-channel weight scale (kiln/passes/fusion/qdq_layers.py). amax() is then an array [C].

    minmax keeps one maximum per channel; percentile one histogram per channel, counted for every channel
    at once (one bincount over channel·BINS + bin) and each channel's width doubling as in Histogram, then
    its rule per channel. entropy: the KL search needs many samples per bin (a channel of a 7x7 map on 38
    images has ~1,900 values for 2,048 bins: its sparse histogram's noise makes the divergence favour
    the smallest candidate, clipping most of the channel; MobileNetV2 int8 fell 0.757 -> 0.541 so), so the
    threshold T is searched once on the whole tensor's histogram, as without per-channel scales, and
    each channel gets min(its own maximum, T): the channels narrower than T gain finer steps, the others
    are clipped exactly as per tensor."""

    name = "per-channel"

    def __init__(self, calibrator: str, one_sided: bool = False, fp8: bool = False):
        self.whole = make(calibrator, one_sided) if calibrator == "entropy" else None  # the error names them
        if calibrator not in CALIBRATORS:
            make(calibrator)
        self.calibrator, self.one_sided, self.fp8 = calibrator, one_sided, fp8
        self.counts: np.ndarray | None = None  # [C, BINS] (percentile)
        self.width: np.ndarray | None = None  # [C]
        self.top: np.ndarray | None = None  # [C] maxima

    def observe(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or not x.numel():
            return
        values = x.detach().float().abs().transpose(0, 1).reshape(x.shape[1], -1)  # [C, N·H·W]
        channels = values.shape[0]
        top = values.max(dim=1).values.double().numpy()
        if self.top is not None and self.top.shape[0] != channels:
            raise ValueError(f"per-channel calibration: {channels} channels after {self.top.shape[0]}")
        self.top = top if self.top is None else np.maximum(self.top, top)
        if self.whole is not None:
            self.whole.observe(values)
        if self.calibrator not in ("percentile", "mse"):
            return
        if self.counts is None:
            self.counts = np.zeros((channels, BINS), np.float64)
            self.width = np.where(top > 0, top, 1.0) / BINS
        for c in np.nonzero(top >= self.width * BINS)[0]:  # merge pairs of bins until the range holds top
            while top[c] >= self.width[c] * BINS:
                merged = self.counts[c].reshape(-1, 2).sum(1)
                self.counts[c] = np.concatenate([merged, np.zeros(BINS // 2)])
                self.width[c] *= 2
        width = torch.from_numpy(self.width).float().unsqueeze(1)  # [C, 1]
        index = (values / width).long().clamp_(max=BINS - 1)
        index += torch.arange(channels).unsqueeze(1) * BINS
        counted = torch.bincount(index[values > 0], minlength=channels * BINS)  # exact zeros left out
        self.counts += counted.double().numpy().reshape(channels, BINS)

    def amax(self) -> np.ndarray:
        if self.top is None:
            return np.zeros(0)
        if self.calibrator == "minmax":
            return self.top.copy()
        if self.whole is not None:
            return np.minimum(self.top, self.whole.amax())
        out = []
        for counts, width in zip(self.counts, self.width):
            one = make(self.calibrator, self.one_sided, self.fp8)
            one.counts, one.width = counts, float(width)
            out.append(one.amax())
        return np.array(out, np.float64)


class ChannelMean:
    """The mean of an activation per channel (axis 1 for a convolution's input, the last axis for a
    Gemm/MatMul's) over every calibration batch: what bias correction multiplies the weights' rounding by."""

    def __init__(self, axis: int):
        self.axis = axis
        self._sum: torch.Tensor | None = None
        self._count = 0

    def observe(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or not x.numel():
            return
        channels = x.detach().double().movedim(self.axis, -1).reshape(-1, x.shape[self.axis])  # [rows, C]
        total = channels.sum(0)
        self._sum = total if self._sum is None else self._sum + total
        self._count += channels.shape[0]

    def value(self) -> np.ndarray:
        return np.zeros(0) if self._sum is None else (self._sum / self._count).numpy()


class Low:
    """The smallest value a tensor took (signed) over every calibration batch: with the range's amax, an
    activation that is mostly non-negative (a Gelu's output, >= -0.17; an average of ReLU outputs, >= 0)
    quantizes to uint8 over [low, amax] with a zero point instead of int8 over [-amax, amax]
    (kiln/quant/qdq.py's insert, `lows`)."""

    def __init__(self):
        self._min: float | None = None

    def observe(self, x: torch.Tensor) -> None:
        if x.numel():
            low = float(x.detach().min())
            self._min = low if self._min is None else min(self._min, low)

    def value(self) -> float | None:
        return self._min


class Together:
    """Several observers of one tensor (a range calibrator and a ChannelMean)."""

    def __init__(self, *observers):
        self.observers = observers

    def observe(self, x: torch.Tensor) -> None:
        for o in self.observers:
            o.observe(x)
