"""kiln::Attention with key lengths on cuDNN's fused attention in its padding mode.

    cuda.attention.cudnn_padded   nvidia-cudnn-frontend's torch.ops.cudnn.sdpa_fwd(seq_len_q, seq_len_kv)
                                  + kiln's Triton kernel for the batches without a positive length

A padding-free engine's plain program hands its attentions the mask's key lengths (kiln::KeyLengths): batch b
attends to its first n_b keys, or, where n_b = -1, to the keys its mask keeps. cuDNN's padding mode takes the
first kind as it is (each batch's keys bounded by seq_len_kv, no mask tensor read), the fused attention torch eager
reaches only by dropping an all-ones mask; a mask with holes or left padding it cannot express. So the tactic runs
cuDNN on every batch (a batch of length -1 or 0 over all its keys: a finite, unused result) and then kiln's Triton
kernel over the batches of length -1 (their mask) and 0 (zeros), each program of a positive length storing nothing.

torch SDPA's own cuDNN backend (`cuda.attention.cudnn`) has no lengths: it reads the mask as a bias. Prepared
lazily: the frontend and Triton are imported when the tactic is prepared, not here.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kiln.kernels.cuda.cudnn_graph import import_cudnn
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.attention import attention_views, supports_layout
from kiln.tactics.cuda.library import triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic, tensor_input

_REST_TILE = (64, 64, 4, 3)  # the Triton kernel's tile (block_m, block_n, warps, stages) for the rows cuDNN leaves


def _padded_sdpa_available() -> bool:
    """The frontend imports and has its torch op (nvidia-cudnn-frontend >= 1.32: cudnn.sdpa_torch)."""
    cudnn = import_cudnn()
    if cudnn is None or not triton_available():
        return False
    try:
        cudnn.sdpa_torch  # noqa: B018  importing it registers torch.ops.cudnn.sdpa_fwd
    except (AttributeError, ImportError, OSError, RuntimeError):  # an older frontend, or its op's own imports
        return False
    return True


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    lengths = tensor_input(inputs, 4)
    if lengths is None:
        return "no key lengths (kiln::KeyLengths): cuDNN's padding mode bounds each batch's keys by them"
    found = supports_layout(step, inputs, *_REST_TILE[:2], _REST_TILE[3])  # the Triton kernel's part
    if found is not True:
        return found
    meta = [torch.empty(x.shape, device="meta", dtype=x.dtype) if x.shape is not None else None for x in inputs[:3]]
    q, k, v = attention_views(*(meta + [None] * (3 - len(meta))), step.attributes)
    d, dv = q.shape[3], v.shape[3]
    if d != dv or d % 8 or d > 128:
        return f"head dims {d}/{dv}: cuDNN's fused attention wants equal dims, a multiple of 8, at most 128"
    if k.shape[0] != q.shape[0]:
        return f"k/v batch {k.shape[0]} broadcast over q's {q.shape[0]}: the frontend's op takes equal batches"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = importlib.import_module("kiln.kernels.cuda.triton.attention")
    block_m, block_n, warps, stages = _REST_TILE
    rest = kernels.AttentionConfig(block_m, block_n, num_warps=warps, num_stages=stages)
    import_cudnn().sdpa_torch  # noqa: B018  registers torch.ops.cudnn.sdpa_fwd

    def launch(ctx, q, k=None, v=None, mask=None, key_lengths=None, **attributes):
        q4, k4, v4 = attention_views(q, k, v, attributes)  # [B, H, S, D] views of the inputs' memory
        batch, _, s_len, _ = q4.shape
        keys = torch.where(key_lengths > 0, key_lengths, k4.shape[2]).view(batch, 1, 1, 1)  # int32 [B, 1, 1, 1]
        queries = torch.full((batch, 1, 1, 1), s_len, dtype=torch.int32, device=q4.device)  # every query computed
        out, _ = torch.ops.cudnn.sdpa_fwd(q4, k4, v4, float(attributes.get("scale", 1.0)), seq_len_q=queries,
                                          seq_len_kv=keys, return_lse=False)  # [B, H, S, Dv], laid out as q is
        nan_to_zero = bool(attributes.get("nan_to_zero"))
        kernels.flash_attention(q4, k4, v4, mask, key_lengths, scale=attributes.get("scale", 1.0),
                                nan_to_zero=nan_to_zero, out=out, config=rest, only_rows_without_length=True)
        if nan_to_zero:  # the op's torch.nan_to_num over cuDNN's rows as well
            out = torch.nan_to_num(out, nan=0.0)
        perm = attributes.get("out_perm")
        result = (out.permute(list(perm)) if perm else out).contiguous()  # a view where cuDNN laid it out so
        return result.flatten(-2) if attributes.get("out_merge_heads") else result

    return launch


register(Tactic(
    name="cuda.attention.cudnn_padded", op_type="Attention", domain="kiln", device="cuda",
    dtypes=(torch.float16, torch.bfloat16), supports=_supports, prepare=_prepare, available=_padded_sdpa_available,
    description="cuDNN fused attention in its padding mode on the key lengths (no mask read), kiln's Triton kernel "
                "for the batches without a prefix mask",
))
