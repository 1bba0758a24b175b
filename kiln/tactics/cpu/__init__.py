"""CPU tactics (loaded by kiln/tactics/registry.py for CPU engines and CPU builds only).

    torch_mkl.py   convolutions and GEMMs through torch's oneDNN/MKL entry points, weights packed at load
    onednn.py      oneDNN's C API: primitives built once at load, runnable inside native segments
                   (conv, Winograd conv, pooling, no-copy reshapes)
    depthwise.py   a depthwise convolution + bias + activation in kiln's C (depthwise.c), timed against oneDNN's
    stem.py        a network's first convolution (<= 4 input channels) in kiln's C (stem.c), timed against oneDNN's
    onednn_gemm.py ... the inner product (kiln::FusedGemm), other row counts on kiln's GEMM or a runtime-M matmul
    gemm_packed.py kiln's own packed GEMM (kiln/kernels/cpu/gemm.c), runnable inside native segments
    quantized.py   kiln::QConv / QGemm on oneDNN's int8 primitives (kiln/ops/quantized.py)
    qgemm_kiln.py  kiln::QGemm on kiln's AVX2 int8 GEMM (kiln/kernels/cpu/i8gemm.c), timed against oneDNN's
    qconv_kiln.py  kiln::QConv 1x1 as that GEMM on its NHWC rows, depthwise in kiln's C (qdepthwise.c), timed
                   against oneDNN's int8 convolution
    qdq.py         per-tensor Q/DQ and the 8-bit ops between quantized layers: QAdd, MaxPool
    w8a16.py       kiln::QConv of a float input quantized to 16 bits: two int8 convolutions on its bytes
    native_member.py  a kiln C kernel as a layer's launch, runnable inside native segments (prepared_native)
    transformer.py kiln's C kernels for LayerNorm, RMSNorm, Add and embedding Gather, native-segment members
    attention.py   ... and for kiln::Attention (attention_plan: q/k/v/mask views from the sizes alone)
    broadcast.py   ... and for Cast, And, Or, Where, GatherND (an exported attention mask's preparation)
    recurrent.py   ONNX RNN, GRU, LSTM as kiln's C loop (kiln/kernels/cpu/recurrent.c, lstm.c): input
                   projection + one loop over time
    rotary.py      ... and for kiln::Rotary (a decoder's rotary embedding, packed q|k|v included)
    elementwise.py kiln::Elementwise programs and Concat in kiln's C, native-segment members; a lone Relu,
                   Sigmoid or Tanh as a one-line program
    softmax.py     Softmax over the last axis in kiln's C, a native-segment member
    tokens.py      a padding-free encoder's TokenIndex, PackTokens, UnpackTokens and PackedAttention (varlen)
    relayout.py    kiln::Relayout (a Reshape/Transpose chain) as one strided copy in kiln's C, a segment member
    squeeze_excite.py  kiln::SqueezeExcite (EfficientNet/MobileNetV3/RegNetY blocks) in kiln's C, a segment member
"""

# Registration order is the candidates' order (a tie in timing goes to the earlier one).
import kiln.tactics.cpu.torch_mkl  # noqa: F401, I001
import kiln.tactics.cpu.onednn  # noqa: F401
import kiln.tactics.cpu.depthwise  # noqa: F401
import kiln.tactics.cpu.stem  # noqa: F401
import kiln.tactics.cpu.onednn_gemm  # noqa: F401
import kiln.tactics.cpu.gemm_packed  # noqa: F401
import kiln.tactics.cpu.transformer  # noqa: F401
import kiln.tactics.cpu.attention  # noqa: F401
import kiln.tactics.cpu.quantized  # noqa: F401
import kiln.tactics.cpu.qgemm_kiln  # noqa: F401
import kiln.tactics.cpu.qconv_kiln  # noqa: F401
import kiln.tactics.cpu.qdq  # noqa: F401
import kiln.tactics.cpu.w8a16  # noqa: F401
import kiln.tactics.cpu.broadcast  # noqa: F401
import kiln.tactics.cpu.elementwise  # noqa: F401
import kiln.tactics.cpu.softmax  # noqa: F401
import kiln.tactics.cpu.rotary  # noqa: F401
import kiln.tactics.cpu.squeeze_excite  # noqa: F401
import kiln.tactics.cpu.recurrent  # noqa: F401
import kiln.tactics.cpu.relayout  # noqa: F401
import kiln.tactics.cpu.tokens  # noqa: F401
