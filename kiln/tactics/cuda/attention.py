"""kiln::Attention on CUDA through kiln's Triton flash-attention kernel, one tactic per tile config.

    cuda.attention.triton.<BMxBN>.w<warps>s<stages>       kiln/kernels/cuda/triton/attention.py
    cuda.attention.triton_fp8.<BMxBN>.w<warps>s<stages>   the same kernel with E4M3 products (Float8Scales)
    cuda.attention.triton_fp8qk.<BMxBN>.w<warps>s<stages> q·kᵀ in E4M3, p·v in fp16 (Float8Scales.pv False)
    cuda.attention.quantized.<BMxBN>.w<warps>s<stages>    an explicitly quantized attention (int8 or E4M3 Q/DQ
                                                          absorbed: q/k/v_quant, ...), exactly as the op rounds
                                                          (kiln/kernels/cuda/triton/quantized_attention.py)

The kernel reads q, k and v through their strides and writes the output in its final layout, so
the layouts the optimizer absorbs into the op (qkv_split of one QKV GEMM output, [B, S, H·D]
inputs with q/k/v_perm, out_perm + out_merge_heads) cost no copies, unlike SDPA, which needs a
contiguous last axis and returns [B, H, S, D]. GQA is head-index arithmetic (no repeat_interleave).

The FP8 tactics run an FP8 engine's attention (`fp8_scale`, set by kiln's FP8 calibration, kiln/quant/attention.py)
with q, k and v put on the E4M3 grid at that scale as they are loaded, the probabilities at 1/448, the output
fp16; the qk form rounds q and k alone and keeps p·v in fp16. A precision the op allows but does not compute, so
each is judged (`fp8_checker`) against the op on the E4M3-rounded inputs, within the probabilities' rounding bound,
and timed against the exact tactics (both forms from opt_level 3 only: see the registration below).

Configs are separate tactics: the autotuner times them on the real shape and keeps the fastest
(the three default ones at opt_level 2, the rest from 3), like the Triton GEMM tiles in cuda.py.
Triton is imported when a tactic is prepared, not here (a CPU-only kiln imports every tactic module).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Launch, Tactic, tensor_input

_HALF = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 128  # kiln/kernels/cuda/triton/attention.py MAX_HEAD_DIM, without importing triton here
_GRID_AXIS_LIMIT = 65535
_SHARED_MEMORY_LIMIT = 232448  # bytes per block on sm_90 (H100/H200); a larger tile fails at launch
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
# The probabilities' E4M3 rounding, relative: half a spacing of 3 mantissa bits. Each p carries at most this
# error, so the output (a convex combination of v rows) is off by at most this share of max |v| from the op on
# the same rounded q, k and v (kiln/kernels/cuda/triton/attention.py; tests/kernels/test_attention_fp8.py)
_P_ROUNDING = 2.0 ** -4
_HALF_TOLERANCE = 2e-3  # the fp16 output's own rounding and fp32 arithmetic, of max |reference|


def shared_memory_bound(block_m: int, block_n: int, stages: int, head_dim: int, head_dim_v: int, itemsize: int,
                        mask_tile_itemsize: int = 0, mask_vector_itemsize: int = 0) -> int:
    """An upper bound of the kernel's shared memory in bytes, as Triton lays it out on sm_90: the q tile
    once; per pipeline stage a k and a v tile, and a [BM, BN] mask tile (per-query masks) or a key vector
    (padding masks, plus alignment). tests/kernels/compile_sm90.py holds it against the compiler's figure."""
    block_d, block_dv = (max(16, 1 << (d - 1).bit_length()) for d in (head_dim, head_dim_v))
    per_stage = block_n * (block_d + block_dv) * itemsize + block_m * block_n * mask_tile_itemsize
    vector = stages * block_n * mask_vector_itemsize + 1024 if mask_vector_itemsize else 0
    return stages * per_stage + vector + block_m * block_d * itemsize


def _attr(attributes: dict[str, Any], name: str, default: Any) -> Any:
    value = attributes.get(name, default)
    return default if value is None else value


