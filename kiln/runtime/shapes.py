"""Which steps compute shapes: values that depend on the input shapes alone, not on the data.

Exported transformers carry dozens of such steps (Shape, Gather on a shape, Concat of dims,
Range over a length, the position ids and the index grids of the mask...). For one signature of
input shapes their results never change, so the runtime computes them once per signature and
remembers them, as TensorRT computes shape tensors on the host: on the CPU the loop then skips
them, on CUDA they never touch the device (and never keep a graph from being captured).

A value is *shape-only* when it is a constant, the output of Shape/Size of a value whose shape is
*stable*, or the output of any deterministic op whose inputs are all shape-only. A value's shape is
stable (a function of the input shapes) unless an op decides it from data: NonZero, Unique,
NonMaxSuppression, Compress, a control-flow or sequence op, or an op whose shape-giving input
(HOST_INPUTS: Reshape's shape, Slice's starts, TopK's k...) is not shape-only; instability flows
downstream.
"""

from __future__ import annotations

from kiln.plan.spec import ProgramSpec

NEVER_ON_HOST = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
SHAPE_OPS = {"Shape", "Size"}  # read only their input's shape

# Inputs an op reads on the host as values (shapes, axes, counts, scalars: kiln/ops reads them with
# ints() or scalar()), by op and input index. They decide output shapes; on CUDA they stay on the host.
_REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
HOST_INPUTS: dict[str, frozenset[int]] = {op: frozenset(inputs) for op, inputs in {
    "Reshape": {1}, "Split": {1}, "Slice": {1, 2, 3, 4}, "Squeeze": {1}, "Unsqueeze": {1}, "Expand": {1},
    "Tile": {1, 2, 3}, "Pad": {1, 2, 3}, "CenterCropPad": {1}, "ConstantOfShape": {0}, "Range": {0, 1, 2},
    "Dropout": {1, 2}, "TopK": {1}, "OneHot": {1}, "Trilu": {1}, "MaxUnpool": {2}, "Col2Im": {1, 2},
    "AffineGrid": {1}, "NonMaxSuppression": {2, 3, 4}, "Resize": {1, 2, 3}, "Upsample": {1}, "Clip": {1, 2},
    "If": {0}, "Loop": {0, 1}, "SplitToSequence": {1}, "SequenceAt": {1}, "SequenceInsert": {2},
    "SequenceErase": {1}, "DFT": {1, 2}, "STFT": {1, 3}, "CumSum": {1},
    **{op: {1} for op in _REDUCE_OPS},
}.items()}

# Ops whose output shapes come from the data itself.
DATA_DEPENDENT_SHAPES = {"NonZero", "Unique", "NonMaxSuppression", "Compress", "StringSplit", "If", "Loop", "Scan",
                         "TfIdfVectorizer", "StringNormalizer",
                         "TokenIndex"}  # kiln's: a padding mask's real tokens (kiln/ops/tokens.py)


def shape_only_steps(spec: ProgramSpec) -> tuple[set[int], set[str]]:
    """(indices of the steps computing shape-only values, the names of those values)."""
    stable = set(spec.inputs) | set(spec.constants)  # values whose shape is a function of the input shapes
    shape_only = set(spec.constants)
    steps: set[int] = set()
    for i, step in enumerate(spec.steps):
        names = [n for n in step.inputs if n]
        outputs = [n for n in step.outputs if n]
        nested = bool(step.captures) or any(isinstance(v, dict) and ("$graph" in v or "$graphs" in v)
                                            for v in step.attributes.values())
        if nested or step.op_type in NEVER_ON_HOST or "Sequence" in step.op_type or "Optional" in step.op_type:
            continue  # neither shape-only nor of stable shape
        if step.op_type in SHAPE_OPS and step.domain == "":
            if names and names[0] in stable:
                shape_only.update(outputs), stable.update(outputs), steps.add(i)
            continue
        if all(n in shape_only for n in names):  # constants in, constants out (for this signature)
            shape_only.update(outputs), stable.update(outputs), steps.add(i)
            continue
        if step.op_type in DATA_DEPENDENT_SHAPES:
            continue
        host = HOST_INPUTS.get(step.op_type, frozenset()) if step.domain == "" else frozenset()
        if all(n in stable for n in names) and all(step.inputs[j] in shape_only for j in host
                                                   if j < len(step.inputs) and step.inputs[j]):
            stable.update(outputs)
    return steps, shape_only
