"""kiln/kernels/cpu/exp_poly.h, the exp every C kernel shares (gemm.c's epilogues, the recurrent cells, se.c,
lstm_lanes.c, attention.c's softmax), against float64 numpy's exp; and the native build that compiles it: the
header found from the temporary folder a source is compiled in (-I), and a changed header giving a new library.

The header's own forms, scalar exp_poly and KILN_VEXP on 8-lane GNU vectors, are compiled here through
native_loop.build as the kernels are. Tolerance: Cephes' expf is within ~1 ulp of e^x once rounded (1.01 measured
over 4M random x here); 1.5 ulp leaves room for a compiler that contracts fewer of its multiply-adds into FMAs.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kiln.kernels.cpu import native_loop

# VECTOR_LOOP(name, T, f): a C function name(x, y, n) storing f(x) to y, n floats a multiple of T's lanes
VECTOR_LOOP = r"""
#define VECTOR_LOOP(name, T, f)                                    \
    void name(const float *x, float *y, long n) {                  \
        for (long j = 0; j < n; j += sizeof(T) / sizeof(float)) {  \
            T v;                                                   \
            memcpy(&v, x + j, sizeof v);                           \
            v = f(v);                                              \
            memcpy(y + j, &v, sizeof v);                           \
        }                                                          \
    }
"""

SOURCE = VECTOR_LOOP + r"""
#include "exp_poly.h"

typedef float v8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));

static inline v8 select8(i8 mask, v8 a, v8 b) { return (v8)((mask & (i8)a) | (~mask & (i8)b)); }
static inline v8 clamp8(v8 x, float lo, float hi) {
    const v8 l = (v8){0} + lo, u = (v8){0} + hi;
    x = select8(x < l, l, x);
    return select8(x > u, u, x);
}
KILN_VEXP(exp8, static inline, v8, i8, clamp8)

void kiln_test_exp_scalar(const float *x, float *y, long n) {
    for (long j = 0; j < n; ++j) y[j] = exp_poly(x[j]);
}
VECTOR_LOOP(kiln_test_exp_vector, v8, exp8)
"""
ULPS = 1.5


@pytest.fixture(scope="module")
def library():
    built = native_loop.build("exp-poly-test", SOURCE)
    if isinstance(built, str):
        pytest.skip(f"no native build: {built}")
    return ctypes.CDLL(str(built))


def _run(function, x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    function(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_long(x.size))
    return y


def _ulps(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    want = np.exp(x.astype(np.float64))
    return np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)


def test_scalar_and_vector_forms_match_float64_exp(library):
    rng = np.random.default_rng()
    edges = [-87.0, 88.0, 0.0, -0.0, 1e-30, -1e-30, 0.34657359, -0.34657359, 0.3465736, -0.3465736, 1.0, -1.0]
    x = np.concatenate([np.array(edges), rng.uniform(-87.0, 88.0, 1 << 20), rng.normal(0.0, 2.0, 1 << 16)])
    x = np.resize(x, (x.size + 7) // 8 * 8).astype(np.float32)
    for name, function in (("exp_poly", library.kiln_test_exp_scalar), ("KILN_VEXP", library.kiln_test_exp_vector)):
        ulps = _ulps(_run(function, x), x)
        worst = int(np.argmax(ulps))
        assert ulps[worst] <= ULPS, f"{name}({x[worst]!r}): {ulps[worst]:.2f} ulp from float64 exp"


def test_arguments_past_the_range_are_clamped_to_it(library):
    """Below -87 e^x is e^-87 (a normal float, where the exponent bits can hold 2^n), above 88 e^88: never an
    infinity, NaN or a garbage exponent."""
    x = np.array([-87.0, -87.5, -100.0, -1e30, -np.inf, 88.0, 88.5, 100.0, 1e30, np.inf], np.float32)
    x = np.resize(x, 16)
    for function in (library.kiln_test_exp_scalar, library.kiln_test_exp_vector):
        y = _run(function, x)
        assert np.all(np.isfinite(y))
        low, high = _run(function, np.full(8, -87.0, np.float32))[0], _run(function, np.full(8, 88.0, np.float32))[0]
        np.testing.assert_array_equal(y, np.where(x < 0, low, high))


def test_vector_and_scalar_differ_only_where_n_is_a_half_integer_away(library):
    """The vector form rounds n = x·log2 e by the 1.5·2²³ trick in one FMA, the scalar by rintf after rounding the
    product: they agree bit for bit except within an ulp of x·log2 e from a half-integer (both then accurate)."""
    rng = np.random.default_rng()
    k = np.arange(-125, 127) + 0.5
    halves = (k / np.log2(np.e)).astype(np.float32)
    x = np.concatenate([rng.uniform(-87.0, 88.0, 1 << 18).astype(np.float32), halves,
                        np.nextafter(halves, np.float32(np.inf)), np.nextafter(halves, np.float32(-np.inf))])
    x = np.resize(x, (x.size + 7) // 8 * 8).astype(np.float32)
    scalar, vector = _run(library.kiln_test_exp_scalar, x), _run(library.kiln_test_exp_vector, x)
    differ = scalar.view(np.int32) != vector.view(np.int32)
    t = x[differ].astype(np.float64) * np.log2(np.e)
    off_half = np.abs(t - (np.floor(t) + 0.5))
    assert np.all(off_half <= np.spacing(np.abs(t).astype(np.float32))), x[differ][off_half > 0]
    assert np.all(_ulps(vector[differ], x[differ]) <= ULPS) and np.all(_ulps(scalar[differ], x[differ]) <= ULPS)


def test_a_header_is_found_from_the_build_folder_and_a_change_to_it_rebuilds(tmp_path, monkeypatch):
    """native_loop.build compiles a copy of the source in a temporary folder: the headers' folder is on -I, and
    their contents are part of the library's cache key (the source text alone does not change with them)."""
    headers = tmp_path / "include"
    headers.mkdir()
    monkeypatch.setattr(native_loop, "INCLUDE_DIR", headers)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    source = '#include "value.h"\nint kiln_test_value(void) { return VALUE; }\n'
    results = []
    for value in (1, 2):
        (headers / "value.h").write_text(f"#define VALUE {value}\n")
        built = native_loop.build("header-test", source)
        if isinstance(built, str):
            pytest.skip(f"no native build: {built}")
        results.append((built, ctypes.CDLL(str(built)).kiln_test_value()))
    (first, one), (second, two) = results
    assert (one, two) == (1, 2)
    assert first != second


