"""CUDA tactics (loaded by kiln/tactics/registry.py for CUDA engines and CUDA builds only).

    library.py     cuBLAS/cuBLASLt GEMMs (+ Triton GEMM and epilogues), cuDNN convolutions, SDPA backends
    memory_bound.py  Triton elementwise chains, LayerNorm, RMSNorm, Softmax
    gemm_padded.py a half GEMM of K or N not a multiple of 8 on zero-padded, aligned operands (cuBLAS)
    gemm_float32_out.py  a half GEMM storing the engine's fp32 output on rows padded to 128 bytes (cuBLAS, odd N)
    swiglu.py      a gated MLP's gate|up GEMM (FusedGemm SwiGLU): cuBLAS + one gating kernel, or one Triton GEMM
    attention.py   kiln's Triton flash attention
    packed_attention.py  kiln::PackedAttention (padding-free encoders) on varlen flash attention
    pool.py        Triton NHWC pooling
    conv.py        Triton implicit-GEMM convolution
    conv1d.py      long-kernel 1-D convolution as one batched GEMM; InstanceNormalization on group_norm
    rotary.py      Triton rotary embedding (kiln::Rotary)
    embedding.py   kiln::EmbeddingConcat from one stacked table
    cudnn.py       cuDNN graph API fused conv/matmul/norm (when nvidia-cudnn-frontend imports)
    quant_*.py     kiln::QGemm / QConv / QAdd: INT8/FP8 GEMMs and convolutions (Triton, cuBLASLt) and the
                   float layer on dequantized values, with the requantizing epilogue fused;
                   kiln::LayerNormQuantize (quant_norm.py): the norm's store writes the 8-bit tensor

None of them imports triton or cuDNN's frontend at import time: a kernel's library is imported
when a tactic using it is prepared.
"""

# Registration order is the candidates' order (a tie in timing goes to the earlier one).
import kiln.tactics.cuda.library  # noqa: F401, I001
import kiln.tactics.cuda.memory_bound  # noqa: F401
import kiln.tactics.cuda.swiglu  # noqa: F401
import kiln.tactics.cuda.gemm_padded  # noqa: F401
import kiln.tactics.cuda.gemm_float32_out  # noqa: F401
import kiln.tactics.cuda.attention  # noqa: F401
import kiln.tactics.cuda.packed_attention  # noqa: F401
import kiln.tactics.cuda.pool  # noqa: F401
import kiln.tactics.cuda.rotary  # noqa: F401
import kiln.tactics.cuda.embedding  # noqa: F401
import kiln.tactics.cuda.cudnn  # noqa: F401
import kiln.tactics.cuda.conv  # noqa: F401
import kiln.tactics.cuda.conv1d  # noqa: F401
import kiln.tactics.cuda.quant_gemm  # noqa: F401
import kiln.tactics.cuda.quant_conv  # noqa: F401
import kiln.tactics.cuda.quant_add  # noqa: F401
import kiln.tactics.cuda.quant_linear  # noqa: F401
import kiln.tactics.cuda.quant_norm  # noqa: F401
