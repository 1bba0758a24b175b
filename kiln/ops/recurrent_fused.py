"""ONNX RNN, GRU and LSTM as one call of torch's whole-sequence kernels.

torch's `_VF.lstm` / `gru` / `rnn_tanh` / `rnn_relu` run a whole layer in C++: oneDNN's RNN
primitive for the LSTM on the CPU, cuDNN on CUDA tensors, torch's native loop otherwise. They
compute exactly ONNX's equations for the cells kiln/ops/rnn.py routes here (which ones, and why
the others stay step by step, is said there); what differs is only where things sit:

    gate order     ONNX LSTM i o f c -> torch i f g o;  ONNX GRU z r h -> torch r z n
    weights        ONNX W [D, G·H, I], R [D, G·H, H], B [D, 2·G·H] (Wb then Rb)
                   torch per direction: w_ih [G·H, I], w_hh [G·H, H], b_ih [G·H], b_hh [G·H]
    reverse        torch has no reverse-only layer: the sequence is reversed (each one within
                   its own length), run forward, and its outputs reversed back
    sequence_lens  a packed sequence (torch stops each sequence at its own length, both
                   directions); every sequence full: the plain (oneDNN / cuDNN) kernel

The re-laid-out weights are made once per set of weight tensors and kept while those tensors
live (an engine's weights live as long as the engine), so a run pays for them only on its first call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.backends.cudnn.rnn as cudnn_rnn
from torch import _VF
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

# ONNX gate blocks in torch's order: torch block k is ONNX block GATE_ORDER[mode][k]
GATE_ORDER: dict[str, list[int]] = {
    "LSTM": [0, 2, 3, 1],  # ONNX i o f c -> torch i f g(=c) o
    "GRU": [1, 0, 2],  # ONNX z r h -> torch r z n(=h)
    "RNN_TANH": [0],
    "RNN_RELU": [0],
}
_KERNELS = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}


@dataclass
class _Prepared:
    sources: tuple[weakref.ref, ...]  # the entry is valid while these are the very tensors it was made from
    value: Any


_PREPARED: dict[tuple, _Prepared] = {}


def once_per_tensors(tag: str, sources: tuple[torch.Tensor, ...], make: Callable[[], Any]) -> Any:
    """`make()`, computed once for this set of tensors and kept while they all live.

    Keyed by the tensors' identities; an entry goes when any of them is freed. kiln never writes an
    engine's weights in place, so identity is enough for them: the first run of an engine makes the
    entry, every later run reuses it. A weight computed by the graph is a new tensor every run and is
    made again every run, as it must be.
    """
    key = (tag, *(id(t) for t in sources))
    hit = _PREPARED.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit.sources, sources)):
        return hit.value
    value = make()
    _PREPARED[key] = _Prepared(tuple(weakref.ref(t) for t in sources), value)
    for t in sources:
        weakref.finalize(t, _PREPARED.pop, key, None)
    return value


def torch_weights(mode: str, W: torch.Tensor, R: torch.Tensor, B: torch.Tensor | None) -> list[torch.Tensor]:
    """torch's flat weight list for ONNX's W, R, B, made once per set of weight tensors."""
    sources = (W, R) if B is None else (W, R, B)
    return once_per_tensors(mode, sources, lambda: _relayout(mode, W, R, B))


def _relayout(mode: str, W: torch.Tensor, R: torch.Tensor, B: torch.Tensor | None) -> list[torch.Tensor]:
    order = GATE_ORDER[mode]
    gates = len(order)
    directions, gate_rows, input_size = W.shape  # W: [D, G·H, I]
    hidden = gate_rows // gates
    flat = []
    for d in range(directions):
        flat.append(W[d].reshape(gates, hidden, input_size)[order].reshape(gate_rows, input_size))  # w_ih
        flat.append(R[d].reshape(gates, hidden, hidden)[order].reshape(gate_rows, hidden))  # w_hh
        if B is not None:
            bias = B[d].reshape(2, gates, hidden)[:, order].reshape(2, gate_rows)  # [Wb; Rb]
            flat += [bias[0].contiguous(), bias[1].contiguous()]  # b_ih, b_hh
    if W.is_cuda and torch.backends.cudnn.is_acceptable(W) and torch._use_cudnn_rnn_flatten_weight():
        # cuDNN reads one contiguous buffer; without it every call copies the weights into one.
        # The call copies the tensors of `flat` into that buffer and makes them views of it.
        with torch.cuda.device_of(W):
            torch._cudnn_rnn_flatten_weight(flat, 4 if B is not None else 2, input_size,
                                            cudnn_rnn.get_cudnn_mode(mode), hidden, 0, 1, False,
                                            directions == 2)
    return flat


def run_fused(mode: str, X: torch.Tensor, W: torch.Tensor, R: torch.Tensor, B: torch.Tensor | None,
              lengths: torch.Tensor | None, initial_h: torch.Tensor | None, initial_c: torch.Tensor | None,
              *, reverse: bool, layout: int) -> tuple[torch.Tensor, ...]:
    """One ONNX recurrent layer: (Y, Y_h) or, for the LSTM, (Y, Y_h, Y_c).

    `lengths`: sequence_lens as int64 on the CPU, already checked to lie in [0, S], or None when
    every sequence is full. A sequence of length 0 gives zeros in Y, Y_h and Y_c (onnxruntime's
    answer; the spec does not say).
    X: layout 0 [S, N, I], layout 1 [N, S, I]; initial states: layout 0 [D, N, H], layout 1 [N, D, H].
    """
    directions, hidden = W.shape[0], R.shape[-1]
    time_axis = 1 if layout else 0
    batch = X.shape[1 - time_axis]
    weights = torch_weights(mode, W, R, B)
    given = (initial_h, initial_c) if mode == "LSTM" else (initial_h,)
    hx = [X.new_zeros((directions, batch, hidden)) if s is None else (s.transpose(0, 1) if layout else s).contiguous()
          for s in given]  # [D, N, H] each
    kernel, bidirectional = _KERNELS[mode], directions == 2
    if lengths is None:
        x = X.flip(time_axis) if reverse else X
        out = kernel(x, tuple(hx) if mode == "LSTM" else hx[0], weights, B is not None, 1, 0.0, False,
                     bidirectional, bool(layout))
        y = out[0].flip(time_axis) if reverse else out[0]  # layout 0: [S, N, D·H], layout 1: [N, S, D·H]
        finals = list(out[1:])  # [D, N, H] each
        y = y.unflatten(2, (directions, hidden))
        y = y if layout else y.permute(0, 2, 1, 3)  # -> [N, S, D, H] | [S, D, N, H]
    else:
        y, finals = _run_packed(kernel, mode, X.transpose(0, 1) if layout else X, weights, B is not None,
                                lengths, hx, reverse=reverse, bidirectional=bidirectional)
        y = y.unflatten(2, (directions, hidden))  # [S, N, D, H]
        y = y.permute(1, 0, 2, 3) if layout else y.permute(0, 2, 1, 3)
    if layout:
        finals = [f.transpose(0, 1) for f in finals]  # [N, D, H]
    return (y, *finals)


def _run_packed(kernel, mode: str, x: torch.Tensor, weights: list[torch.Tensor], has_biases: bool,
                lengths: torch.Tensor, hx: list[torch.Tensor], *, reverse: bool,
                bidirectional: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x: [S, N, I] time-major -> (y [S, N, D·H] zero past each length, final states [D, N, H])."""
    seq_len = x.shape[0]
    if reverse:
        x = reverse_within_lengths(x, lengths.to(x.device))
    # torch cannot pack an empty sequence: run length-0 entries one step and zero them after
    packed = pack_padded_sequence(x, lengths.clamp(min=1), enforce_sorted=False)
    hx = [s.index_select(1, packed.sorted_indices) for s in hx]
    out = kernel(packed.data, packed.batch_sizes, tuple(hx) if mode == "LSTM" else hx[0], weights, has_biases,
                 1, 0.0, False, bidirectional)
    y, _ = pad_packed_sequence(PackedSequence(out[0], packed.batch_sizes, packed.sorted_indices,
                                              packed.unsorted_indices), total_length=seq_len)  # [S, N, D·H]
    finals = [f.index_select(1, packed.unsorted_indices) for f in out[1:]]
    if reverse:
        y = reverse_within_lengths(y, lengths.to(y.device))
    empty = lengths == 0
    if bool(empty.any()):
        keep = (~empty).to(y.device).unsqueeze(1)  # [N, 1]
        y = torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))
        finals = [torch.where(keep, f, torch.zeros((), dtype=f.dtype, device=f.device)) for f in finals]
    return y, finals


def reverse_within_lengths(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Reverse x [S, N, ...] along time, each batch entry within its own length (the rest in place)."""
    if lengths is None:
        return x.flip(0)
    seq_len = x.shape[0]
    t = torch.arange(seq_len, device=x.device).unsqueeze(1)  # [S, 1]
    index = torch.where(t < lengths, lengths - 1 - t, t)  # [S, N]
    index = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 0, index)
