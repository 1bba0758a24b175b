"""Ops outside ai.onnx and ai.onnx.ml: the ai.onnx.preview.training optimizers.

Momentum, Adagrad and Adam update several tensors in one node; the inputs are
(R learning rate, T step count, X..., G..., state...) with one group per tensor kind,
and the outputs the updated X... then the updated state groups.
"""

from __future__ import annotations

from kiln.ops._util import scalar
from kiln.ops.registry import register

TRAINING = "ai.onnx.preview.training"


def _groups(tensors: tuple, count: int) -> list[tuple]:
    """(X1, X2, G1, G2, H1, H2) -> [(X1, G1, H1), (X2, G2, H2)] for `count` groups."""
    n = len(tensors) // count
    return [tuple(tensors[g * n + i] for g in range(count)) for i in range(n)]


@register("Momentum", domain=TRAINING)
def momentum(ctx, R, T, *tensors, alpha, beta, mode, norm_coefficient):
    """V' = alpha·V + beta'·(G + λX); standard: X' = X - R·V'; nesterov: X' = X - R·(G + λX + alpha·V').

    beta' is 1 on the first step (T == 0), so V starts as the gradient itself.
    """
    rate, step = scalar(R), scalar(T)
    beta_adjusted = 1.0 if step == 0 else beta
    xs, vs = [], []
    for x, g, v in _groups(tensors, 3):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + beta_adjusted * g_reg
        if mode == "nesterov":
            x_new = x - rate * (g_reg + alpha * v_new)
        elif mode == "standard":
            x_new = x - rate * v_new
        else:
            raise ValueError(f"Momentum: mode must be 'standard' or 'nesterov', not {mode!r}")
        xs.append(x_new.to(x.dtype))
        vs.append(v_new.to(v.dtype))
    return (*xs, *vs)


@register("Adagrad", domain=TRAINING)
def adagrad(ctx, R, T, *tensors, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    """H' = H + (G + λX)²;  X' = X - R / (1 + T·decay) · (G + λX) / (√H' + ε)."""
    rate = scalar(R) / (1 + scalar(T) * decay_factor)
    xs, hs = [], []
    for x, g, h in _groups(tensors, 3):
        g_reg = norm_coefficient * x + g
        h_new = h + g_reg * g_reg
        xs.append((x - rate * g_reg / (h_new.sqrt() + epsilon)).to(x.dtype))
        hs.append(h_new.to(h.dtype))
    return (*xs, *hs)


@register("Adam", domain=TRAINING)
def adam(ctx, R, T, *tensors, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
         norm_coefficient_post=0.0):
    """V' = αV + (1-α)G̃;  H' = βH + (1-β)G̃²;  X' = (1-λ')(X - R̂·V' / (√H' + ε)), G̃ = G + λX.

    R̂ = R·√(1-β^T) / (1-α^T) corrects the start-up bias, from the first step (T > 0) on.
    """
    rate, step = scalar(R), scalar(T)
    if step > 0:
        rate = rate * (1 - beta**step) ** 0.5 / (1 - alpha**step)
    xs, vs, hs = [], [], []
    for x, g, v, h in _groups(tensors, 4):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + (1 - alpha) * g_reg
        h_new = beta * h + (1 - beta) * g_reg * g_reg
        x_new = x - rate * (v_new / (h_new.sqrt() + epsilon))
        xs.append(((1 - norm_coefficient_post) * x_new).to(x.dtype))
        vs.append(v_new.to(v.dtype))
        hs.append(h_new.to(h.dtype))
    return (*xs, *vs, *hs)