def attention_views(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    attributes: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as [B, H, S, D] views, the layout handling of kiln/ops/fused.py `attention` (no copies).

    Works on real and on meta tensors (supports() resolves the layout at build time).
    """
    qkv_split = _attr(attributes, "qkv_split", None)
    if qkv_split:
        q, k, v = torch.split(q, list(qkv_split), dim=-1)  # [B, S, Wq], [B, S, Wk], [B, S, Wv]: column slices
    q_heads, kv_heads = int(_attr(attributes, "q_num_heads", 0)), int(_attr(attributes, "kv_num_heads", 0))
    q = q.unflatten(-1, (q_heads, -1)) if q_heads and q.dim() == 3 else q  # [B, S, H, D]
    k = k.unflatten(-1, (kv_heads, -1)) if kv_heads and k.dim() == 3 else k
    v = v.unflatten(-1, (kv_heads, -1)) if kv_heads and v.dim() == 3 else v
    q, k, v = (t.permute(list(p)) if (p := _attr(attributes, name, None)) else t
               for t, name in ((q, "q_perm"), (k, "k_perm"), (v, "v_perm")))
    return q, k, v  # q: [B, H, S, D], k: [B, Hkv, T, D], v: [B, Hkv, T, Dv]


def output_buffer(q: torch.Tensor, v: torch.Tensor, out_perm: list[int] | None,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the op's output before out_merge_heads, contiguous; the same memory as a [B, H, S, Dv] view), of q's dtype
    unless `dtype` says.

    The kernel writes the [B, H, S, Dv] view; with out_perm = [0, 2, 1, 3] the buffer is the
    [B, S, H, Dv] tensor the next GEMM reads, and merging the heads is a free flatten.
    """
    shape = (*q.shape[:3], v.shape[3])  # [B, H, S, Dv]
    dtype = dtype or q.dtype
    if not out_perm:
        buffer = torch.empty(shape, dtype=dtype, device=q.device)
        return buffer, buffer
    out_perm = list(out_perm)
    buffer = torch.empty([shape[p] for p in out_perm], dtype=dtype, device=q.device)
    inverse = sorted(range(4), key=out_perm.__getitem__)  # buffer.permute(inverse) is [B, H, S, Dv] again
    return buffer, buffer.permute(inverse)


def _extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return sum((n - 1) * abs(s) for n, s in zip(shape[2:], strides[2:]))


def _meta_views(inputs: list[InputMeta], attributes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """q, k, v as [B, H, S, D] meta tensors through the op's layout attributes, or why they are not."""
    n_qkv = 1 if _attr(attributes, "qkv_split", None) else 3
    if any(i >= len(inputs) or inputs[i].shape is None for i in range(n_qkv)):
        return "q, k or v is not a tensor"
    meta = [torch.empty(x.shape, device="meta", dtype=x.dtype) if x.shape is not None else None
            for x in inputs[:3]] + [None] * (3 - min(len(inputs), 3))
    try:
        q, k, v = attention_views(*meta, attributes)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        return f"q/k/v layout does not resolve: {e}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"q/k/v are not [B, H, S, D] after the layout (ranks {q.dim()}, {k.dim()}, {v.dim()})"
    return q, k, v


def _expanded_mask(mask: InputMeta, batch: int, heads: int, s_len: int, t_len: int) -> torch.Tensor | str:
    """The mask as the kernels read it, a meta tensor broadcast to [B, H, S, T] (its strides say which axes it
    repeats); a reason where its dtype or shape is not one they take."""
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"mask dtype {mask.dtype}: the kernel takes bool or an additive float mask"
    try:
        return torch.empty(mask.shape, device="meta", dtype=mask.dtype).expand(batch, heads, s_len, t_len)
    except RuntimeError:
        return f"mask {list(mask.shape)} does not broadcast to [B, H, S, T] = {[batch, heads, s_len, t_len]}"


def _supports_layout(step: StepSpec, inputs: list[InputMeta], block_m: int, block_n: int,
                     stages: int) -> bool | str:
    attributes = step.attributes
    if any(_attr(attributes, name, None) for name in ("q_quant", "k_quant", "v_quant", "score_quant", "prob_quant",
                                                      "out_quant")):
        return "a quantized attention (8-bit inputs or quantized scores): this kernel has no such form"
    views = _meta_views(inputs, attributes)
    if isinstance(views, str):
        return views
    q, k, v = views
    if q.dtype not in _HALF or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: the kernel takes one of float16, bfloat16"
    batch, heads, s_len, d = q.shape
    scale = attributes.get("scale", 1.0)
    if scale is not None and not scale > 0:
        return f"scale {scale}: the kernel takes the row maximum before scaling, so it must be positive"
    kv_batch, kv_heads, t_len, dv = v.shape
    if k.shape[:3] != v.shape[:3] or k.shape[3] != d:
        return f"k {list(k.shape)} and v {list(v.shape)} do not pair with q {list(q.shape)}"
    if kv_batch not in (1, batch) or kv_heads == 0 or heads % kv_heads:
        return f"k/v batch {kv_batch} and heads {kv_heads} do not map onto q's {batch} and {heads}"
    if kv_heads != heads and kv_heads != 1 and not _attr(attributes, "gqa", 0):
        return f"{heads} query heads over {kv_heads} key/value heads without gqa: the op refuses it too"
    if max(d, dv) > _MAX_HEAD_DIM:
        return f"head dims {d}/{dv}: the kernel holds at most {_MAX_HEAD_DIM} per row in registers"
    if min(s_len, t_len, d, dv) == 0:
        return "an empty sequence or head"
    if max(batch, heads) > _GRID_AXIS_LIMIT:
        return f"{batch} batches x {heads} heads: above the {_GRID_AXIS_LIMIT} CUDA grid limit per axis"
    if block_m > 64 and s_len <= 64:
        return f"{block_m}-row tiles for {s_len} queries: mostly padding"
    extents = [_extent(tuple(t.shape), t.stride()) for t in (q, k, v)]
    mask = tensor_input(inputs, 3)
    mask_tile = mask_vector = 0
    if mask is not None:
        expanded = _expanded_mask(mask, batch, heads, s_len, t_len)
        if isinstance(expanded, str):
            return expanded
        extents.append(_extent(tuple(expanded.shape), expanded.stride()))
        if expanded.stride(2) != 0 and s_len > 1:  # one mask value per (query, key): a tile per stage
            mask_tile = expanded.element_size()
        else:
            mask_vector = expanded.element_size()
    lengths = tensor_input(inputs, 4)
    if lengths is not None:
        if lengths.dtype != torch.int32 or tuple(lengths.shape) != (batch,):
            return f"key lengths {lengths.dtype}{list(lengths.shape)}: the kernel reads int32 [{batch}]"
        if _attr(attributes, "is_causal", 0):
            return "key lengths with is_causal: the op refuses it too"
    extents.append(s_len * heads * dv)  # the output buffer, at most this far inside one slab
    if max(extents) >= 2**31:
        return "one (batch, head) slab spans more than 2^31 elements: the kernel indexes it in 32 bits"
    shared = shared_memory_bound(block_m, block_n, stages, d, dv, q.element_size(), mask_tile, mask_vector)
    if shared > _SHARED_MEMORY_LIMIT:
        return f"~{shared} B of shared memory for these tiles at head dims {d}/{dv}: more than sm_90's " \
               f"{_SHARED_MEMORY_LIMIT}"
    return True


def on_e4m3_grid(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded onto the E4M3 grid at `scale` (saturating), in float32: what the FP8 kernel multiplies."""
    return (x.float() * (1.0 / scale)).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8).float() * scale


def fp8_checker(pv: bool) -> Callable[[Launch, Any, list[Any], dict[str, Any]], Callable[[Any], str | None]]:
    """How an FP8 attention is judged: against the op in float32 on the inputs the kernel multiplies (q and k, and
    v where p·v is E4M3 too (`pv`), rounded to E4M3 at fp8_scale), each output within the probabilities' rounding
    (E4M3's, or fp16's without pv) of Σ_j p_j·|v_j| (the op run once more on |v|) plus the fp16 output's own
    tolerance. A kernel that scales q·k or v wrong, or skips a key, is off by far more."""
    p_rounding = _P_ROUNDING if pv else 2.0 ** -10  # half an E4M3 spacing; fp16's half ulp (2^-11), twice

    def checker(reference: Launch, ctx, args: list[Any], attributes: dict[str, Any]) -> Callable[[Any], str | None]:
        scale = float(attributes["fp8_scale"])
        rounded = [a.float().clone() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        q, k, v = attention_views(*(rounded + [None] * 3)[:3], attributes)  # views: rounded in place
        for t in (q, k, v) if pv else (q, k):
            t.copy_(on_e4m3_grid(t, scale))
        magnitudes = [a.clone() if isinstance(a, torch.Tensor) and i < 3 else a for i, a in enumerate(rounded)]
        attention_views(*(magnitudes + [None] * 3)[:3], attributes)[2].abs_()  # |v|, in place through the view
        with torch.inference_mode():
            want = reference(ctx, *rounded, **attributes).float()
            bound = p_rounding * reference(ctx, *magnitudes, **attributes).float() \
                + _HALF_TOLERANCE * want.abs().max().item()

        def check(result: Any) -> str | None:
            if not isinstance(result, torch.Tensor) or result.shape != want.shape:
                return f"gave {getattr(result, 'shape', type(result).__name__)}, the op on E4M3 inputs " \
                       f"{list(want.shape)}"
            excess = ((result.float() - want).abs() - bound).max().item()
            return None if excess <= 0 else \
                f"{excess:.3g} beyond the FP8 bound (the op on E4M3 inputs, the probabilities' rounding)"

        return check

    return checker


def _triton_attention_tactic(block_m: int, block_n: int, num_warps: int, num_stages: int, level: int,
                             fp8: str = "") -> Tactic:
    """fp8: "" (fp16/bf16 products), "pv" (q·kᵀ and p·v in E4M3), "qk" (q·kᵀ in E4M3, p·v in fp16/bf16)."""
    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        if fp8 and not _attr(step.attributes, "fp8_scale", None):
            return "no fp8_scale: not an FP8 engine's attention (kiln's FP8 calibration gives one)"
        return _supports_layout(step, inputs, block_m, block_n, num_stages)

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        kernels = importlib.import_module("kiln.kernels.cuda.triton.attention")
        config = kernels.AttentionConfig(block_m, block_n, num_warps=num_warps, num_stages=num_stages)
        scale = float(step.attributes["fp8_scale"]) if fp8 else None
        scales = kernels.Float8Scales(scale, scale, scale, pv=fp8 == "pv") if fp8 else None

        def launch(ctx, q, k=None, v=None, mask=None, key_lengths=None, **attributes):
            q4, k4, v4 = attention_views(q, k, v, attributes)  # [B, H, S, D] views of the inputs' memory
            buffer, out = output_buffer(q4, v4, _attr(attributes, "out_perm", None))
            kernels.flash_attention(q4, k4, v4, mask, key_lengths, scale=attributes.get("scale", 1.0),
                                    is_causal=bool(_attr(attributes, "is_causal", 0)),
                                    nan_to_zero=bool(_attr(attributes, "nan_to_zero", 0)), out=out, config=config,
                                    fp8=scales)
            return buffer.flatten(-2) if _attr(attributes, "out_merge_heads", 0) else buffer

        return launch

    kind = {"": "triton", "pv": "triton_fp8", "qk": "triton_fp8qk"}[fp8]
    products = {"": "", "pv": " with E4M3 products at the step's fp8_scale",
                "qk": " with q·kᵀ in E4M3 at the step's fp8_scale"}[fp8]
    return Tactic(
        name=f"cuda.attention.{kind}.{block_m}x{block_n}.w{num_warps}s{num_stages}", op_type="Attention",
        domain="kiln", device="cuda", dtypes=_HALF, supports=supports, prepare=prepare, level=level,
        available=triton_available, checker=fp8_checker(fp8 == "pv") if fp8 else None,
        description=f"Triton flash attention{products}, "
                    f"{block_m} queries x {block_n} keys per step, {num_warps} warps, {num_stages} stages; strided "
                    "q/k/v and output (no layout copies), mask/causal/GQA/key lengths in-kernel",
    )


# The same tiles as ATTENTION_CONFIGS (kiln/kernels/cuda/triton/attention.py), listed here so that
# registering the tactics does not import triton. Level 2: a short list for default builds.
for _block_m, _block_n, _warps, _stages, _level in ((128, 64, 4, 3, 2), (128, 128, 8, 3, 2), (64, 64, 4, 3, 2),
                                                    (128, 32, 4, 2, 3), (64, 32, 4, 2, 3), (64, 128, 4, 2, 3),
                                                    (128, 64, 8, 2, 3)):
    register(_triton_attention_tactic(_block_m, _block_n, _warps, _stages, _level))
    # All-E4M3 from opt_level 3 only: an FP8 engine's attention reads the fp16 QKV GEMM output, and putting it on the
    # E4M3 grid as it is loaded took 0.172 ms against the fp16 kernel's 0.090-0.096 (BERT-base 64 x 384, H200,
    # bench/results/quant-gpu-2026-12-04b.md); E4M3 products pay only on E4M3 q, k and a v stored keys-contiguous
    # (0.072 ms writing E4M3), which no QKV GEMM of kiln writes yet
    register(_triton_attention_tactic(_block_m, _block_n, _warps, _stages, max(_level, 3), fp8="pv"))
    # q·kᵀ alone in E4M3 (p·v in fp16, v as the QKV GEMM wrote it): from opt_level 3 too. Timed in the FP8 BERT-base
    # engine (64 x 384, padding mask, H200, bench/results/fp8-bert-2026-12-04c.md): 0.134-0.138 ms against the fp16
    # tile's 0.121 (q and k converted as they are loaded): the tuner keeps the fp16 kernel
    register(_triton_attention_tactic(_block_m, _block_n, _warps, _stages, max(_level, 3), fp8="qk"))


# ---- an explicitly quantized attention (onnxruntime's QDQ BERT, int8 or E4M3): its own kernel ------------------

_QUANTIZED_INPUTS = {False: (torch.int8, torch.uint8), True: (_FP8,)}


def _supports_quantized(step: StepSpec, inputs: list[InputMeta], block_m: int) -> bool | str:
    attributes = step.attributes
    if not all(_attr(attributes, name, None) for name in ("q_quant", "k_quant", "v_quant")):
        return "not a quantized attention with 8-bit q, k and v (the flash tactics take float ones)"
    if tensor_input(inputs, 4) is not None:
        return "key lengths (kiln::KeyLengths): this kernel reads the mask only"
    if _attr(attributes, "is_causal", 0):
        return "is_causal: this kernel takes a mask tensor only"
    views = _meta_views(inputs, attributes)
    if isinstance(views, str):
        return views
    q, k, v = views
    wanted = _QUANTIZED_INPUTS[bool(_attr(attributes, "float8_quant", 0))]
    if any(t.dtype not in wanted for t in (q, k, v)):
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: the attributes say {' or '.join(map(str, wanted))}"
    batch, heads, s_len, d = q.shape
    kv_batch, kv_heads, t_len, dv = v.shape
    if k.shape[:3] != v.shape[:3] or k.shape[3] != d or kv_batch not in (1, batch) or heads % max(kv_heads, 1):
        return f"k {list(k.shape)} and v {list(v.shape)} do not pair with q {list(q.shape)}"
    if max(d, dv) > _MAX_HEAD_DIM or min(s_len, t_len, d, dv) == 0:
        return f"head dims {d}/{dv}, {s_len} queries, {t_len} keys: the kernel takes 1-{_MAX_HEAD_DIM} dims, a key"
    if max(batch, heads) > _GRID_AXIS_LIMIT:
        return f"{batch} batches x {heads} heads: above the {_GRID_AXIS_LIMIT} CUDA grid limit per axis"
    if block_m > 64 and s_len <= 64:
        return f"{block_m}-row tiles for {s_len} queries: mostly padding"
    mask = tensor_input(inputs, 3)
    if mask is not None:
        expanded = _expanded_mask(mask, batch, heads, s_len, t_len)
        if isinstance(expanded, str):
            return expanded
        if _extent(tuple(expanded.shape), expanded.stride()) >= 2**31:
            return "the mask's (batch, head) slab spans more than 2^31 elements"
    if max(_extent(tuple(t.shape), t.stride()) for t in (q, k, v)) >= 2**31 or s_len * heads * dv >= 2**31:
        return "one (batch, head) slab spans more than 2^31 elements: the kernel indexes it in 32 bits"
    return True


def _supports_one_pass(step: StepSpec, inputs: list[InputMeta], block_m: int, max_keys: int) -> bool | str:
    verdict = _supports_quantized(step, inputs, block_m)
    if verdict is not True:
        return verdict
    t_len = _meta_views(inputs, step.attributes)[1].shape[2]
    if t_len > max_keys:
        return (f"{t_len} keys: this tile holds a row block's scores for {max_keys} at most (the two-pass tactics "
                f"take more)")
    return True


def _quantized_attention_tactic(block_m: int, block_n: int, num_warps: int, num_stages: int, level: int,
                                one_pass_keys: int = 0, max_registers: int = 0, form: str = "") -> Tactic:
    """one_pass_keys > 0: the one-pass kernel, for at most that many keys (what the tile's registers hold), with
    max_registers a thread if given (ptxas's cap). form (one pass): "" the session-20 kernel; else the lean one
    (_one_pass_lean_kernel) with "l" (fp32 scores held), "h" (scores held as bytes, exps computed twice), and "k"
    (k and v converted to fp16 once a call, before the kernel) after either."""
    one_pass = one_pass_keys > 0
    lean, hold, kv_half = bool(form), "h" in form, "k" in form

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        kernels = importlib.import_module("kiln.kernels.cuda.triton.quantized_attention")
        attributes = step.attributes
        quant = {name: kernels.Quantization.of(_attr(attributes, name, None)) for name in
                 ("q_quant", "k_quant", "v_quant", "score_quant", "prob_quant", "out_quant")}
        float8 = bool(_attr(attributes, "float8_quant", 0))
        out_quant = quant["out_quant"]
        if out_quant is None:
            out_dtype = torch.float32  # the op's: its q, k, v are dequantized to float32
        else:
            out_dtype = _FP8 if float8 else torch.uint8 if out_quant.qmin >= 0 else torch.int8

        def launch(ctx, q, k=None, v=None, mask=None, key_lengths=None, **attributes):
            q4, k4, v4 = attention_views(q, k, v, attributes)  # [B, H, S, D] views of the inputs' memory
            buffer, out = output_buffer(q4, v4, _attr(attributes, "out_perm", None), out_dtype)
            kernels.quantized_attention(q4, k4, v4, mask, scale=float(_attr(attributes, "scale", 1.0)), **quant,
                                        float8=float8, nan_to_zero=bool(_attr(attributes, "nan_to_zero", 0)),
                                        out=out, block_m=block_m, block_n=block_n, num_warps=num_warps,
                                        num_stages=num_stages, one_pass=one_pass, max_registers=max_registers,
                                        lean=lean, hold=hold, kv_half=kv_half)
            return buffer.flatten(-2) if _attr(attributes, "out_merge_heads", 0) else buffer

        return launch

    if one_pass:
        return Tactic(
            name=f"cuda.attention.quantized_one_pass.{block_m}x{block_n}.w{num_warps}"
                 f"{f'r{max_registers}' if max_registers else ''}{form}", op_type="Attention",
            domain="kiln", device="cuda", dtypes=(torch.int8, torch.uint8, _FP8),
            supports=lambda step, inputs: _supports_one_pass(step, inputs, block_m, one_pass_keys),
            prepare=prepare, level=level, available=triton_available,
            description=f"Triton attention of an explicitly quantized graph (int8 or E4M3 Q/DQ as attributes): one "
                        f"pass, a row block's every score in registers ({block_m} queries x up to {one_pass_keys} "
                        f"keys, {block_n} at a time), {num_warps} warps"
                        f"{f', at most {max_registers} registers a thread' if max_registers else ''}"
                        f"{'; lean: loads ahead, one row reduction' if lean else ''}"
                        f"{', scores held as bytes' if hold else ''}{', k/v converted to fp16 once' if kv_half else ''}",
        )
    return Tactic(
        name=f"cuda.attention.quantized.{block_m}x{block_n}.w{num_warps}s{num_stages}", op_type="Attention",
        domain="kiln", device="cuda", dtypes=(torch.int8, torch.uint8, _FP8),
        supports=lambda step, inputs: _supports_quantized(step, inputs, block_m), prepare=prepare, level=level,
        available=triton_available,
        description=f"Triton attention of an explicitly quantized graph (int8 or E4M3 Q/DQ as attributes): two passes "
                    f"over the keys (the row's max and sum, then the rounded probabilities times v), {block_m} "
                    f"queries x {block_n} keys per step, {num_warps} warps, {num_stages} stages",
    )


for _block_m, _block_n, _warps, _stages, _level in ((64, 64, 4, 2, 2), (128, 64, 8, 2, 2), (64, 32, 4, 2, 3)):
    register(_quantized_attention_tactic(_block_m, _block_n, _warps, _stages, _level))
# One pass where a row block's scores fit in registers (issue 12: the two-pass kernel took 0.53-0.61 ms a BERT-base
# layer, 64 x 384, against the fp16 flash tile's 0.14 on the H100). Tiles of 16-32 rows: their dots are mma.sync
# with the warps side by side along the keys; a 64-row tile is wgmma, but with 8 warps Triton stacks both warp
# groups on the same 64 rows (warpsPerCTA [8, 1]: every score computed twice, 255 registers), and with 4 its 384
# scores a row spill. Registers a thread, E4M3, whole key blocks, ptxas for sm_90 at 384 / 512 keys: 32x128.w8
# 136 / 146 (one program of 8 warps an SM; capped at 128, two: 8 bytes spilled), 16x128.w4 139 / 140, 16x64.w4
# 106 / 139, 32x64.w4 184 at 384, 64x64.w4 183 at 256 (no spills)
# Session 21 (issue 12: the one-pass kernel at 0.475 ms, 2.1x the fp16 tile's 0.222): the lean kernel's tiles (form
# l: loads ahead, one row reduction, E4M3 by conversion; h: scores held as bytes, 64/128-row wgmma tiles; k: k/v
# fp16 once a call). ptxas for sm_90 at 384 keys,
# padding mask, E4M3 (int8), registers / SASS instructions a thread: 32x128.w8r128l 128 (124) / 2016 (3272; the
# session-20 tile: 2688, 3592), ...lk 126 / 1680, 16x128.w4l (512 keys) 255 (167) / 2672, 64x64.w4h 194 (255, 72 B
# spilled) / 7136 for 4x the rows, 128x64.w8h 223 (255, 96 B) / 6952, 64x128.w4h 255 (16 B spilled).
# Timed on the H100 (bench/gpu_qatt2.sh, 64 x 384, padding mask; fp16 flash tile 0.228 ms), E4M3 / int8 ms:
# 32x128.w8r128 0.464 / 0.526, ...l 0.405 / 0.493, ...lk 0.443 / 0.474, 16x128.w4l 0.580 / 0.686, 64x64.w4h
# **0.332** / 0.842, 64x64.w4hk 0.439 / 0.815, 128x64.w8h 0.357 / 0.766, 64x128.w4h 0.345 / 0.810: the E4M3 winner
# 64x64.w4h and the lean 32x128.w8r128l (int8's best but one) join opt_level 2; the tuner times them per engine.
ONE_PASS_TILES = ((32, 128, 8, 512, 2, 0, ""), (32, 128, 8, 384, 2, 128, ""), (16, 128, 4, 512, 2, 0, ""),
                  (16, 64, 4, 512, 2, 0, ""), (32, 64, 4, 384, 3, 0, ""), (64, 64, 4, 256, 3, 0, ""),
                  (32, 128, 8, 384, 2, 128, "l"), (16, 128, 4, 512, 3, 0, "l"), (64, 64, 4, 384, 2, 0, "h"),
                  (128, 64, 8, 384, 3, 0, "h"), (64, 128, 4, 384, 3, 0, "h"), (32, 128, 8, 384, 3, 128, "lk"),
                  (64, 64, 4, 384, 3, 0, "hk"))  # BM, BN, warps, keys, level, register cap, form
for _block_m, _block_n, _warps, _keys, _level, _registers, _form in ONE_PASS_TILES:
    register(_quantized_attention_tactic(_block_m, _block_n, _warps, 1, _level, one_pass_keys=_keys,
                                         max_registers=_registers, form=_form))
