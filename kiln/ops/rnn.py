"""Recurrent layers: RNN, GRU, LSTM, with ONNX's gate layouts and options.

One time loop per direction on torch ops. The input projection X·Wᵀ for all time steps is
one matmul before the loop; only the recurrent part runs per step.
Shapes (layout 0): X [S, B, I], W [D, G·H, I], R [D, G·H, H], B [D, 2·G·H],
Y [S, D, B, H], Y_h / Y_c [D, B, H]. layout 1 puts batch first: X [B, S, I], Y [B, S, D, H].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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


def _activations(names, alphas, betas, defaults: list[str], num_directions: int) -> list[Callable]:
    """The activation callables, len(defaults) per direction; alpha/beta consumed in order."""
    names = list(names or defaults * num_directions)
    if len(names) == len(defaults) and num_directions == 2:
        names = names * 2
    alphas, betas = list(alphas or []), list(betas or [])
    out = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise ValueError(f"unknown recurrent activation {name!r}")
        fn, alpha, beta = _ACTIVATIONS[key]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        out.append(lambda x, fn=fn, a=alpha, b=beta: fn(x, a, b))
    return out


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
            x = _reverse_sequences(X, lengths)
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
            y = _reverse_sequences(y, lengths)
        ys.append(y)
        for k in range(num_states):
            finals[k].append(states[k])
    Y = torch.stack(ys, dim=1)  # [S, D, B, H]
    finals_t = [torch.stack(f) for f in finals]  # [D, B, H]
    if layout:
        Y = Y.permute(2, 0, 1, 3)  # [B, S, D, H]
        finals_t = [f.transpose(0, 1) for f in finals_t]
    return (Y, *finals_t)


def _reverse_sequences(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Reverse x [S, B, ...] along time, each batch entry within its own length."""
    if lengths is None:
        return x.flip(0)
    seq_len = x.shape[0]
    t = torch.arange(seq_len, device=x.device).unsqueeze(1)  # [S, 1]
    index = torch.where(t < lengths, lengths - 1 - t, t)  # [S, B]
    index = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 0, index)


def _clip(x: torch.Tensor, clip: float | None) -> torch.Tensor:
    return x if clip is None else torch.clamp(x, -clip, clip)


@register("RNN")
def rnn(ctx, X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0):
    num_directions = W.shape[0]
    acts = _activations(activations, activation_alpha, activation_beta, ["Tanh"], num_directions)

    def cell(xw, states, r, rb, f, clip_, d):
        return [f[0](_clip(xw + states[0] @ r.T + rb, clip_))]

    return _run(ctx, cell, 1, X, W, R, B, sequence_lens, [initial_h], direction=direction,
                hidden_size=hidden_size, layout=layout, clip=clip, activations=acts, num_states=1)


@register("GRU")
def gru(ctx, X, W, R, B=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
        layout=0, linear_before_reset=0):
    num_directions = W.shape[0]
    acts = _activations(activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"],
                        num_directions)

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
    num_directions = W.shape[0]
    acts = _activations(activations, activation_alpha, activation_beta,
                        ["Sigmoid", "Tanh", "Tanh"], num_directions)

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
