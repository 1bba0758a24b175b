"""A quantized transformer's 8-bit layers share their rows among the threads past kiln_quantized_split elements
(transformer.c): the Elementwise chains onnxruntime's QDQ BERT ends its GEMMs with (DQ -> bias -> scale or Gelu -> Q,
lookup tables; DQ -> bias, float out; a requantizing residual add) and its LayerNormQuantize norms. Before, both
stayed on one thread below the float layers' 1M elements: at a BERT's sizes, always.

Checked: a layer past the threshold splits (the calling thread's count of split loops, transformer.parallel_loops,
goes up by one) and one below it does not; every row is computed alone, so 1 thread, 2 threads and the split forced
everywhere give the same bits, each within one quantization step of numpy; and onnxruntime's QDQ BERT-tiny with every
8-bit layer split is the same bits as unsplit and within one step of onnxruntime running the same model.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

import kiln
from kiln import zoo
from kiln.kernels.cpu import elementwise, transformer
from kiln.kernels.cpu.form_choice import PARALLEL
from kiln.zoo.models import make_inputs
from tests.calibration import FeedsReader, coarsest_scale, reference_session

needs_kernels = pytest.mark.skipif(not transformer.available(), reason="kiln's C kernels are not built")
NEVER = 1 << 40  # kiln_quantized_split past every size: one thread
U8 = torch.uint8

# code, the 8-bit inputs, the float activations, the per-column constants (a bias), the scalar constants
PROGRAMS = {
    "scale_table": (["Dequantize i2 i3 i4", "Add t0 i0", "Mul t1 i1", "Quantize t2 i5 i6"], [2], [], [0], [1]),
    "gelu_table": (["Dequantize i1 i2 i3", "Add t0 i0", "Gelu t1", "Quantize t2 i4 i5"], [1], [], [0], []),
    "dequantize_add": (["Dequantize i1 i2 i3", "Add t0 i0"], [1], [0], [], []),
    "requantizing_add": (["Dequantize i0 i1 i2", "Dequantize i3 i4 i5", "Add t0 t1", "Quantize t2 i6 i7"], [0, 3],
                         [], [], []),
}
# (rows, n) below and past the threshold, each of at least two work items (so that "always split" would show):
# a table's items are 16 rows, an evaluated chain's 4096 elements, LayerNormQuantize's 4096 elements' rows
SIZES = {"scale_table": ((64, 64), (256, 768)), "gelu_table": ((64, 128), (256, 1024)),
         "dequantize_add": ((32, 256), (256, 768)), "requantizing_add": ((16, 768), (512, 512)),
         "layer_norm_quantize": ((128, 64), (256, 768))}


def _threshold() -> int:
    value = transformer.set_quantized_split(0)
    transformer.set_quantized_split(value)
    return value


def _chain(name: str, rows: int, n: int):
    """(kernel, step inputs, numpy's result) of program `name` over [rows, n] on fresh random values."""
    code, eight_bit, floats, columns, scalars = PROGRAMS[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"split {name} {rows} {n}".encode()))
    activations = {k: torch.randint(0, 256, (rows, n), dtype=U8, generator=g) for k in eight_bit}
    activations |= {k: torch.randn(rows, n, generator=g) * 3 for k in floats}
    constants = {k: torch.randn(n, generator=g) for k in columns} | {k: torch.tensor(0.7) for k in scalars}
    for line in code:  # scales and zero points: constant scalars
        op, *args = line.split()
        if op in ("Dequantize", "Quantize"):
            constants[int(args[1][1:])] = torch.rand((), generator=g) * 0.03 + 0.01
            constants[int(args[2][1:])] = torch.randint(96, 160, (), dtype=U8, generator=g)
    kernel = elementwise.Elementwise(code, {k: (rows, n) for k in activations}, constants,
                                     {k: v.dtype for k, v in activations.items()})
    return kernel, activations, _numpy_program(code, {**activations, **constants})


def _numpy_program(code: list[str], values: dict[int, torch.Tensor]) -> np.ndarray:
    """The program in float64 (torch only for erf), ONNX's QuantizeLinear rounding half to even."""
    x = {k: v.double().numpy() for k, v in values.items()}
    lines: list[np.ndarray] = []

    def at(a: str) -> np.ndarray:
        return x[int(a[1:])] if a[0] == "i" else lines[int(a[1:])]

    for line in code:
        op, *args = line.split()
        if op == "Dequantize":
            lines.append((at(args[0]) - at(args[2])) * at(args[1]))
        elif op == "Quantize":
            lines.append(np.clip(np.rint(at(args[0]) / at(args[1])) + at(args[2]), 0, 255))
        elif op == "Gelu":
            v = at(args[0])
            lines.append(v * 0.5 * (1 + torch.erf(torch.from_numpy(v) / math.sqrt(2)).numpy()))
        else:
            lines.append({"Add": np.add, "Mul": np.multiply}[op](at(args[0]), at(args[1])))
    return lines[-1]


def _layer_norm_quantize(rows: int, n: int):
    """(kernel, step inputs, numpy's result) of a LayerNormQuantize with a uint8 residual, as QDQ BERT's norms."""
    g = torch.Generator().manual_seed(zlib.crc32(f"split norm {rows} {n}".encode()))
    x, r = torch.randn(rows, n, generator=g) * 2, torch.randint(0, 256, (rows, n), dtype=U8, generator=g)
    gamma, beta = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g) * 0.1
    y_quant, r_quant = (0.02, 128, U8), (0.03, 121, U8)
    kernel = transformer.LayerNormQuantize((rows, n), gamma, beta, 1e-12, (rows, n), y_quant, r_quant)
    s = x.double().numpy() + (r.double().numpy() - r_quant[1]) * r_quant[0]
    norm = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-12)
    y = norm * gamma.double().numpy() + beta.double().numpy()
    return kernel, {0: x, 3: r}, np.clip(np.rint(y / y_quant[0]) + y_quant[1], 0, 255)