def test_the_header_digest_follows_each_header_s_name_and_contents(tmp_path):
    (tmp_path / "a.h").write_text("#define A 1\n")
    before = native_loop.headers_digest(tmp_path)
    (tmp_path / "a.h").write_text("#define A 2\n")
    changed = native_loop.headers_digest(tmp_path)
    (tmp_path / "a.h").rename(tmp_path / "b.h")
    renamed = native_loop.headers_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("not a header")
    assert len({before, changed, renamed}) == 3
    assert native_loop.headers_digest(tmp_path) == renamed  # only headers count


# KILN_VSILU_TABLE at both widths it is written for, each in a function built for its ISA (target attributes, so the
# library builds under the AVX2 cap too): the 8-lane form (table of 2^(j/8), vpermps ymm) and the 16-lane one (2^(j/16),
# vpermps zmm; depthwise.c's SiLU under AVX-512), called only where the CPU has the ISA
TABLE_SOURCE = VECTOR_LOOP + r"""
#include <immintrin.h>
#include "exp_poly.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")
typedef float t8 __attribute__((vector_size(32)));
typedef int ti8 __attribute__((vector_size(32)));
#define PERMUTE8(table, t) _mm256_permutevar8x32_ps((__m256)(table), (__m256i)(t))
KILN_VSILU_TABLE(silu8, static inline, t8, ti8, _mm256_min_ps, _mm256_max_ps, 3, PERMUTE8)
VECTOR_LOOP(kiln_test_silu_table8, t8, silu8)
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
typedef float t16 __attribute__((vector_size(64)));
typedef int ti16 __attribute__((vector_size(64)));
#define PERMUTE16(table, t) _mm512_permutexvar_ps((__m512i)(t), (__m512)(table))
KILN_VSILU_TABLE(silu16, static inline, t16, ti16, _mm512_min_ps, _mm512_max_ps, 4, PERMUTE16)
VECTOR_LOOP(kiln_test_silu_table16, t16, silu16)
#pragma GCC pop_options
"""


@pytest.mark.parametrize("lanes", [8, 16])
def test_table_silu_within_ulps_of_float64_and_its_specials(lanes):
    """KILN_VSILU_TABLE against float64 x·σ(x) by test_conv_silu's checks (a sweep over [-100, 100], every exponent
    of both signs, random values; the specials: +inf -> +inf, -inf and x < -88 -> ~0, NaN -> NaN, ±0 -> ±0), within
    test_conv_silu's 3.5 ulp (bench/silu_ab.py measured 2.9 at 16 lanes and 8 over every 61st float)."""
    from kiln.kernels.cpu import cpu_features
    from tests.unit.test_conv_silu import silu_checks

    if cpu_features.isa() != "avx512" and lanes == 16 or cpu_features.isa() not in ("avx2", "avx512"):
        pytest.skip(f"needs {'AVX-512' if lanes == 16 else 'AVX2'}")
    built = native_loop.build("silu-table-test", TABLE_SOURCE)
    if isinstance(built, str):
        pytest.skip(f"no native build: {built}")
    function = getattr(ctypes.CDLL(str(built)), f"kiln_test_silu_table{lanes}")

    def run(x: np.ndarray) -> np.ndarray:
        padded = np.resize(x, (x.size + lanes - 1) // lanes * lanes).astype(np.float32)
        return _run(function, padded)[:x.size]

    silu_checks(run)
