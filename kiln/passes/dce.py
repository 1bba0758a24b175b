"""Dead code elimination: nodes whose outputs nobody reads, and initializers nobody reads.

Dead nodes cost time; dead initializers cost engine size (folding and fusions leave the
old weights behind). Graph inputs are never removed: they are the engine's interface.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common

from kiln.passes._rewrite import PassReport, graphs_of


def eliminate_dead_code(model: ir.Model, report: PassReport) -> int:
    before = sum(g.num_nodes() for g in graphs_of(model))
    common.RemoveUnusedNodesPass()(model)
    removed = before - sum(g.num_nodes() for g in graphs_of(model))
    report.count("eliminate_dead_code", removed)
    return removed
