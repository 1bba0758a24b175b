"""CPU recurrent-layer tactic on kiln's own C loop (kiln/kernels/cpu/lstm.c).

    cpu.lstm.native   ONNX LSTM, every direction and layout, initial_h / initial_c, outputs Y, Y_h, Y_c:
                      per direction, W and R packed once at load, a call is the input projection of every
                      step as one GEMM and then one loop over time in C (recurrent GEMM + cell per block
                      of hidden units, one barrier a step)

What it leaves to the op's own implementation (kiln/ops/rnn.py, torch's kernels or the step loop): the
activations other than the defaults and their alpha/beta, clip, input_forget, peepholes, and
sequence_lens (an input the layer is given at run time: a call that gets one runs the op's own path).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import lstm
from kiln.ops.registry import lookup
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic, tensor_input
from kiln.tactics.tactic import attribute as _attr

_DEFAULT_ACTIVATIONS = ["sigmoid", "tanh", "tanh"]


def _directions(step: StepSpec) -> int:
    return 2 if _attr(step, "direction", "forward") == "bidirectional" else 1


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not lstm.available():
        return f"kiln's LSTM is not built: {lstm.reason()}"
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
    if w.shape[0] != directions or r.shape[0] != directions or w.shape[1] != 4 * hidden or r.shape[1] != 4 * hidden:
        return f"W {list(w.shape)} / R {list(r.shape)} are not [{directions}, 4·H, ·] for H = {hidden}"
    if w.shape[2] != x.shape[2]:
        return f"X's input size {x.shape[2]} is not W's {w.shape[2]}"
    if b is not None and (not b.constant or list(b.shape) != [directions, 8 * hidden] or b.dtype != torch.float32):
        return f"B is not a constant float32 [{directions}, 8·H]"
    if tensor_input(inputs, 4) is not None:
        return "sequence_lens is given (the op's own path stops each sequence at its length)"
    if tensor_input(inputs, 7) is not None:
        return "peepholes P are given"
    names = [a.lower() for a in _attr(step, "activations", []) or []]
    if names and names != _DEFAULT_ACTIVATIONS * (len(names) // 3):
        return f"activations {names} (only Sigmoid, Tanh, Tanh)"
    if _attr(step, "activation_alpha", None) or _attr(step, "activation_beta", None):
        return "activation_alpha / activation_beta given"
    if _attr(step, "clip", None) is not None:
        return "clip"
    if int(_attr(step, "input_forget", 0)):
        return "input_forget=1"
    if int(_attr(step, "hidden_size", hidden)) != hidden:
        return f"hidden_size {_attr(step, 'hidden_size', None)} is not R's {hidden}"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    W, R = constants[1], constants[2]
    B = constants[3] if len(constants) > 3 else None
    directions = _directions(step)
    layers = [lstm.LSTMDirection(W[d], R[d], None if B is None else B[d]) for d in range(directions)]
    hidden = layers[0].hidden
    reverse_only = _attr(step, "direction", "forward") == "reverse"
    batch_major = bool(int(_attr(step, "layout", 0)))
    op = lookup("LSTM", "").fn

    def launch(ctx, X, W_=None, R_=None, B_=None, sequence_lens=None, initial_h=None, initial_c=None, P=None,
               **attributes):
        batch = X.shape[0] if batch_major else X.shape[1] if X.dim() == 3 else -1
        state_size = (batch, directions, hidden) if batch_major else (directions, batch, hidden)
        if sequence_lens is not None or X.dtype != torch.float32 or X.dim() != 3 or X.shape[2] != layers[0].inputs \
                or any(s is not None and tuple(s.shape) != state_size for s in (initial_h, initial_c)):
            # what this loop does not run, and every malformed input: the op's own path (and its errors)
            return op(ctx, X, W_, R_, B_, sequence_lens, initial_h, initial_c, P, **attributes)
        X = X.contiguous()  # [S, N, I] (layout 1: [N, S, I])
        steps = X.shape[1] if batch_major else X.shape[0]
        if batch_major:
            Y = X.new_empty((batch, steps, directions, hidden))  # [N, S, D, H]
            Y_h, Y_c = X.new_empty((batch, directions, hidden)), X.new_empty((batch, directions, hidden))  # [N, D, H]
        else:
            Y = X.new_empty((steps, directions, batch, hidden))  # [S, D, N, H]
            Y_h, Y_c = X.new_empty((directions, batch, hidden)), X.new_empty((directions, batch, hidden))  # [D, N, H]
        states = [None if s is None else s.to(torch.float32).contiguous() for s in (initial_h, initial_c)]
        for d, layer in enumerate(layers):
            def state(s):  # direction d's [N, H] (a strided view in layout 1)
                return None if s is None else (s[:, d] if batch_major else s[d])
            y = Y[:, :, d] if batch_major else Y[:, d]
            layer.run(X, y, state(states[0]), state(states[1]), state(Y_h), state(Y_c),
                      reverse=reverse_only or d == 1, batch_major=batch_major)
        return Y, Y_h, Y_c

    return launch


register(Tactic(
    name="cpu.lstm.native", op_type="LSTM", domain="", device="cpu", dtypes=(torch.float32,),
    supports=_supports, prepare=_prepare, available=lstm.available,
    description="LSTM as kiln's C loop: input projection as one GEMM, recurrent GEMM + cell per unit block and step",
))
