"""CPU recurrent-layer tactics on kiln's own C loop (kiln/kernels/cpu/recurrent.c, lstm.c).

    cpu.rnn.native    ONNX RNN
    cpu.gru.native    ONNX GRU, linear_before_reset 0 (ONNX's default, which torch's kernels cannot run) and 1
    cpu.lstm.native   ONNX LSTM, peepholes and input_forget included
    cpu.lstm.lanes    ONNX LSTM with the default activations (no clip, peepholes, input_forget): the batch (<= 8)
                      in the vector lanes, the input projection and the cell inside each step's tile
                      (lstm_lanes.c); a larger batch runs cpu.lstm.native's loop.
    cpu.lstm.fused    the same LSTMs, any batch: the batch in the rows, the four gates of a block of hidden
                      units in one vector each, input projection, recurrent GEMM and cell in one register tile
                      (lstm_fused.c); at two threads and more each thread runs a slice of the batch's rows
                      (with AVX2, a slice of 4 rows on the wide tile that reads each weight once a step).
    cpu.lstm.fused_blocks
                      cpu.lstm.fused with the threads splitting each step's unit blocks instead (a barrier a
                      step): the faster form on the Zen 4 EPYC with AVX-512 (forecaster, 2 threads), the row split
                      on the Xeon and, since the wide tile, capped to AVX2 (lstm_fused.c's notes on
                      kiln_lstm_fused_row_split and kiln_lstm_fused_wide). The builder times the four; `kiln
                      inspect` names each layer's pick and the runner-up.

Each: every direction and layout, initial states, sequence_lens (given at run time), clip, every activation
of the spec but Softplus (with activation_alpha / activation_beta), outputs Y, Y_h (, Y_c). Per direction,
W and R are packed once at load; a call is the input projection of every step as one GEMM and then one
loop over time in C (recurrent GEMM + cell per block of hidden units, one barrier a step; the GRU with
linear_before_reset=0 two).

Inside a native segment each is one call (kiln/kernels/cpu/recurrent.py RecurrentLayer): every direction and
layout, the initial states and sequence_lens constants of the engine or values the graph computes (sequence_lens
int32, checked by the call: a length outside [0, seq_length] is an error naming the layer). Y is written row-major
([S, D, N, H], layout 1 [N, S, D, H]); a segment joins after it only the layers that read it so (kiln's relayout
in its row-reading form, NativeStep.reading_rows, for the exporter's Transpose + Reshape). Two directions run one
per thread at two threads. What stays a step of its own says why in `kiln inspect` (launch.not_native).

What they leave to the op's own implementation (kiln/ops/rnn.py): W, R, B or P computed by the graph
rather than constants of the engine, other dtypes than float32, the Softplus activation, and at run time
an empty X, malformed states or sequence_lens (the op's path raises its errors for those).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import onednn, recurrent
from kiln.ops.registry import lookup
from kiln.ops.rnn import activation_names, activation_parameters
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, Tactic, resizable, same_primitive, tensor_input
from kiln.tactics.tactic import attribute as _attr

_INITIAL_H, _LENGTHS, _PEEPHOLES = 5, 4, 7  # ONNX input indices (LSTM: initial_c 6, P 7)
_SPEC_DEFAULTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}


def _directions(step: StepSpec) -> int:
    return 2 if _attr(step, "direction", "forward") == "bidirectional" else 1


def _activations(cell: str, step: StepSpec) -> list[list[recurrent.Activation]]:
    """Per direction, the spec's f, g(, h) with their alpha / beta (kiln/ops/rnn.py's reading)."""
    directions = _directions(step)
    names = activation_names(_attr(step, "activations", []) or None, _SPEC_DEFAULTS[cell], directions)
    parameters = activation_parameters(names, _attr(step, "activation_alpha", None),
                                       _attr(step, "activation_beta", None))
    k = len(_SPEC_DEFAULTS[cell])
    if len(parameters) != k * directions:
        raise ValueError(f"{cell}: {len(parameters)} activations for {directions} direction(s) of {k} each")
    return [[recurrent.Activation(n, a or 0.0, b or 0.0) for n, a, b in parameters[d * k:(d + 1) * k]]
            for d in range(directions)]


def _supporter(cell: str):
    gates = recurrent.GATES[cell]

    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        if not recurrent.available():
            return f"kiln's recurrent layers are not built: {recurrent.reason()}"
        x, w, r = inputs[0], tensor_input(inputs, 1), tensor_input(inputs, 2)
        b = tensor_input(inputs, 3)
        if x.shape is None or len(x.shape) != 3:
            return "X is not a 3-D tensor"
        directions = _directions(step)
        if w is None or r is None or not (w.constant and r.constant) or len(w.shape) != 3 or len(r.shape) != 3:
            return "W and R are not constant 3-D tensors of the engine"
        if w.dtype != torch.float32 or r.dtype != torch.float32:
            return "W or R is not float32"
        hidden = r.shape[2]
        if w.shape[0] != directions or r.shape[0] != directions or w.shape[1] != gates * hidden \
                or r.shape[1] != gates * hidden:
            return f"W {list(w.shape)} / R {list(r.shape)} are not [{directions}, {gates}·H, ·] for H = {hidden}"
        if w.shape[2] != x.shape[2]:
            return f"X's input size {x.shape[2]} is not W's {w.shape[2]}"
        if b is not None and (not b.constant or list(b.shape) != [directions, 2 * gates * hidden]
                              or b.dtype != torch.float32):
            return f"B is not a constant float32 [{directions}, {2 * gates}·H]"
        lengths = tensor_input(inputs, _LENGTHS)
        if lengths is not None and lengths.dtype not in (torch.int32, torch.int64):
            return f"sequence_lens is {lengths.dtype}, not int32"
        p = tensor_input(inputs, _PEEPHOLES) if cell == "LSTM" else None
        if p is not None and (not p.constant or list(p.shape) != [directions, 3 * hidden] or p.dtype != torch.float32):
            return f"P is not a constant float32 [{directions}, 3·H]"
        try:
            per_direction = _activations(cell, step)
        except ValueError as e:
            return str(e)
        unsupported = sorted({a.name for acts in per_direction for a in acts} - set(recurrent.ACTIVATIONS))
        if unsupported:
            return f"activations {unsupported} (kiln's loop has {sorted(recurrent.ACTIVATIONS)})"
        clip = _attr(step, "clip", None)
        if clip is not None and not float(clip) > 0:
            return f"clip={clip} is not positive"
        if int(_attr(step, "hidden_size", hidden)) != hidden:
            return f"hidden_size {_attr(step, 'hidden_size', None)} is not R's {hidden}"
        return True

    return supports


def _configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    """X's size at the build shape: the layer's call inside a native segment is bound at it; and sequence_lens'
    dtype when the graph computes it (a segment reads it as int32)."""
    config: dict[str, Any] = {"x_size": list(inputs[0].shape)} if inputs[0].shape is not None else {}
    lengths = tensor_input(inputs, _LENGTHS)
    if lengths is not None and not lengths.constant:
        config["lengths_dtype"] = str(lengths.dtype).removeprefix("torch.")
    return config


def _native_reason(step: StepSpec, constants: list[Any]) -> str | None:
    """Why the layer cannot be a native segment's member (None: it can). A member is bound at its sizes with
    every operand but X, sequence_lens and the states the graph computes fixed."""
    if not onednn.available():
        return f"a segment's operands are oneDNN memory objects, and oneDNN is unavailable: {onednn.reason()}"
    if len(step.tactic_config.get("x_size", ())) != 3:
        return "X's size at the build shape is not in the step's config"
    constant_lengths = len(constants) > _LENGTHS and constants[_LENGTHS] is not None
    if len(step.inputs) > _LENGTHS and step.inputs[_LENGTHS] and not constant_lengths \
            and step.tactic_config.get("lengths_dtype") != "int32":
        return (f"sequence_lens is {step.tactic_config.get('lengths_dtype', 'of a dtype not recorded')} at run time: "
                "a segment reads it as int32 (the ONNX type)")
    return None


def _preparer(cell: str, loop: str = "rows"):
    """`loop`: "rows" (recurrent.c / lstm.c), "lanes" (the LSTM on lstm_lanes.c up to its batch, the row loop,
    built on first use, past it), "fused" (the LSTM on lstm_fused.c, any batch, the threads splitting the batch's
    rows) or "fused_blocks" (the same, the threads splitting each step's unit blocks)."""
    lanes, fused = loop == "lanes", loop in ("fused", "fused_blocks")
    split = "blocks" if loop == "fused_blocks" else None  # None: the library's default, the rows (set_row_split)
    op = lookup(cell, "").fn
    has_c = cell == "LSTM"

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        W, R = constants[1], constants[2]
        B = constants[3] if len(constants) > 3 else None
        P = constants[_PEEPHOLES] if has_c and len(constants) > _PEEPHOLES else None
        directions = _directions(step)
        clip = _attr(step, "clip", None)
        per_direction = _activations(cell, step)

        def row_layers() -> list[recurrent.RecurrentDirection]:
            return [recurrent.RecurrentDirection(
                cell, W[d], R[d], None if B is None else B[d], peepholes=None if P is None else P[d],
                linear_before_reset=bool(int(_attr(step, "linear_before_reset", 0))),
                input_forget=bool(int(_attr(step, "input_forget", 0))), activations=per_direction[d],
                clip=None if clip is None else float(clip)) for d in range(directions)]

        rows: list[recurrent.RecurrentDirection | recurrent.FusedLSTMDirection] = []  # lanes: built past the lanes
        if fused:
            rows = [recurrent.FusedLSTMDirection(W[d], R[d], None if B is None else B[d], split=split)
                    for d in range(directions)]
        elif not lanes:
            rows = row_layers()
        lane_layers = [recurrent.LanesLSTMDirection(W[d], R[d], None if B is None else B[d])
                       for d in range(directions)] if lanes else []
        lane_batch = lane_layers[0].lanes if lanes else 0
        hidden = (lane_layers or rows)[0].hidden
        inputs = (lane_layers or rows)[0].inputs
        reverse_only = _attr(step, "direction", "forward") == "reverse"
        batch_major = bool(int(_attr(step, "layout", 0)))

        def directions_for(batch: int) -> list:
            if batch <= lane_batch:
                return lane_layers
            if not rows:  # a batch past the lanes: the row loop, packed once
                rows[:] = row_layers()
            return rows

        def launch(ctx, X, W_=None, R_=None, B_=None, sequence_lens=None, initial_h=None, *rest, **attributes):
            initial_c = rest[0] if has_c and rest else None
            fallback = (X, W_, R_, B_, sequence_lens, initial_h, *rest)
            if X.dtype != torch.float32 or X.dim() != 3 or X.shape[2] != inputs or X.numel() == 0:
                return op(ctx, *fallback, **attributes)  # what this loop does not run: the op's path (and its errors)
            batch, steps = (X.shape[0], X.shape[1]) if batch_major else (X.shape[1], X.shape[0])
            state_size = (batch, directions, hidden) if batch_major else (directions, batch, hidden)
            if any(s is not None and tuple(s.shape) != state_size for s in (initial_h, initial_c)):
                return op(ctx, *fallback, **attributes)
            lengths = None
            if sequence_lens is not None:
                lengths = sequence_lens.reshape(-1).to(device="cpu", dtype=torch.int32).contiguous()
                if lengths.numel() != batch or int(lengths.min()) < 0 or int(lengths.max()) > steps:
                    return op(ctx, *fallback, **attributes)  # (its error names the node and the lengths)
                if int(lengths.min()) == steps:
                    lengths = None  # every sequence full
            X = X.contiguous()  # [S, N, I] (layout 1: [N, S, I])
            if batch_major:
                Y = X.new_empty((batch, steps, directions, hidden))  # [N, S, D, H]
            else:
                Y = X.new_empty((steps, directions, batch, hidden))  # [S, D, N, H]
            finals = [X.new_empty(state_size) for _ in range(2 if has_c else 1)]  # [D, N, H] | [N, D, H]
            states = [None if s is None else s.to(torch.float32).contiguous() for s in (initial_h, initial_c)]
            for d, layer in enumerate(directions_for(batch)):
                def state(s):  # direction d's [N, H] (a strided view in layout 1)
                    return None if s is None else (s[:, d] if batch_major else s[d])
                y = Y[:, :, d] if batch_major else Y[:, d]
                layer.run(X, y, state(states[0]), state(states[1]), state(finals[0]),
                          state(finals[1]) if has_c else None, reverse=reverse_only or d == 1,
                          batch_major=batch_major, lengths=lengths)
            return (Y, *finals)

        @resizable

        def native_at(sizes: dict[int, tuple[int, ...]]) -> NativeStep:
            """The layer at X's size `sizes[0]` (and the states', where the graph computes them), as a segment
            binds it."""
            x_size = tuple(sizes[recurrent.X_INPUT])
            if len(x_size) != 3 or x_size[2] != inputs or min(x_size) < 1:
                raise ValueError(f"X {list(x_size)} is not [S, N, {inputs}] (layout {int(batch_major)})")
            batch, steps = (x_size[0], x_size[1]) if batch_major else (x_size[1], x_size[0])
            lengths = constant_lengths
            if lengths is not None:
                if lengths.numel() != batch or int(lengths.min()) < 0 or int(lengths.max()) > steps:
                    raise ValueError(f"the constant sequence_lens {lengths.tolist()} are not {batch} lengths in "
                                     f"[0, {steps}]")
                if int(lengths.min()) == steps:
                    lengths = None  # every sequence full
            # Y [S, D, N, H] (layout 1: [N, S, D, H]) is written row-major: the segment joins the layers that read it
            # so (a Reshape's alias where both orders agree, a relayout's walk of row-major memory) and closes before the
            # others
            layer = recurrent.RecurrentLayer(directions_for(batch), steps, batch, batch_major=batch_major,
                                             reverse_only=reverse_only, initial=initial, finals=2 if has_c else 1,
                                             lengths=lengths)
            if any(s is not None and tuple(s.shape) != layer.state_size for s in initial):
                raise ValueError(f"the constant initial states are not {list(layer.state_size)}")
            reads = {recurrent.X_INPUT: (x_size, torch.float32)}
            if lengths_input:
                reads[recurrent.LENGTHS] = ((batch,), torch.int32)
            reads.update({k: (layer.state_size, torch.float32) for k in state_inputs})
            return NativeStep(x_size, layer.output_size, same_primitive(layer), reads=reads,
                              more_outputs=layer.more_outputs)

        # the initial states: constants of the engine (bound into the layer), or values the graph computes (read)
        state_indices = (_INITIAL_H, _INITIAL_H + 1) if has_c else (_INITIAL_H,)
        constant_states = [constants[k] if k < len(constants) else None for k in state_indices]
        state_inputs = [k for k, c in zip(state_indices, constant_states)
                        if k < len(step.inputs) and step.inputs[k] and c is None]
        initial = tuple(None if c is None else c.to(torch.float32).contiguous() for c in constant_states)
        initial += (None,) * (2 - len(initial))
        constant_lengths = constants[_LENGTHS] if len(constants) > _LENGTHS else None
        if constant_lengths is not None:
            constant_lengths = constant_lengths.reshape(-1).to(torch.int32).contiguous()
        lengths_input = constant_lengths is None and len(step.inputs) > _LENGTHS and bool(step.inputs[_LENGTHS])
        launch.not_native = _native_reason(step, constants)  # kiln inspect says it
        if launch.not_native is None:
            try:
                launch.native = native_at({recurrent.X_INPUT: tuple(step.tactic_config["x_size"])})
            except ValueError as e:  # states or lengths of another size: a step of its own
                launch.not_native = str(e)
        return launch

    return prepare


for _cell in ("RNN", "GRU", "LSTM"):
    register(Tactic(
        name=f"cpu.{_cell.lower()}.native", op_type=_cell, domain="", device="cpu", dtypes=(torch.float32,),
        supports=_supporter(_cell), configure=_configure, prepare=_preparer(_cell), available=recurrent.available,
        native=True,
        description=f"{_cell} as kiln's C loop: input projection as one GEMM, recurrent GEMM + cell per unit "
                    "block and step",
    ))


def _supports_default_cell(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """cpu.lstm.native's conditions, and what lstm_lanes.c and lstm_fused.c compute: the default activations,
    no clip, peepholes or input_forget. Any batch: past the lanes (recurrent.lanes_batch()) cpu.lstm.lanes runs
    the row loop, so a profile's whole range stays on the tactic (the builder checks its ends)."""
    answer = _supporter("LSTM")(step, inputs)
    if answer is not True:
        return answer
    if any(a != recurrent.Activation(n.lower()) for acts in _activations("LSTM", step)
           for a, n in zip(acts, _SPEC_DEFAULTS["LSTM"])):
        return "activations other than the defaults (Sigmoid, Tanh, Tanh): cpu.lstm.native runs them"
    if _attr(step, "clip", None) is not None or int(_attr(step, "input_forget", 0)) \
            or tensor_input(inputs, _PEEPHOLES) is not None:
        return "clip, input_forget or peepholes: cpu.lstm.native runs them"
    return True


register(Tactic(
    name="cpu.lstm.lanes", op_type="LSTM", domain="", device="cpu", dtypes=(torch.float32,),
    supports=_supports_default_cell, configure=_configure, prepare=_preparer("LSTM", "lanes"),
    available=recurrent.available, native=True,
    description="LSTM as kiln's C loop with the batch (<= 8) in the vector lanes: input projection and cell "
                "inside each step's tile",
))

# cpu.lstm.fused is kept unless a rival times this much faster. Why: timed alone on a shared 2-vCPU Zen 3, kiln's
# four LSTM loops came within noise of each other at two threads (the process's CPU time, which a busy machine has the
# tuner read: layer 2 of the zoo's forecaster 2.92-3.12 ms all four), so fresh builds took one or another from process
# to process, where interleaved rounds of one layer had the fused loop's row split 10-46% ahead of its block split and
# 14-26% of lanes (bench/results/lstm-zen3-2026-12-07.md, lstm-2t-2026-12-07.md). Within noise it is the form to
# keep: ahead per core on every CPU measured, and its row split has no barrier a step, so a thread the OS takes off
# its core costs it its lateness once a call rather than at every step. Not 1.1: by the wall clock on a quiet Zen 3
# one build in ~6 timed the fused loop 1.1-1.23x its closest rival on one layer (the median 1.01x; timing again in
# the same build did not remove it), and 3 of 10 fresh processes took a rival (bench/lstm_picks.py,
# lstm-2t-2026-12-07.md "the picks on merged main"). The block split's 11-18% alone on the Zen 4 EPYC with AVX-512
# falls within it now; a rival faster than this still wins.
FUSED_PREFERENCE = 1.25

register(Tactic(
    name="cpu.lstm.fused", op_type="LSTM", domain="", device="cpu", dtypes=(torch.float32,),
    supports=_supports_default_cell, configure=_configure, prepare=_preparer("LSTM", "fused"),
    available=recurrent.available, native=True, preference=FUSED_PREFERENCE,
    description="LSTM as kiln's C loop with a step's input projection, recurrent GEMM and cell in one register "
                "tile per block of hidden units (four gate vectors) and group of batch rows",
))


register(Tactic(
    name="cpu.lstm.fused_blocks", op_type="LSTM", domain="", device="cpu", dtypes=(torch.float32,),
    supports=_supports_default_cell, configure=_configure, prepare=_preparer("LSTM", "fused_blocks"),
    available=recurrent.available, native=True,
    description="cpu.lstm.fused with the threads splitting each step's blocks of hidden units (a barrier a step) "
                "rather than the batch's rows: the faster form on some CPUs (Zen 4), so the builder times both",
))
