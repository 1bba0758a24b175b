"""The optimization pipeline: one function, each pass named, one line saying why.

Opt levels (like TensorRT's builder optimization level):
  0  import and run as is
  1  cleanups: constant folding (incl. static shape arithmetic), no-op removal, CSE, DCE
  2  + BatchNorm/affine folding into weights, and the fusions into kiln ops (default)
  3+ the same graph as 2 (the higher levels widen tactic search, not the graph)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import common

from kiln.ir.verify import verify
from kiln.ops.registry import lookup
from kiln.passes import fusion
from kiln.passes._rewrite import WEIGHTS_APART, PassReport, graphs_of, run_rule, shares_weights
from kiln.passes.batchnorm import fold_batchnorm_and_affine
from kiln.passes.broadcast_expand import drop_broadcast_expands
from kiln.passes.dce import eliminate_dead_code
from kiln.passes.fold import fold_constants
from kiln.passes.fusion.qdq_propagate import RULE_UNSIGNED, use_unsigned_activations
from kiln.passes.noop import remove_noops
from kiln.passes.remove_padding import REMOVE_PADDING, remove_padding
from kiln.passes.uniform_gather import fill_uniform_gathers


@dataclass
class PassOptions:
    """What the pipeline needs to know (the builder derives it from its BuildConfig)."""

    opt_level: int = 2  # 0: as is; 1: cleanups; 2+: + BN folding and fusions
    fusions: bool = True  # False: stop after BN folding (post-training quantization measures that graph)
    verify: bool = False  # run the IR verifier after every pass (also when KILN_VERIFY=1: the tests set it)
    # int8 activation Q/DQ pairs made uint8 (exact: zero point + 128): the CPU's int8 kernels are exact
    # only on unsigned sources without VNNI (kiln/passes/fusion/qdq_propagate.py)
    unsigned_activations: bool = False
    # rules whose fused op has a CPU kernel only (fusion.CPU_RULES: squeeze-and-excitation blocks)
    cpu_rules: bool = False
    # rules whose fused op only CUDA's tactics run (fusion.CUDA_RULES: the residual add in a QConv's epilogue)
    cuda_rules: bool = False
    # a refittable build (BuildConfig.refittable): weights are never shared because their values are
    # equal (a freshly initialised model's LayerNorm weights and zero biases would be stored once, and
    # trained weights, no longer equal, would not fit the engine)
    refittable: bool = False
    # an encoder's per-token layers on its real tokens only, outputs at padding positions zero (opt-in;
    # kiln/passes/remove_padding.py): refused with the reason when the model cannot
    remove_padding: bool = False
    # ... with each attention on q/k/v scattered back to [batch, seq] (a device's padded attention kernel) instead
    # of PackedAttention over the packed tokens (the builder's choice on every device: CUDA's varlen flash, the
    # CPU's varlen C kernel; on the CPU the padded form measured up to 1.8x slower, bench/results/remove-padding-*)
    padded_attention: bool = False


def _verifier(options: PassOptions):
    """verify(model, stage) between passes when options.verify or KILN_VERIFY=1."""
    if not (options.verify or os.environ.get("KILN_VERIFY") == "1"):
        return lambda model, stage, require_order=False: None
    return lambda model, stage, require_order=False: verify(model, lookup, f"after {stage}", require_order)


def cleanup(model: ir.Model, report: PassReport, check=lambda model, stage: None) -> None:
    # Constant nodes become initializers, so every constant looks the same to the rules.
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    # Identical weights (tied embeddings, repeated constants) are stored and loaded once.
    if shares_weights(model.graph):
        common.DeduplicateInitializersPass()(model)
        check(model, "deduplicate_initializers")
    # Run once at build what would give the same answer on every run (shapes included).
    fold_constants(model, report)
    check(model, "fold_constants")
    # Identity, inference Dropout, Reshape/Transpose/Cast chains that cancel.
    remove_noops(model, report)
    check(model, "remove_noops")
    # A GatherElements from data of one value (RoBERTa's token types at symbolic shapes): a fill of its indices' shape.
    fill_uniform_gathers(model, report)
    check(model, "fill_uniform_gathers")
    # An Expand whose readers broadcast anyway (BERT's token-type ids at batch > 1) copies for nothing.
    drop_broadcast_expands(model, report)
    check(model, "drop_broadcast_expands")
    # Folding may expose more constants (a Reshape of a folded shape); one more round.
    fold_constants(model, report)
    # Identical subexpressions (same op, inputs, attributes) need computing once.
    common.CommonSubexpressionEliminationPass()(model)
    check(model, "common_subexpression_elimination")
    # Nodes and weights nobody reads cost time and memory for nothing.
    eliminate_dead_code(model, report)
    check(model, "eliminate_dead_code")


def optimize(model: ir.Model, options: PassOptions | None = None, report: PassReport | None = None) -> ir.Model:
    options = options or PassOptions()
    report = report if report is not None else PassReport()
    for graph in graphs_of(model) if options.refittable else ():
        graph.meta[WEIGHTS_APART] = True  # read by the rewrites' weight sharing and by lowering
    if options.opt_level == 0:  # import and run as is
        return model
    check = _verifier(options)
    cleanup(model, report, check)
    if options.opt_level >= 2:
        # BatchNorm and per-channel Mul/Add disappear into the preceding layer's weights.
        fold_batchnorm_and_affine(model, report)
        check(model, "fold_batchnorm_and_affine")
        # Fewer, larger steps: every fusion rule in order (recognise patterns, then fuse
        # layers with their epilogues, then whatever elementwise chains remain).
        if options.fusions and options.unsigned_activations:
            run_rule(model, RULE_UNSIGNED, use_unsigned_activations, report)
            check(model, RULE_UNSIGNED)
        for name, rule in fusion.RULES if options.fusions else ():
            if name in fusion.CPU_RULES and not options.cpu_rules:
                continue
            if name in fusion.CUDA_RULES and not options.cuda_rules:
                continue
            if name in fusion.LEVEL3_RULES and options.opt_level < 3:
                continue
            if run_rule(model, name, rule, report):
                # What a rewrite replaced is dead (a decomposed attention's shape arithmetic still reading
                # its key): gone before the next rule counts a value's readers.
                eliminate_dead_code(model, report)
            check(model, name)
        eliminate_dead_code(model, report)
    if options.remove_padding:
        pack_real_tokens(model, options, report)
    # Steps run in list order: keep it topological after the rewrites.
    common.TopologicalSortPass()(model)
    check(model, "the pipeline", require_order=True)
    model.meta["kiln.pass_report"] = report
    return model


def pack_real_tokens(model: ir.Model, options: PassOptions, report: PassReport | None = None) -> ir.Model:
    """The pipeline's last rewrite on its own: `optimize(model, options)` is `optimize` without remove_padding, then
    this. The builder lowers the graph in between: a padding-free engine also carries the plain program
    (kiln/builder/padding_free.py)."""
    report = report if report is not None else PassReport()
    check = _verifier(options)
    # Opt-in, and it changes outputs at padding positions (zeros): the padding tokens are not computed at all.
    # From the embeddings on CUDA; on the CPU packed ids and lookups would leave kiln's native segment (its PackTokens
    # moves float32 rows), and the CPU pads no run beyond its own shape: not done there.
    model.meta[REMOVE_PADDING] = remove_padding(model, options.padded_attention,
                                                embeddings=not options.cpu_rules).to_json()
    eliminate_dead_code(model, report)  # the attention mask's [B, 1, S, S] subgraph
    check(model, "remove_padding")
    common.TopologicalSortPass()(model)
    check(model, "the pipeline", require_order=True)
    return model


def why_not(model: ir.Model, options: PassOptions | None = None) -> list[str]:
    """Candidate fusions that did not fire, each with the rule's reason (`kiln inspect --why-not`).

    Works on a copy: the caller's model is not changed.
    """
    copy = ir.from_proto(ir.to_proto(model))
    report = PassReport()
    optimize(copy, options, report)
    return list(report.refused)
