"""Gate and up GEMMs of a gated MLP (Llama's SwiGLU) -> one kiln::FusedGemm, activation "SwiGLU".

    silu(x·W_gᵀ + b_g) * (x·W_uᵀ + b_u) = silu(h[..., :N]) * h[..., N:],   h = x·[W_g; W_u]ᵀ + [b_g; b_u]

Llama's MLP runs three steps per layer (gate GEMM with SiLU, up GEMM, their Mul); one GEMM
of twice the width reads x once and the gating happens on its output, so it is one step.
The split width N is half the output's last dim (both halves have the same width, checked).
Only layers without a residual qualify: the residual would have to apply to the gated output.
This rule runs before `merge_parallel_gemms`, which would otherwise merge the up GEMM with
other plain GEMMs reading x and hide the pair behind a Split.

Phi-3 exports the pair already merged (gate_up_proj, then chunk): `fuse_split_swiglu` takes

    gate, up = Split(h, 2 equal halves, axis=-1), h = x·Wᵀ + b (a plain FusedGemm read only there)
    gate·sigmoid(gate)·up  ->  FusedGemm(x, W, b, activation="SwiGLU")

W is already [W_gate; W_up]: the weight is reused as it is. Both devices: on the CPU kiln's GEMM gates
the tiles (cpu.gemm.kiln_packed), on CUDA kiln/tactics/cuda/swiglu.py (one Triton GEMM with two
accumulators, or cuBLAS and one gating kernel over the halves); the unfused form there was a GEMM, a Split
and an Elementwise step per layer.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    consumers,
    dtype_of,
    is_op,
    new_initializer,
    only_user,
    producer,
    replace_with,
)
from kiln.passes.fusion.epilogue import activation_of

RULE = "fuse_swiglu"
SPLIT_RULE = "fuse_split_swiglu"


def _layer(value: ir.Value, mul: ir.Node) -> ir.Node | None:
    """The FusedGemm (constant weight, no residual) producing `value`, read by `mul` only."""
    gemm = producer(value, "FusedGemm", KILN_DOMAIN)
    if gemm is None or len(gemm.inputs) > 3 or only_user(value) is not mul or const(gemm.inputs[1]) is None:
        return None
    return gemm


def _bias(gemm: ir.Node, width: int, dtype: np.dtype) -> np.ndarray | None:
    """The layer's bias as [width] (zeros when it has none); None when it is computed at run time."""
    if len(gemm.inputs) < 3 or gemm.inputs[2] is None:
        return np.zeros(width, dtype)
    bias = const(gemm.inputs[2])
    return None if bias is None else bias.reshape(width).astype(dtype)


def fuse_swiglu(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Mul") or node.inputs[0] is node.inputs[1]:
        return False
    layers = [_layer(v, node) for v in node.inputs]
    if None in layers:
        return False
    by_activation = {attr(n, "activation", ""): n for n in layers}
    gate, up = by_activation.get("SiLU"), by_activation.get("")
    if gate is None or up is None:
        return False  # not one SiLU GEMM and one plain GEMM
    if gate.inputs[0] is not up.inputs[0]:
        report.refuse(RULE, node, "the SiLU GEMM and the plain GEMM read different inputs")
        return False
    w_gate, w_up = const(gate.inputs[1]), const(up.inputs[1])  # [N, K] each
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype or dtype_of(gate.outputs[0]) != dtype_of(up.outputs[0]):
        report.refuse(RULE, node, f"gate weight {list(w_gate.shape)} {w_gate.dtype} and up weight "
                                  f"{list(w_up.shape)} {w_up.dtype} differ: the Mul would broadcast or cast")
        return False
    width = w_gate.shape[0]
    biases = [_bias(n, width, w_gate.dtype) for n in (gate, up)]
    if any(b is None for b in biases):
        return False  # a bias computed at run time
    graph = node.graph
    weight = np.concatenate([w_gate, w_up], axis=0)  # [2N, K]: h = [gate | up] on the last axis
    inputs = [gate.inputs[0], new_initializer(graph, f"{gate.inputs[1].name}_swiglu", weight)]
    if any(len(n.inputs) > 2 and n.inputs[2] is not None for n in (gate, up)):
        inputs.append(new_initializer(graph, f"{gate.name}_bias_swiglu", np.concatenate(biases)))
    attributes = [ir.AttrString("activation", "SwiGLU"), ir.AttrFloat32("alpha", 0.0), ir.AttrFloat32("beta", 0.0),
                  ir.AttrInt64("residual_after_activation", 1)]
    fused = ir.Node(KILN_DOMAIN, "FusedGemm", inputs, attributes, name=f"{gate.name}_swiglu")
    first = min((gate, up), key=lambda n: list(graph).index(n))
    replace_with([gate, up, node], fused, node.outputs[0], insert_before=first)
    return True


def _halves(split: ir.Node) -> bool:
    """Split of a 3-D or 2-D value's last axis into two outputs of one static width."""
    x = split.inputs[0]
    if x.shape is None or len(split.outputs) != 2 or any(v.shape is None for v in split.outputs):
        return False
    rank = len(x.shape)
    widths = [v.shape[-1] for v in split.outputs]
    return attr(split, "axis", 0) in (-1, rank - 1) and isinstance(widths[0], int) and widths[0] == widths[1]


def fuse_split_swiglu(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Mul") or node.inputs[0] is node.inputs[1]:
        return False
    split = producer(node.inputs[0], "Split") or producer(node.inputs[1], "Split")
    if split is None or len(split.outputs) != 2:
        return False
    gate, up = split.outputs
    silu = activation_of(gate)
    if silu is None or silu[0] != "SiLU" or up not in node.inputs or silu[4] not in node.inputs:
        return False  # not silu(first half) · second half
    gemm = producer(split.inputs[0], "FusedGemm", KILN_DOMAIN)
    if gemm is None or consumers(split.inputs[0]) != [split] or split.inputs[0].is_graph_output():
        return False
    if not _halves(split):
        report.refuse(SPLIT_RULE, node, "the Split does not halve the GEMM's last axis")
        return False
    if attr(gemm, "activation", "") or len(gemm.inputs) > 3 or const(gemm.inputs[1]) is None:
        report.refuse(SPLIT_RULE, node, "the GEMM has an activation or a residual, or a weight computed at run time")
        return False
    if consumers(up) != [node] or up.is_graph_output():
        report.refuse(SPLIT_RULE, node, "the up half is read elsewhere too")
        return False
    attributes = [ir.AttrString("activation", "SwiGLU"), ir.AttrFloat32("alpha", 0.0), ir.AttrFloat32("beta", 0.0),
                  ir.AttrInt64("residual_after_activation", 1)]
    fused = ir.Node(KILN_DOMAIN, "FusedGemm", list(gemm.inputs), attributes, name=f"{gemm.name}_swiglu")
    replace_with([gemm, split, *silu[3], node], fused, node.outputs[0], insert_before=gemm)
    return True
