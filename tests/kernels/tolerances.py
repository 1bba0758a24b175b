"""Per-dtype tolerances for kernel outputs compared with an fp32 torch reference.

A kernel computes in fp32 and rounds once to the storage type, so its error against the fp32
reference is half an ulp of the storage type (fp16: 2⁻¹¹ ≈ 4.9e-4, bf16: 2⁻⁸ ≈ 3.9e-3) plus
fp32 noise; rtol is about twice that. atol covers results near zero, where a relative bound
means nothing (cancellation in x + bias, LayerNorm outputs crossing 0).
"""

import torch

TOLERANCE = {  # dtype -> (rtol, atol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
DTYPES = list(TOLERANCE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0,
                 equal_nan: bool = False) -> None:
    """actual (storage dtype) against expected (fp32 reference); `scale` widens both tolerances."""
    rtol, atol = TOLERANCE[dtype]
    assert actual.dtype == dtype, f"expected output dtype {dtype}, got {actual.dtype}"
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol * scale, atol=atol * scale,
                               equal_nan=equal_nan)
