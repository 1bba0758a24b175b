"""kiln's Triton kernels (needs the `triton` package; under TRITON_INTERPRET=1 they run on CPU tensors).

    compile_elementwise(code, n_inputs)(*inputs)           kiln::Elementwise programs, one kernel each
    layer_norm(x, weight, bias, eps) / rms_norm(x, weight, eps) / softmax(x)   one row per program
    bias_activation(y, bias, residual, activation=...)     the GEMM/conv epilogue after cuBLAS/cuDNN
    gemm(x, w, bias, residual, activation=...)             a Triton GEMM with that epilogue fused
    swiglu_gemm(x, w, bias, residual)                      a gated MLP's gate|up GEMM, silu(gate)·up in its epilogue
    conv2d(x, pack_weight(w), (kh, kw), bias, residual, ...)  2-D implicit-GEMM convolution (NHWC), that epilogue fused
    flash_attention(q, k, v, mask, scale=..., out=...)     forward attention on strided [B, H, S, D] views
    max_pool2d / avg_pool2d(x, kernel, ...) / mean_hw(x)  2-D pooling and the H,W mean on NHWC activations
    rotary(x, cos, sin, num_heads=..., rotate_heads=...)  rotary embedding on strided q/k (or a packed q|k|v)

Every kernel takes and returns torch tensors, allocates its output, stores fp16/bf16/fp32 and
accumulates in fp32.
"""

from kiln.kernels.cuda.triton.attention import ATTENTION_CONFIGS, AttentionConfig, flash_attention
from kiln.kernels.cuda.triton.conv import CONV_CONFIGS, ConvConfig, conv2d, pack_weight
from kiln.kernels.cuda.triton.elementwise import compile_elementwise
from kiln.kernels.cuda.triton.epilogue import bias_activation
from kiln.kernels.cuda.triton.fused_gemm import GEMM_CONFIGS, GemmConfig, gemm, swiglu_gemm
from kiln.kernels.cuda.triton.normalization import layer_norm, rms_norm, softmax
from kiln.kernels.cuda.triton.pool import PoolConfig, avg_pool2d, max_pool2d, mean_hw
from kiln.kernels.cuda.triton.rotary import rotary

__all__ = ["compile_elementwise", "layer_norm", "rms_norm", "softmax", "bias_activation", "gemm", "GemmConfig",
           "GEMM_CONFIGS", "swiglu_gemm", "flash_attention", "AttentionConfig", "ATTENTION_CONFIGS"]
__all__ += ["max_pool2d", "avg_pool2d", "mean_hw", "PoolConfig"]
__all__ += ["conv2d", "pack_weight", "ConvConfig", "CONV_CONFIGS", "rotary"]