def _made(name: str, rows: int, n: int):
    return _layer_norm_quantize(rows, n) if name == "layer_norm_quantize" else _chain(name, rows, n)


def _counted(kernel, inputs) -> tuple[int, torch.Tensor]:
    """(loops the call split over threads, its output)."""
    before = transformer.parallel_loops()
    y = kernel(inputs)
    return transformer.parallel_loops() - before, y


@pytest.fixture
def threads():
    """Set OpenMP's count in the test's thread (restored after); the split threshold restored too."""
    count, split = torch.get_num_threads(), _threshold()
    yield torch.set_num_threads
    torch.set_num_threads(count)
    transformer.set_quantized_split(split)


@needs_kernels
@pytest.mark.parametrize("name", list(SIZES))
def test_a_layer_splits_past_the_threshold_and_not_below(name, threads):
    threshold = _threshold()
    (small_rows, small_n), (large_rows, large_n) = SIZES[name]
    assert small_rows * small_n <= threshold < large_rows * large_n, "the sizes no longer straddle the threshold"
    threads(2)
    for (rows, n), splits in (((small_rows, small_n), 0), ((large_rows, large_n), 1)):
        kernel, inputs, _ = _made(name, rows, n)
        assert _counted(kernel, inputs)[0] == splits, (name, rows, n, threshold)
        transformer.set_quantized_split(0)  # forced: the small one splits too (it has the items to)
        assert _counted(kernel, inputs)[0] == 1
        transformer.set_quantized_split(threshold)
    threads(1)
    assert _counted(kernel, inputs)[0] == 0  # one thread: nothing to split over


@needs_kernels
@pytest.mark.parametrize("name", list(SIZES))
def test_one_and_two_threads_and_the_forced_split_give_the_same_bits(name, threads):
    """Past the threshold at 2 threads, the split forced at every size, and 1 thread: the same output, each within one
    quantization step of numpy's float64 (a float output: float32's rounding of two operations)."""
    for rows, n in SIZES[name]:
        kernel, inputs, want = _made(name, rows, n)
        got = {}
        for count, split in ((1, _threshold()), (2, _threshold()), (2, 0)):
            threads(count)
            transformer.set_quantized_split(split)
            got[count, split] = kernel(inputs)
        first = next(iter(got.values()))
        assert all(torch.equal(first, y) for y in got.values()), (name, rows, n)
        if first.dtype == torch.float32:
            np.testing.assert_allclose(first.numpy(), want, rtol=1e-6, atol=1e-5)
        else:
            steps = np.abs(first.numpy().astype(np.float64) - want)
            assert steps.max() <= 1 and (steps > 0).mean() < 0.01, (name, steps.max(), (steps > 0).mean())
            assert want.std() > 10  # the values spread over the 8-bit range: the bound means something


@pytest.fixture(scope="module")
def qdq_bert_tiny(tmp_path_factory) -> str:
    """onnxruntime's QDQ BERT-tiny at batch 1 x 128 tokens, as bench/quant.py makes it (uint8 activations, per-channel
    int8 weights with reduce_range, its MatMul/Gemm layers, MinMax on 4 inputs)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    exported = zoo.export("bert_tiny", batch=1, seq=128)
    path = str(tmp_path_factory.mktemp("qdq_split") / "bert_tiny_qdq.onnx")
    feeds = [make_inputs(zoo.get("bert_tiny"), batch=1, seq=128, seed=s) for s in range(4)]
    quantize_static(str(exported.path), path, FeedsReader(feeds), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                    reduce_range=True, calibrate_method=CalibrationMethod.MinMax,
                    op_types_to_quantize=["MatMul", "Gemm"])
    return path


class _Held:
    """A form chooser that always answers the parallel form (the segment's kernels then see the thread count)."""

    def choose(self) -> str:
        return PARALLEL

    def record(self, form: str, seconds: float) -> None:
        pass


@needs_kernels
def test_qdq_bert_tiny_split_everywhere_is_the_same_bits_and_onnxruntime_within_a_step(qdq_bert_tiny, threads):
    threads(2)
    engine = kiln.build(qdq_bert_tiny)
    ops = [s.op_type for s in engine.plan.program.steps]
    assert ops.count("LayerNormQuantize") >= 4 and ops.count("Elementwise") >= 12, ops
    for segment in engine.program.segments:
        if segment.chooser is not None:
            segment.chooser = _Held()
    session = reference_session(qdq_bert_tiny)
    output = session.get_outputs()[0].name
    coarsest = coarsest_scale(qdq_bert_tiny)
    feeds = make_inputs(zoo.get("bert_tiny"), batch=1, seq=128, seed=zlib.crc32(b"qdq split feeds"))
    loops, got = {}, {}
    for count, split in ((2, NEVER), (2, 0), (1, 0)):
        threads(count)
        transformer.set_quantized_split(split)
        before = transformer.parallel_loops()
        got[count, split] = np.asarray(engine.run(feeds)[output])
        loops[count, split] = transformer.parallel_loops() - before
    # forced, each of the 4 norms and 12 chains of BERT-tiny splits (each has the work items to); at 1 thread none
    assert loops[2, 0] - loops[2, NEVER] == 16 and loops[1, 0] == 0, loops
    first = got[2, NEVER]
    assert all(np.array_equal(first, y) for y in got.values())
    want = session.run(None, feeds)[0]
    assert np.abs(first - want).max() <= coarsest, (np.abs(first - want).max(), coarsest)
    assert np.abs(want).max() > 10 * coarsest
