"""The erf-GELU tables of kiln/kernels/cpu/gemm.c (KILN_GELU_T16, KILN_GELU_T8): fit, check, print as C (issue 11).

    python bench/gelu_table_fit.py [--c]

GELU(v) = ½v + |v|·E(|v|), E(a) = ½erf(a/√2) (odd in v: v·erf(v/√2) = |v|·erf(|v|/√2)). E on y = min(|v|·S, n - 1)
is a polynomial of degree d in w = y - k per interval k = rint(y) (n intervals of width 1 centred on 0..n-1: the
tile picks a coefficient with one permute of a register of n floats by k, the 1.5·2²³ trick's low bits), y's clamp
at n - 1 being x = |v|/√2 = XMAX, where erf is within 1.2e-8 of 1; the last interval's constant is ½ exactly, so
past the clamp E = ½ and GELU = ½v + ½|v| (ReLU) exactly. Each interval is a minimax fit of the absolute error
(Lawson's iteration on Chebyshev points, float64), coefficients rounded to float. The check evaluates the float32
arithmetic the tile runs (each FMA rounded once) over -10..10 step 1e-4 against float64 and prints it beside
gemm.c's former rational form (Eigen's x·P(x²)/Q(x²), float32, evaluated the same way).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy.special import erf

XMAX = 3.95  # erfc(3.95) = 2.4e-8: E's error at the clamp 1.2e-8
FORMS = {"T16": (16, 4), "T8": (8, 6)}  # AVX-512: 16 intervals, degree 4; AVX2: 8, degree 6


def fit(n: int, degree: int, iterations: int = 60) -> tuple[float, np.ndarray]:
    """(S, coefficients [n][degree + 1] float32, lowest first): E(y / S) on each interval, y = |v|·S."""
    s = (n - 1) / (XMAX * math.sqrt(2.0))
    rows = []
    for k in range(n):
        last = k == n - 1
        lo, hi = -0.5, (0.0 if last else 0.5)
        w = np.cos(np.linspace(0.0, math.pi, 2000)) * (hi - lo) / 2 + (hi + lo) / 2
        f = 0.5 * erf((k + w) / s / math.sqrt(2.0))
        a = np.vander(w, degree + 1, increasing=True)
        if last:  # the constant pinned at ½: E = ½ past the clamp
            a, f = a[:, 1:], f - 0.5
        weight = np.ones_like(w)
        for _ in range(iterations):
            c, *_ = np.linalg.lstsq(a * weight[:, None], f * weight, rcond=None)
            weight = weight * (np.abs(a @ c - f) + 1e-30)
            weight /= weight.max()
        rows.append(np.concatenate([[0.5], c]) if last else c)
    return s, np.array(rows).astype(np.float32)


def fma32(a, b, c):
    """float32 a·b + c rounded once (the product of two floats is exact in float64)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def table_gelu(s: float, table: np.ndarray, v: np.ndarray) -> np.ndarray:
    n = table.shape[0]
    a = np.abs(v)
    y = np.minimum(a * np.float32(s), np.float32(n - 1))
    k = np.rint(y).astype(np.int64)  # round half to even, as the 1.5·2²³ trick
    w = y - k.astype(np.float32)
    p = table[k, -1]
    for j in range(table.shape[1] - 2, -1, -1):
        p = fma32(p, w, table[k, j])
    return fma32(a, p, v * np.float32(0.5))


def rational_gelu(v: np.ndarray) -> np.ndarray:
    """gemm.c's former tile GELU (KILN_ERF_P / KILN_ERF_Q, the divide exact)"""
    p_coef = [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
              -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02]
    q_coef = [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
              -1.42647390514189e-02]
    f = np.float32
    x = np.clip(v * f(0.70710678118654752), f(-4), f(4))
    x2 = x * x
    p = np.full_like(x, f(p_coef[0]))
    for t in p_coef[1:]:
        p = fma32(p, x2, np.full_like(x, f(t)))
    q = np.full_like(x, f(q_coef[0]))
    for t in q_coef[1:]:
        q = fma32(q, x2, np.full_like(x, f(t)))
    r = np.clip((x * p) / q, f(-1), f(1))
    h = v * f(0.5)
    return fma32(h, r, h)


def errors(got: np.ndarray, v: np.ndarray) -> tuple[float, float, float]:
    want = 0.5 * v.astype(np.float64) * (1.0 + erf(v.astype(np.float64) / math.sqrt(2.0)))
    e = np.abs(got.astype(np.float64) - want)
    return float(e.max()), float((e / np.maximum(1.0, np.abs(v))).max()), float((e / np.maximum(1.0, np.abs(want))).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--c", action="store_true", help="print the tables as gemm.c declares them")
    args = parser.parse_args()
    v = np.arange(-100000, 100001, dtype=np.float64).astype(np.float32) * np.float32(1e-4)
    print("form | max |err| | max |err| / max(1, |v|) | max |err| / max(1, |GELU|)  (v = -10..10 step 1e-4)")
    print("rational (Eigen) | %.3g | %.3g | %.3g" % errors(rational_gelu(v), v))
    for name, (n, degree) in FORMS.items():
        s, table = fit(n, degree)
        print(f"{name}: {n} intervals, degree {degree} | %.3g | %.3g | %.3g" % errors(table_gelu(s, table, v), v))
        if args.c:
            print(f"#define KILN_GELU_S{n} {str(np.float32(s))}f")
            print(f"static const float KILN_GELU_{name}[{degree + 1}][{n}] = {{")
            for j in range(degree + 1):
                values = [f"{str(np.float32(c))}f" for c in table[:, j]]
                lines = [", ".join(values[i:i + 6]) for i in range(0, n, 6)]
                print("    {" + ",\n     ".join(lines) + "},")
            print("};")


if __name__ == "__main__":
    main()
