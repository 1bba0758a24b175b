"""Calibrators: from the values a tensor takes on calibration data to the range (amax) its
quantization covers, symmetric around 0 as TensorRT quantizes activations.

    minmax       amax = max |x| seen: nothing clipped, coarse steps when there are outliers
    percentile   amax = the p-th percentile of |x| (99.99 by default): the rare outliers clipped
    entropy      TensorRT's: the amax whose quantized distribution is closest (KL divergence) to the
                 observed one, over a histogram of |x| (2048 bins, 128 levels: int8's positive half)

A histogram's range grows as larger values arrive: bins are merged pairwise, doubling the range,
so every value seen is counted without a second pass over the data.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BINS = 2048
LEVELS = 128  # int8 symmetric: 0..127 positive levels (and 127 negative)


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

    def amax(self) -> float:
        counts = self.counts
        if counts.sum() == 0:
            return 0.0
        last = int(np.nonzero(counts)[0][-1]) + 1
        if last <= LEVELS:  # every value fits the levels exactly: nothing to clip
            return float(last * self.width)
        best, best_kl = last, math.inf
        for i in range(LEVELS, last + 1, max(1, (last - LEVELS) // 256)):
            reference = counts[:i].copy()
            reference[i - 1] += counts[i:].sum()  # what is clipped lands in the last bin
            # quantize the first i bins into LEVELS levels (np.array_split's grouping), then spread
            # each level back over its non-empty bins
            sizes = np.full(LEVELS, i // LEVELS)
            sizes[: i % LEVELS] += 1
            level = np.repeat(np.arange(LEVELS), sizes)  # bin -> its level
            chunk = counts[:i]
            nonzero = chunk > 0
            sums = np.bincount(level, weights=chunk, minlength=LEVELS)
            filled = np.bincount(level, weights=nonzero, minlength=LEVELS)
            per_bin = np.divide(sums, filled, out=np.zeros(LEVELS), where=filled > 0)
            candidate = np.where(nonzero, per_bin[level], 0.0)
            kl = _kl(reference, candidate)
            if kl < best_kl:
                best, best_kl = i, kl
        return float((best + 0.5) * self.width)


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


CALIBRATORS = {"minmax": MinMax, "percentile": Percentile, "entropy": Entropy}


def make(name: str) -> Calibrator:
    try:
        return CALIBRATORS[name]()
    except KeyError:
        raise ValueError(f"no calibrator {name!r}; kiln has {sorted(CALIBRATORS)}") from None
