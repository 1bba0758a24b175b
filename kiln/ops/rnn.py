"""Recurrent layers: RNN, GRU, LSTM, with ONNX's gate layouts and options.

Two paths. Where one of torch's whole-sequence kernels computes exactly ONNX's equations, the
layer is one call of it (kiln/ops/recurrent_fused.py: oneDNN's LSTM on the CPU, cuDNN on CUDA):
every direction, initial_h/initial_c, layout 1, sequence_lens, outputs Y, Y_h, Y_c. The rest runs
step by step here, because torch's kernels cannot express it exactly:

- activations other than the defaults (LSTM Sigmoid/Tanh/Tanh, GRU Sigmoid/Tanh, RNN Tanh; the RNN
  may also be Relu), or any activation_alpha / activation_beta: torch's kernels hard-wire their
  nonlinearities, and an RNN's two directions share one;
- clip: torch's kernels never clamp the gate pre-activations;
- LSTM input_forget=1 (f = 1 − i): torch's LSTM computes f from its own weights;
- LSTM peepholes P with a nonzero entry: torch's LSTM has no peephole terms (an all-zero P adds
  nothing and runs fused);
- GRU linear_before_reset=0, ONNX's default: h̃ = tanh(X·W_hᵀ + (r ⊙ H)·R_hᵀ + b) multiplies the
  reset gate into H before the recurrent matmul; torch's GRU (and cuDNN's) multiply it into the
  matmul's result, n = tanh(X·W_nᵀ + b_in + r ⊙ (H·R_nᵀ + b_hn)), which is linear_before_reset=1;
- an empty X (no time step or no batch entry): nothing for a kernel to run.

The step path: one time loop per direction on torch ops; the input projection X·Wᵀ for all time
steps is one matmul before the loop, only the recurrent part runs per step.
Shapes (layout 0): X [S, B, I], W [D, G·H, I], R [D, G·H, H], B [D, 2·G·H],
Y [S, D, B, H], Y_h / Y_c [D, B, H]. layout 1 puts batch first: X [B, S, I], Y [B, S, D, H].
sequence_lens: Y is zero past each sequence's length; a sequence of length 0 has Y_h = Y_c = 0
(onnxruntime's answer; the spec does not say).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.ops import recurrent_fused
from kiln.ops.recurrent_fused import reverse_within_lengths
from kiln.ops.registry import register

# name -> (function(x, alpha, beta), default alpha, default beta); alpha/beta None: unused.
_ACTIVATIONS: dict[str, tuple[Callable, float | None, float | None]] = {
    "relu": (lambda x, a, b: torch.relu(x), None, None),
    "tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: torch.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: torch.where(x >= 0, x, a * (torch.exp(x) - 1)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + torch.abs(x)), None, None),
    "softplus": (lambda x, a, b: torch.nn.functional.softplus(x), None, None),
}


def activation_names(activations, defaults: list[str], num_directions: int) -> list[str]:
    """Lower-cased, one list for all directions (a single direction's list serves both)."""
    names = [a.lower() for a in (activations or defaults * num_directions)]
    return names * 2 if num_directions == 2 and len(names) == len(defaults) else names


def activation_parameters(names: list[str], alphas, betas) -> list[tuple[str, float | None, float | None]]:
    """(name, alpha, beta) of each of `activation_names`' list: activation_alpha / activation_beta are
    consumed in order by the activations that take them, the others get the activation's default; None:
    the activation takes no such parameter. Also kiln's C loop's reading (kiln/tactics/cpu/recurrent.py)."""
    alphas, betas = list(alphas or []), list(betas or [])
    out = []
    for name in names:
        if name not in _ACTIVATIONS:
            raise ValueError(f"unknown recurrent activation {name!r}")
        _, alpha, beta = _ACTIVATIONS[name]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        out.append((name, alpha, beta))
    return out


def _activations(names: list[str], alphas, betas) -> list[Callable]:
    """The activation callables of `activation_names`' list."""
    return [lambda x, fn=_ACTIVATIONS[name][0], a=alpha, b=beta: fn(x, a, b)
            for name, alpha, beta in activation_parameters(names, alphas, betas)]


def _run(ctx, cell, num_gates, X, W, R, B, sequence_lens, initial_states, *, direction, hidden_size,
         layout, clip, activations, num_states):
    """Shared driver: per direction, loop over time; returns (Y, final states...)."""
    if layout:
        X = X.transpose(0, 1)  # -> [S, B, I]
    seq_len, batch = X.shape[0], X.shape[1]
    num_directions = W.shape[0]
    hidden = hidden_size or R.shape[-1]
    if B is None:
        B = torch.zeros((num_directions, 2 * num_gates * hidden), dtype=X.dtype, device=X.device)
    lengths = None
    if sequence_lens is not None:
        lengths = sequence_lens.to(device=X.device, dtype=torch.int64).reshape(-1)
        if lengths.numel() != batch or int(lengths.min()) < 0 or int(lengths.max()) > seq_len:
            raise ValueError(f"{ctx.op_type} node {ctx.name!r}: sequence_lens must hold {batch} lengths in "
                             f"[0, {seq_len}], given {lengths.tolist()}")
    states0 = []
    for s in initial_states:
        if s is not None and layout:
            s = s.transpose(0, 1)  # [B, D, H] -> [D, B, H]
        states0.append(s)
    ys, finals = [], [[] for _ in range(num_states)]
    per_direction = len(activations) // num_directions
    for d in range(num_directions):
        reverse = direction == "reverse" or d == 1
        x = X
        if reverse:
            x = reverse_within_lengths(X, lengths)
        xw = x @ W[d].T + B[d, : num_gates * hidden]  # [S, B, G·H]
        rb = B[d, num_gates * hidden :]
        states = [
            s[d] if s is not None else torch.zeros((batch, hidden), dtype=X.dtype, device=X.device)
            for s in states0
        ]
        acts = activations[d * per_direction : (d + 1) * per_direction]
        outputs = []
        for t in range(seq_len):
            new_states = cell(xw[t], states, R[d], rb, acts, clip, d)
            if lengths is not None:  # finished sequences keep their state and emit zeros
                alive = (t < lengths).unsqueeze(1)
                new_states = [torch.where(alive, n, s) for n, s in zip(new_states, states)]
                outputs.append(torch.where(alive, new_states[0], torch.zeros_like(new_states[0])))
            else:
                outputs.append(new_states[0])
            states = new_states
        y = torch.stack(outputs) if outputs else X.new_zeros((0, batch, hidden))  # [S, B, H]
        if reverse:
            y = reverse_within_lengths(y, lengths)
        ys.append(y)
        for k in range(num_states):
            final = states[k]
            if lengths is not None:  # a sequence of length 0 ends in zeros (onnxruntime's answer)
                final = torch.where((lengths > 0).unsqueeze(1), final, torch.zeros_like(final))
            finals[k].append(final)
    Y = torch.stack(ys, dim=1)  # [S, D, B, H]
    finals_t = [torch.stack(f) for f in finals]  # [D, B, H]
    if layout:
        Y = Y.permute(2, 0, 1, 3)  # [B, S, D, H]
        finals_t = [f.transpose(0, 1) for f in finals_t]
    return (Y, *finals_t)


def _clip(x: torch.Tensor, clip: float | None) -> torch.Tensor:
    return x if clip is None else torch.clamp(x, -clip, clip)


def _num_directions(ctx, W: torch.Tensor, direction: str) -> int:
    expected = 2 if direction == "bidirectional" else 1
    if W.dim() != 3 or W.shape[0] != expected:
        raise ValueError(f"{ctx.op_type} node {ctx.name!r}: direction={direction!r} takes W of shape "
                         f"[{expected}, G·H, I], given {list(W.shape)}")
    return expected


def _fused_refusal(X: torch.Tensor, names: list[str], fused_names: list[str], activation_alpha,
                   activation_beta, clip) -> str | None:
    """None when torch's kernel may run this layer, else why it runs step by step (module docstring)."""
    if activation_alpha or activation_beta:
        return "activation_alpha/activation_beta given"
    if names != fused_names * (len(names) // len(fused_names)):
        return f"activations {names}"
    if clip is not None:
        return f"clip={clip}"
    if X.numel() == 0:
        return "empty X"
    return None


def _all_zero(P: torch.Tensor) -> bool:
    """Whether the peepholes add nothing; read once per P tensor (a weight: once per engine)."""
    return recurrent_fused.once_per_tensors("zero", (P,), lambda: not bool(P.any()))


def _fused(ctx, mode: str, X, W, R, B, sequence_lens, initial_h, initial_c, *, direction: str, layout: int):
    """The layer as one torch kernel call; sequence_lens read on the host (packing needs them there)."""
    seq_len, batch = (X.shape[1], X.shape[0]) if layout else (X.shape[0], X.shape[1])
    lengths = None
    if sequence_lens is not None:
        lengths = sequence_lens.reshape(-1).to(device="cpu", dtype=torch.int64)
        if lengths.numel() != batch or int(lengths.min()) < 0 or int(lengths.max()) > seq_len:
            raise ValueError(f"{ctx.op_type} node {ctx.name!r}: sequence_lens must hold {batch} lengths in "
                             f"[0, {seq_len}], given {lengths.tolist()}")
        if int(lengths.min()) == seq_len:
            lengths = None  # every sequence full: the plain kernel
    return recurrent_fused.run_fused(mode, X, W, R, B, lengths, initial_h, initial_c,
                                     reverse=direction == "reverse", layout=layout)


@register("RNN")
def rnn(ctx, X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0):
    num_directions = _num_directions(ctx, W, direction)
    names = activation_names(activations, ["Tanh"], num_directions)
    if _fused_refusal(X, names, names[:1], activation_alpha, activation_beta, clip) is None and \
            names[0] in ("tanh", "relu"):
        return _fused(ctx, f"RNN_{names[0].upper()}", X, W, R, B, sequence_lens, initial_h, None,
                      direction=direction, layout=layout)
    acts = _activations(names, activation_alpha, activation_beta)

    def cell(xw, states, r, rb, f, clip_, d):
        return [f[0](_clip(xw + states[0] @ r.T + rb, clip_))]

    return _run(ctx, cell, 1, X, W, R, B, sequence_lens, [initial_h], direction=direction,
                hidden_size=hidden_size, layout=layout, clip=clip, activations=acts, num_states=1)


@register("GRU")
def gru(ctx, X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, linear_before_reset=0):
    num_directions = _num_directions(ctx, W, direction)
    names = activation_names(activations, ["Sigmoid", "Tanh"], num_directions)
    if linear_before_reset and _fused_refusal(X, names, ["sigmoid", "tanh"], activation_alpha, activation_beta,
                                              clip) is None:
        return _fused(ctx, "GRU", X, W, R, B, sequence_lens, initial_h, None, direction=direction, layout=layout)
    acts = _activations(names, activation_alpha, activation_beta)

    def cell(xw, states, r, rb, f, clip_, d):
        h = states[0]
        xz, xr, xh = xw.chunk(3, dim=-1)
        rz, rr, rh = r.chunk(3, dim=0)
        bz, br, bh = rb.chunk(3)
        z = f[0](_clip(xz + h @ rz.T + bz, clip_))
        reset = f[0](_clip(xr + h @ rr.T + br, clip_))
        if linear_before_reset:
            candidate = f[1](_clip(xh + reset * (h @ rh.T + bh), clip_))
        else:
            candidate = f[1](_clip(xh + (reset * h) @ rh.T + bh, clip_))
        return [(1 - z) * candidate + z * h]

    return _run(ctx, cell, 3, X, W, R, B, sequence_lens, [initial_h], direction=direction,
                hidden_size=hidden_size, layout=layout, clip=clip, activations=acts, num_states=1)


@register("LSTM")
def lstm(ctx, X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, *,
         activation_alpha=None, activation_beta=None, activations=None, clip=None,
         direction="forward", hidden_size=None, input_forget=0, layout=0):
    num_directions = _num_directions(ctx, W, direction)
    names = activation_names(activations, ["Sigmoid", "Tanh", "Tanh"], num_directions)
    if not input_forget and (P is None or _all_zero(P)) and \
            _fused_refusal(X, names, ["sigmoid", "tanh", "tanh"], activation_alpha, activation_beta, clip) is None:
        return _fused(ctx, "LSTM", X, W, R, B, sequence_lens, initial_h, initial_c, direction=direction,
                      layout=layout)
    acts = _activations(names, activation_alpha, activation_beta)

    def cell(xw, states, r, rb, f, clip_, d):
        h, c = states
        gates = xw + h @ r.T + rb  # [B, 4·H], order i, o, f, c
        gi, go, gf, gc = gates.chunk(4, dim=-1)
        if P is not None:
            pi, po, pf = P[d].chunk(3)
            gi, gf = gi + pi * c, gf + pf * c
        i = f[0](_clip(gi, clip_))
        forget = 1 - i if input_forget else f[0](_clip(gf, clip_))
        c_new = forget * c + i * f[1](_clip(gc, clip_))
        if P is not None:
            go = go + po * c_new
        o = f[0](_clip(go, clip_))
        return [o * f[2](c_new), c_new]

    return _run(ctx, cell, 4, X, W, R, B, sequence_lens, [initial_h, initial_c],
                direction=direction, hidden_size=hidden_size, layout=layout, clip=clip,
                activations=acts, num_states=2)
