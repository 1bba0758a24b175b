"""The space-to-depth fold of the quantized stem (kiln/kernels/cuda/triton/qstem.py) under Triton's interpreter:
the one-pass Triton kernel against torch's pad / fill / strided copy, byte for byte, and its quantizing form against
onnx.reference's QuantizeLinear of the same image folded by torch. Integers and bytes: exact, no tolerance."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.cuda.triton import qstem  # noqa: E402

FP8 = torch.float8_e4m3fn
CASES = {  # (channels, H, W, kernel, pads ONNX order): ResNet's 7x7/2 pad 3, odd sizes, asymmetric and cropping pads
    "7x7 pad 3": (3, 20, 20, 7, (3, 3, 3, 3)), "odd 21x19": (3, 21, 19, 7, (3, 3, 3, 3)),
    "asymmetric": (3, 18, 18, 7, (2, 3, 4, 1)), "8x8 on 4 channels": (4, 16, 16, 8, (3, 3, 3, 3)),
    "no pads, 1 channel": (1, 15, 17, 7, (0, 0, 0, 0)),
}


def _geometry(h: int, w: int, kernel: int, pads: tuple[int, int, int, int]) -> tuple[int, int]:
    return (h + pads[0] + pads[2] - kernel) // 2 + 1, (w + pads[1] + pads[3] - kernel) // 2 + 1


def _onnx_quantize(x: torch.Tensor, scale: float, zero: int, dtype: torch.dtype) -> torch.Tensor:
    """onnx.reference's QuantizeLinear (an independent implementation) of a float32 tensor."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    kind = {torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8}[dtype]
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", kind, None)],
                              [helper.make_tensor("s", TensorProto.FLOAT, [], [scale]),
                               helper.make_tensor("z", kind, [], [zero])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    (y,) = ReferenceEvaluator(model).run(None, {"x": x.numpy()})
    return torch.from_numpy(np.asarray(y))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, FP8])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_space_to_depth_kernel_is_torch_s_fold_byte_for_byte(case, dtype, layout):
    c, h, w, kernel, pads = CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(repr((case, str(dtype), layout)).encode()))
    bits = torch.randint(0, 256, (2, c, h, w), dtype=torch.uint8, generator=g)
    if dtype == FP8:
        bits[(bits & 0x7F) == 0x7F] = 0x11  # no NaN bytes (torch's copy keeps them too, but they compare unequal)
    x = bits.view(dtype)
    x = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
    zero_bits = 0 if dtype == FP8 else 37
    ho, wo = _geometry(h, w, kernel, pads)
    got = qstem.space_to_depth(x, zero_bits, kernel, pads, ho, wo)
    want = qstem.space_to_depth_torch(x, zero_bits, kernel, pads, ho, wo)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), case


@pytest.mark.parametrize("case", ["7x7 pad 3", "asymmetric", "8x8 on 4 channels"])
@pytest.mark.parametrize("dtype,zero", [(torch.int8, -5), (torch.uint8, 128), (torch.int8, 0)])
@pytest.mark.parametrize("source", [torch.float32, torch.float16])
def test_space_to_depth_quantizing_is_onnx_quantize_then_the_fold(case, dtype, zero, source):
    """QuantizeLinear folded in: equal to onnx.reference's QuantizeLinear (ties included: x holds exact
    half-steps) followed by the byte fold; padding and spare channels hold the zero point."""
    c, h, w, kernel, pads = CASES[case]
    g = torch.Generator().manual_seed(7 + c + zero)
    scale = 0.0345
    x = torch.randn(2, c, h, w, generator=g) * 2.5
    x[0, 0, 0, :] = (torch.arange(w, dtype=torch.float32) - w // 2 + 0.5) * scale  # x / scale near half-integers
    x[1, -1, -2:] = 1e4  # saturates
    x = x.to(source)
    want_q = _onnx_quantize(x.float(), scale, zero, dtype)
    ho, wo = _geometry(h, w, kernel, pads)
    zero_bits = int(torch.tensor(zero, dtype=dtype).view(torch.uint8))
    want = qstem.space_to_depth_torch(want_q, zero_bits, kernel, pads, ho, wo)
    got = qstem.space_to_depth(x, zero_bits, kernel, pads, ho, wo, quantize=(scale, float(zero), dtype))
    assert got.dtype == dtype
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) == 0, f"{int((diff > 0).sum())} bytes differ from QuantizeLinear then the fold"


def test_space_to_depth_refuses_what_it_cannot_fold():
    x = torch.zeros(1, 5, 16, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="at most 4"):
        qstem.space_to_depth(x, 0, 7, (3, 3, 3, 3), 8, 8)
    with pytest.raises(TypeError, match="8-bit without quantize"):
        qstem.space_to_depth(torch.zeros(1, 3, 16, 16), 0, 7, (3, 3, 3, 3), 8, 8)
    with pytest.raises(TypeError, match="quantizes a float x"):
        qstem.space_to_depth(torch.zeros(1, 3, 16, 16, dtype=torch.int8), 0, 7, (3, 3, 3, 3), 8, 8,
                             quantize=(0.1, 0.0, torch.int8))
