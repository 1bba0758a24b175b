"""Fusion rules, one module each (pattern / check with a reason / rewrite), in the order they run: recognisers
of decomposed ops first (so the layer fusions see a Gelu where the exporter wrote Erf arithmetic), then
explicit quantization (Q/DQ pairs propagated, quantized layers formed, before the float layer fusions take
their Conv/Gemm), then layer epilogues, then attention, then the elementwise chains that are left."""

from __future__ import annotations

from kiln.passes.batchnorm import batchnorm_as_affine
from kiln.passes.fusion.attention import fuse_attention
from kiln.passes.fusion.attention_key_mask import use_key_mask
from kiln.passes.fusion.attention_layout import absorb_attention_reshapes
from kiln.passes.fusion.attention_mask import drop_empty_attention_mask, use_broadcast_attention_mask
from kiln.passes.fusion.causal_conv import trim_conv_padding
from kiln.passes.fusion.conv import fuse_conv, fuse_conv_final_activation
from kiln.passes.fusion.conv1d import conv1d_as_conv2d, conv1d_mean_as_global_pool
from kiln.passes.fusion.elementwise import fuse_elementwise
from kiln.passes.fusion.elementwise_dequantize import (fuse_dequantize_into_elementwise,
                                                       fuse_int8_dequantize_into_elementwise,
                                                       fuse_int8_quantize_into_elementwise,
                                                       fuse_quantize_into_elementwise)
from kiln.passes.fusion.embedding_concat import fuse_embedding_concat
from kiln.passes.fusion.gelu import fuse_gelu
from kiln.passes.fusion.gemm import fuse_gemm
from kiln.passes.fusion.global_pool import pool_as_global_mean
from kiln.passes.fusion.layernorm import fuse_layer_norm
from kiln.passes.fusion.layernorm_quantize import (fuse_dequantize_into_layer_norm_quantize,
                                                   fuse_int8_dequantize_into_layer_norm_quantize,
                                                   fuse_int8_layer_norm_quantize, fuse_layer_norm_quantize)
from kiln.passes.fusion.packed_rotary import fuse_packed_rotary
from kiln.passes.fusion.padding_positions import fuse_padding_positions
from kiln.passes.fusion.parallel_gemm import merge_parallel_gemms
from kiln.passes.fusion.qdq_layers import (fold_quantize_into_stem, fold_wide_quantize_into_layer, fuse_quantized_add,
                                          fuse_quantized_layer)
from kiln.passes.fusion.qdq_propagate import hoist_quantize, remove_qdq_round_trips, sink_dequantize
from kiln.passes.fusion.qdq_residual import fuse_quantized_residual, fuse_quantized_residual_fp8
from kiln.passes.fusion.qgemm_epilogue import fuse_elementwise_into_qgemm, fuse_quantize_through_layout_into_qgemm
from kiln.passes.fusion.relayout import flatten_channels_last_runs, fuse_relayout
from kiln.passes.fusion.rmsnorm import fuse_rms_norm
from kiln.passes.fusion.rotary import fuse_rotary
from kiln.passes.fusion.skip_layernorm import fuse_skip_layer_norm
from kiln.passes.fusion.softmax import fuse_softmax
from kiln.passes.fusion.split_slices import split_as_slices
from kiln.passes.fusion.squeeze_excite import fuse_squeeze_excite
from kiln.passes.fusion.symbolic_shapes import (constant_reshape_target, drop_zero_initial_states,
                                               remove_symbolic_same_shape_reshape)
from kiln.passes.fusion.swiglu import fuse_split_swiglu, fuse_swiglu

