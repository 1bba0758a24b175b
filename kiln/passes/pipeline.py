"""The optimization pipeline: one function, each pass named, one line saying why."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common

from kiln.engine.config import BuildConfig


def optimize(model: ir.Model, config: BuildConfig) -> ir.Model:
    if config.opt_level == 0:  # import and run as is
        return model
    # Identity nodes only rename values; removing them shortens the step list.
    common.IdentityEliminationPass()(model)
    # Nodes whose outputs nobody reads cost time and memory for nothing.
    common.RemoveUnusedNodesPass()(model)
    # Identical subexpressions (same op, inputs, attributes) need computing once.
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)
    # Steps run in list order: keep it topological after the rewrites.
    common.TopologicalSortPass()(model)
    return model
