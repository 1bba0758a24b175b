"""FP8 attention in kiln's own FP8 quantization (CUDA): the scale at which an attention may compute in E4M3.

An exported attention, before the optimizer fuses it into one kiln::Attention (kiln/passes/fusion/attention.py):

    MatMul(q, kᵀ) [·c] [+ M] [·d] -> Softmax -> [Where(IsNaN(P), 0, P)] -> MatMul(P, v)

Calibration measures q, kᵀ and v (their largest magnitudes on the calibration data) and the record keeps one
scale per attention, max(amax_q, amax_k, amax_v) / 448, keyed by the name of the MatMul(P, v), which the fused
kiln::Attention inherits. The builder gives each such attention that scale as its `fp8_scale` attribute: a
permission, not a change of what the op computes. The op stays exact attention; a CUDA tactic may then run the
layer with E4M3 products (cuda.attention.triton_fp8.*: q, k and v put on the E4M3 grid at that scale as they
are loaded, the probabilities at 1/448), checked against the op on the E4M3-rounded inputs and timed against
the fp16 tactics like any candidate. One scale for the three: the fused layer reads them as one QKV output,
and E4M3's exponent keeps a tensor several times smaller than the largest on normal values (448/4 = 112).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

FP8_MAX = 448.0  # float8e4m3fn
_SCORE_OPS = ("Add", "Mul", "Div", "Where")  # a mask and scalar scales between Q·Kᵀ and the Softmax


@dataclass(frozen=True)
class AttentionInputs:
    """One exported attention: the MatMul(P, v) it is named after and the activations E4M3 would round."""

    name: str  # the MatMul(P, v)'s node name: the fused kiln::Attention's
    q: ir.Value
    k_transposed: ir.Value
    v: ir.Value

    @property
    def activations(self) -> tuple[str, str, str]:
        return self.q.name, self.k_transposed.name, self.v.name


def _only_user(value: ir.Value) -> ir.Node | None:
    users = {id(use.node): use.node for use in value.uses()}
    return next(iter(users.values())) if len(users) == 1 and not value.is_graph_output() else None


def _is(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in ("", "ai.onnx") and node.op_type in ops


def _scores_matmul(value: ir.Value, depth: int = 4) -> ir.Node | None:
    """The MatMul of two activations that `value` is, through at most `depth` mask/scale ops."""
    node = value.producer()
    if _is(node, "MatMul"):
        return node if all(x is not None and x.const_value is None for x in node.inputs) else None
    if depth == 0 or not _is(node, *_SCORE_OPS):
        return None
    candidates = node.inputs[1:2] if node.op_type == "Where" else node.inputs  # Where(C, scores, fill)
    for x in candidates:
        if x is not None and x.const_value is None and (found := _scores_matmul(x, depth - 1)) is not None:
            return found
    return None


def _weighted_matmul(probs: ir.Value) -> ir.Node | None:
    """The MatMul(P, v) reading the softmax output, directly or through the NaN guard Where(IsNaN(P), 0, P)."""
    users = [use.node for use in probs.uses()]
    guard = next((n for n in users if _is(n, "Where") and n.inputs[2] is probs), None)
    if guard is not None:
        probs = guard.outputs[0]
        users = [use.node for use in probs.uses()]
    user = _only_user(probs)
    return user if _is(user, "MatMul") and user.inputs[0] is probs else None


def find(graph: ir.Graph) -> list[AttentionInputs]:
    """Every attention of the (unfused) graph, in order."""
    found = []
    for node in graph:
        if not _is(node, "Softmax") or node.inputs[0] is None:
            continue
        scores, weighted = _scores_matmul(node.inputs[0]), _weighted_matmul(node.outputs[0])
        if scores is None or weighted is None or not weighted.name or weighted.inputs[1] is None:
            continue
        found.append(AttentionInputs(weighted.name, scores.inputs[0], scores.inputs[1], weighted.inputs[1]))
    return found


def scales(found: list[AttentionInputs], ranges: dict) -> dict[str, float]:
    """{attention name: its E4M3 scale} for each attention whose three activations were measured non-zero."""
    result = {}
    for attention in found:
        amax = [float(ranges[name]) for name in attention.activations if name in ranges]
        if len(amax) == 3 and min(amax) > 0 and all(a < float("inf") for a in amax):
            result[attention.name] = max(amax) / FP8_MAX
    return result