RULES = [
    ("fuse_gelu", fuse_gelu),
    ("fuse_layer_norm", fuse_layer_norm),
    ("fuse_rms_norm", fuse_rms_norm),
    ("fuse_softmax", fuse_softmax),
    ("hoist_quantize", hoist_quantize),  # Q above attention's head split/merge (with its scale by c)
    ("sink_dequantize", sink_dequantize),  # the 8-bit tensor through MaxPool/Reshape/Concat...
    ("remove_qdq_round_trips", remove_qdq_round_trips),  # Q(DQ(q)) = q
    ("fuse_quantized_layers", fuse_quantized_layer),  # after fuse_gelu (its Gelu absorbed), before fuse_conv/fuse_gemm
    ("fuse_quantized_add", fuse_quantized_add),
    ("fuse_quantized_residual", fuse_quantized_residual),  # QConv -> QAdd: the add in the conv's epilogue
    ("fuse_quantized_residual_fp8", fuse_quantized_residual_fp8),  # the same on E4M3 layers (opt_level 3)
    ("fold_quantize_into_stem", fold_quantize_into_stem),  # after the residual fusions: the stem's QConv is final
    ("fold_wide_quantize_into_layer", fold_wide_quantize_into_layer),  # a W8A16 layer reads its float input
    ("global_average_pool", pool_as_global_mean),  # one window over the whole input: a plain mean
    ("causal_conv_pads", trim_conv_padding),  # before fuse_conv: the chomp sat between the conv and its ReLU
    ("fuse_conv", fuse_conv),
    ("fuse_conv_final_activation", fuse_conv_final_activation),  # before conv1d_as_conv2d: a TCN block's last ReLU
    ("conv1d_as_conv2d", conv1d_as_conv2d),  # after fuse_conv: the epilogue goes with the layer
    ("conv1d_mean_as_global_pool", conv1d_mean_as_global_pool),
    ("fuse_squeeze_excite", fuse_squeeze_excite),  # after fuse_conv: reads the 1x1 convolutions' epilogues
    ("fuse_embedding_concat", fuse_embedding_concat),
    ("fuse_padding_positions", fuse_padding_positions),  # RoBERTa's position ids: one step of the CPU's segment
    ("fuse_gemm", fuse_gemm),
    ("fuse_swiglu", fuse_swiglu),  # before merge_parallel_gemms: it would hide the up GEMM behind a Split
    ("fuse_split_swiglu", fuse_split_swiglu),  # a gate|up GEMM the model merged itself (Phi-3), then chunked
    ("merge_parallel_gemms", merge_parallel_gemms),
    ("fuse_rotary", fuse_rotary),
    # before fuse_attention: a symbolic export's Reshape that keeps its shape hides the head merge's Transpose
    ("remove_symbolic_same_shape_reshape", remove_symbolic_same_shape_reshape),
    ("fuse_attention", fuse_attention),
    ("absorb_attention_reshapes", absorb_attention_reshapes),
    ("fuse_packed_rotary", fuse_packed_rotary),  # after the head reshapes: q and k are Rotary(.., num_heads)
    ("attention_key_mask", use_key_mask),  # a computed mask alike for every query: [B, 1, 1, T] (before the drop:
    # a mask proved one number throughout becomes a constant it drops)
    ("drop_empty_attention_mask", drop_empty_attention_mask),
    ("attention_mask_broadcast", use_broadcast_attention_mask),  # a materialised mask that masks: its small form
    ("fuse_skip_layer_norm", fuse_skip_layer_norm),
    ("fuse_layer_norm_quantize", fuse_layer_norm_quantize),  # after the residual joins the norm: Q in its store
    ("fuse_dequantize_into_layer_norm_quantize", fuse_dequantize_into_layer_norm_quantize),  # ... an E4M3 residual
    ("fuse_int8_layer_norm_quantize", fuse_int8_layer_norm_quantize),  # CPU: a uint8 Q in the norm's store
    ("fuse_int8_dequantize_into_layer_norm_quantize", fuse_int8_dequantize_into_layer_norm_quantize),  # ... its DQ'd
    # residual read as 8 bits (before the elementwise rules: the DQ would otherwise stay, read by the norm alone)
    ("batchnorm_as_affine", batchnorm_as_affine),  # a BatchNormalization no layer absorbed: a chain's Mul and Add
    ("fuse_elementwise", fuse_elementwise),
    ("fuse_dequantize_into_elementwise", fuse_dequantize_into_elementwise),  # an E4M3 tensor read by the chain
    ("fuse_quantize_into_elementwise", fuse_quantize_into_elementwise),  # ... and its result stored as E4M3
    ("fuse_int8_dequantize_into_elementwise", fuse_int8_dequantize_into_elementwise),  # CPU: a uint8 tensor read
    ("fuse_int8_quantize_into_elementwise", fuse_int8_quantize_into_elementwise),  # ... and the result stored uint8
    ("fuse_elementwise_into_qgemm", fuse_elementwise_into_qgemm),  # a chain reading an FP8 QGemm: its epilogue
    ("fuse_quantize_through_layout_into_qgemm", fuse_quantize_through_layout_into_qgemm),  # k's, past its transpose
    ("absorb_attention_reshapes_after_epilogue", absorb_attention_reshapes),  # ... which the attention then takes
    ("drop_zero_initial_states", drop_zero_initial_states),  # a dynamic batch's zero states: absent
    ("constant_reshape_target", constant_reshape_target),  # a dynamic batch's shape arithmetic: 0 and -1
    ("split_as_slices", split_as_slices),  # after every rule that reads a Split: the rest cut segments
    ("fuse_relayout", fuse_relayout),  # last: the rules above match Transposes and Reshapes of their own
    ("flatten_channels_last_runs", flatten_channels_last_runs),  # reads fuse_relayout's Relayouts
]
# Rules only a build for the CPU asks for (PassOptions): their fused op has a CPU kernel, and on CUDA the
# unfused layers are what was measured.
CPU_RULES = {"batchnorm_as_affine", "fuse_squeeze_excite", "fuse_conv_final_activation", "conv1d_as_conv2d",
             "conv1d_mean_as_global_pool",
             "drop_zero_initial_states", "constant_reshape_target", "remove_symbolic_same_shape_reshape",
             "split_as_slices", "fuse_relayout",
             "flatten_channels_last_runs", "fold_wide_quantize_into_layer", "fuse_int8_dequantize_into_elementwise",
             "fuse_int8_quantize_into_elementwise", "fuse_int8_layer_norm_quantize",
             "fuse_int8_dequantize_into_layer_norm_quantize", "fuse_padding_positions"}
