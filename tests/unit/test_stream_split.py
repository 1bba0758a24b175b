"""A Concat's rows and an image's per-channel chain between a segment's oneDNN layers (cpu.concat.nhwc,
cpu.elementwise.nhwc: `stream`) shared among the threads past elementwise.STREAM_ELEMENTS, on OpenMP's team (issue 11,
2 threads). Before, both stayed on one thread below the float layers' 1M elements: DenseNet-121's every BN-ReLU chain
and Concat was a serial step of its segment's parallel form.

Checked: a layer past the threshold splits (transformer.parallel_loops, the calling thread's count, goes up by one),
one below it does not, nor any at 1 thread, nor a Concat that is not a stream step; the split runs on OpenMP's team,
not gemm.c's pool, even where the pool is on; 1 and 2 threads give the same bits, the Concat torch.cat's exactly and
the chain within float32's rounding of torch's; a DenseNet layer past the threshold, built and run at 2 threads,
matches onnxruntime on fresh inputs.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
import torch

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import elementwise, gemm_native, transformer
from test_batchnorm_nhwc import NATIVE, dense_model, onnxruntime_run  # tests/unit is on the path (pytest prepends it)

pytestmark = pytest.mark.skipif(not transformer.available(), reason=f"kiln's C kernels: {transformer.reason()}")

GRAIN = elementwise.STREAM_ELEMENTS
# NHWC rows [N·H·W, C]: a DenseNet block's sizes past the grain, and a 7x7 one below it
LARGE_ROWS, SMALL_ROWS = 3136, 49


def _generator(what: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(what.encode()))


def _concat(rows: int, widths: list[int], stream: bool = True):
    g = _generator(f"concat {rows} {widths}")
    parts = {k: torch.randn(rows, c, generator=g) for k, c in enumerate(widths)}
    return (elementwise.Concat([(rows, c) for c in widths], axis=1, stream=stream), parts,
            torch.cat(list(parts.values()), dim=1))


def _chain(rows: int, channels: int, stream: bool = True):
    """BN-ReLU as batchnorm_as_affine leaves it: x * scale + shift, then Relu, per channel."""
    g = _generator(f"chain {rows} {channels}")
    x, scale, shift = torch.randn(rows, channels, generator=g), torch.rand(channels, generator=g) + 0.5, \
        torch.randn(channels, generator=g)
    kernel = elementwise.Elementwise(["Mul i0 i1", "Add t0 i2", "Relu t1"], {0: (rows, channels)},
                                     {1: scale, 2: shift}, stream=stream)
    return kernel, {0: x}, torch.relu(x * scale + shift)


CASES = {"concat": lambda rows: _concat(rows, [64, 32, 32, 17]), "chain": lambda rows: _chain(rows, 145)}


def _counted(kernel, inputs) -> tuple[int, torch.Tensor]:
    """(loops the call split over threads, its output)."""
    before = transformer.parallel_loops()
    y = kernel(inputs)
    return transformer.parallel_loops() - before, y


@pytest.fixture
def threads():
    """Set OpenMP's count in the test's thread (restored after)."""
    count = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(count)


@pytest.mark.parametrize("name", list(CASES))
def test_a_layer_splits_past_the_grain_and_not_below_nor_at_one_thread(name, threads):
    small, large = CASES[name](SMALL_ROWS), CASES[name](LARGE_ROWS)
    assert small[2].numel() <= GRAIN < large[2].numel(), "the sizes no longer straddle the grain"
    threads(2)
    assert _counted(*small[:2])[0] == 0
    assert _counted(*large[:2])[0] == 1
    threads(1)
    assert _counted(*large[:2])[0] == 0


def test_a_concat_that_is_not_a_stream_step_stays_on_one_thread(threads):
    kernel, parts, want = _concat(LARGE_ROWS, [64, 32, 32, 17], stream=False)
    threads(2)
    assert _counted(kernel, parts)[0] == 0
    assert torch.equal(kernel(parts), want)


def _pool_loops() -> int:
    stats = (ctypes.c_long * 6)()
    gemm_native.load().kiln_pool_stats(stats)
    return stats[0]


@pytest.mark.skipif(not gemm_native.available(), reason="kiln's GEMM library (its pool) is not built")
@pytest.mark.parametrize("name", list(CASES))
def test_the_split_runs_on_openmps_team_even_where_the_pool_is_on(name, threads):
    """With gemm.c's pool on (a machine busy as the kernels loaded), a stream step still splits on OpenMP's team: the
    pool's loop count stays, while a float chain past PARALLEL_ELEMENTS that is not a stream step takes the pool."""
    pool = ctypes.c_int.in_dll(gemm_native.load(), "kiln_pool_enabled")
    before = pool.value
    pool.value = 1
    try:
        threads(2)
        kernel, inputs, _ = CASES[name](LARGE_ROWS)
        loops = _pool_loops()
        assert _counted(kernel, inputs)[0] == 1
        assert _pool_loops() == loops
        rows = elementwise.PARALLEL_ELEMENTS // 145 + 1
        assert _counted(*_chain(rows, 145, stream=False)[:2])[0] == 1
        assert _pool_loops() == loops + 1
    finally:
        pool.value = before


@pytest.mark.parametrize("rows", [SMALL_ROWS, LARGE_ROWS, LARGE_ROWS + 7])
@pytest.mark.parametrize("name", list(CASES))
def test_one_and_two_threads_give_the_same_bits_as_torch(name, rows, threads):
    kernel, inputs, want = CASES[name](rows)
    got = {}
    for count in (1, 2):
        threads(count)
        got[count] = kernel(inputs)
    assert torch.equal(got[1], got[2]), (name, rows)
    if name == "concat":
        assert torch.equal(got[2], want)  # a copy
    else:
        torch.testing.assert_close(got[2], want, rtol=1e-6, atol=1e-6)


def test_a_densenet_layer_past_the_grain_at_two_threads_matches_onnxruntime(two_threads, monkeypatch):
    """Concat of three convolutions' outputs (2 x 28 x 28 x 97 = 152K elements), BN-ReLU, 1x1 convolution: built and
    run at 2 threads, both layers past the grain."""
    # about the kernels, not the tuner on a loaded machine: the NHWC tactics "win" where they are candidates (the
    # tuner still checks each layer and the whole engine against the reference)
    monkeypatch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k.startswith(("cpu.elementwise.nhwc", "cpu.concat.nhwc")) else 1.0 for k in fns})
    proto = dense_model([40, 24, 33], h=28, w=28)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    chosen = {s.op_type: s.tactic for s in engine.plan.program.steps}
    assert chosen["Elementwise"] == "cpu.elementwise.nhwc" and chosen["Concat"] == "cpu.concat.nhwc", chosen
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((2, 3, 28, 28)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)