# (fuse_packed_rotary and fuse_split_swiglu run for both: CUDA has cuda.rotary.triton over a packed q|k|v,
# the Triton attention's qkv_split, and kiln/tactics/cuda/swiglu.py for the gated GEMM)
# Rules only a build for CUDA asks for (PassOptions.cuda_rules): every CUDA tactic of their fused op takes
# it, the CPU's do not (a QConv with a residual would run as the float64 reference there).
CUDA_RULES = {"fuse_quantized_residual", "fuse_quantized_residual_fp8", "fuse_layer_norm_quantize",
              "fold_quantize_into_stem", "fuse_dequantize_into_elementwise", "fuse_quantize_into_elementwise",
              "fuse_elementwise_into_qgemm", "fuse_dequantize_into_layer_norm_quantize",
              "fuse_quantize_through_layout_into_qgemm", "absorb_attention_reshapes_after_epilogue"}
# Rules tried from opt_level 3 only: their fused layers are not yet measured on a GPU (default builds unchanged)
# (moved to opt_level 2 once timed, 2026-12-06, H100, FP8 QDQ BERT-base 64 x 384, bench/results/gpu-s22-2026-12-06.md:
# the E4M3 Q/DQ elementwise rules 17.53 -> 12.47 ms (bench/gpu_qadd.sh); the chain in the QGemm's epilogue, the norm
# reading an E4M3 residual, the key's quantize through its head layout 12.51 -> 9.86 ms (bench/gpu_fp8gemm.sh))
LEVEL3_RULES = {"fuse_quantized_residual_fp8"}
