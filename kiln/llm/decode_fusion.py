"""A Llama decode layer's small kernels fused into its GEMVs (kernels/gemv.py's norm, residual, swiglu, rope), chosen
at engine start by timing, per rows bucket, against the layer's unfused kernels.

Unfused, a decode layer on CUDA is 9 launches: qkv, RoPE + cache write, attention, o, add + norm, gate_up,
silu·up, down, add + norm (GEMVs or cuBLAS as kiln/llm/decode_gemv.py chose). Fused it is 6 (5 with RoPE):

    qkv     = rmsnorm(x)·Wqkvᵀ                   (input norm folded into the GEMV; and where it times faster
                                                  than the pair, RoPE and the KV cache write in its epilogue)
    x       = x + attend(qkv)·Woᵀ                 (residual add in the o GEMV's epilogue)
    act     = swiglu(rmsnorm(x)·Wgate_upᵀ)        (post-attention norm folded in, silu(gate)·up stored)
    x       = x + act·Wdownᵀ                      (residual add in the down GEMV's epilogue)

and the next layer's qkv reads that x. The residual stream x is the only thing carried between layers (no
normed copy), and the model's final norm runs once after the last layer.

Per bucket, each of the four fused GEMVs' candidate configs is checked against torch in fp32 and timed, and the
q|k|v GEMV with RoPE against the best q|k|v one plus rope_kv_write; then one layer's projections with RoPE and
the cache write (attention is the same both ways and left out) are timed fused at the best configs against the
unfused kernels, each as a CUDA graph rotating over every layer. The fused layer is used for that bucket only
when it is at least MARGIN faster (mode auto); "on" uses it wherever all four fused GEMVs passed their check;
"off" never (EngineConfig.decode_fusion, default KILN_LLM_FUSE, else auto).
Llama-family models (Llama, Mistral, Qwen2) on one GPU, weights in bf16/fp16/fp32 or per-channel FP8/INT8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.config import LLMError
from kiln.llm.decode_gemv import ENGINE_CONFIGS, ROW_BUCKETS, graph_time, operand, reference_product
from kiln.llm.kernels import gemv as gemv_kernels
from kiln.llm.kernels.fused import rope_kv_write, silu_mul
from kiln.llm.kernels.gemv import GemvConfig, RopeKV
from kiln.llm.models.layers import ColumnLinear, RMSNorm, RowLinear
from kiln.llm.models.llama import LlamaForCausalLM, LlamaLayer

log = logging.getLogger("kiln.llm")

MODES = {"auto": "auto", "on": "on", "off": "off", "1": "on", "0": "off"}
MARGIN = 0.02  # auto: the fused layer must be 2% faster than the unfused one (timing noise)
ROLES = ("qkv", "o", "gate_up", "down")
WHOLE_K = ("qkv", "gate_up", "qkv_rope")  # norm, swiglu and rope need the whole of K in one program: split_k 1


@dataclass(frozen=True)
class FusedLayerConfigs:
    """The GEMV config of each fused projection of a decode layer (one bucket)."""

    qkv: GemvConfig  # input norm folded in
    o: GemvConfig  # + residual
    gate_up: GemvConfig  # post-attention norm folded in, SwiGLU epilogue
    down: GemvConfig  # + residual
    rope: bool = False  # the qkv GEMV also applies RoPE and writes k and v into the cache


@dataclass
class FusionDecision:
    bucket: int
    configs: FusedLayerConfigs | None  # None: this bucket's layers run unfused
    fused_us: float | None = None  # one layer's projections, fused at `configs`
    unfused_us: float | None = None
    kernels: dict[str, dict[str, float | None]] = field(default_factory=dict)  # role -> config name -> us

    def describe(self) -> str:
        times = "" if self.fused_us is None else (f" (layer projections fused {self.fused_us:.1f} us, unfused "
                                                  f"{self.unfused_us:.1f} us)")
        if self.configs is None:
            return f"M<={self.bucket}: unfused{times}"
        names = ", ".join(f"{role} {getattr(self.configs, role).name}" for role in ROLES)
        names += " (qkv with RoPE + cache write)" if self.configs.rope else ""
        return f"M<={self.bucket}: fused{times}: {names}"


class DecodeFusion:
    """A model's fused decode plan, rows bucket -> configs (None: unfused), and the fused projections the Llama
    layer calls (here, not in the model: a CPU model never imports triton)."""

    def __init__(self, plan: dict[int, FusedLayerConfigs | None]):
        self.plan = dict(sorted(plan.items()))

    def configs_for(self, rows: int) -> FusedLayerConfigs | None:
        for bucket, configs in self.plan.items():
            if rows <= bucket:
                return configs
        return None

    @staticmethod
    def normed(linear: ColumnLinear, norm: RMSNorm, x: torch.Tensor, config: GemvConfig,
               swiglu: bool = False) -> torch.Tensor:
        """x [T, K] -> rmsnorm(x)·Wᵀ + b [T, N], or swiglu of it [T, N/2]."""
        weight, scale = operand(linear)
        return gemv_kernels.gemv(x, weight, scale, linear.bias, config, norm=norm.weight, eps=norm.eps,
                                 swiglu=swiglu)

    @staticmethod
    def normed_rope(attn: nn.Module, norm: RMSNorm, x: torch.Tensor, config: GemvConfig, positions: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> q [T, Hq, D]: rmsnorm(x)·Wqkvᵀ + b's q rotated; k rotated and v written into the slots."""
        weight, scale = operand(attn.qkv_proj)
        rope = RopeKV(positions, slot_mapping, attn.rotary.cos, attn.rotary.sin, kv_cache[0], kv_cache[1],
                      attn.num_heads, attn.num_kv_heads, attn.head_dim)
        q = gemv_kernels.gemv(x, weight, scale, attn.qkv_proj.bias, config, norm=norm.weight, eps=norm.eps, rope=rope)
        return q.view(x.shape[0], attn.num_heads, attn.head_dim)

    @staticmethod
    def residual(linear: RowLinear, x: torch.Tensor, residual: torch.Tensor, config: GemvConfig) -> torch.Tensor:
        """x [T, K], residual [T, N] -> residual + x·Wᵀ + b (one rank: no all-reduce between)."""
        weight, scale = operand(linear)
        return gemv_kernels.gemv(x, weight, scale, linear.bias, config, residual=residual)


def resolve_mode(mode: str) -> str:
    if mode not in MODES:
        raise LLMError(f"decode_fusion {mode!r} (EngineConfig.decode_fusion or KILN_LLM_FUSE): expected auto, "
                       "on (1) or off (0)")
    return MODES[mode]


def refusal(model: nn.Module, act_dtype: torch.dtype) -> str | None:
    """Why the model's decode layers cannot be fused, or None."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    if act_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations in {act_dtype}"
    layer = model.layers[0]
    if layer.self_attn.o_proj.tp.size != 1:
        return "tensor parallel (the residual add would come before the all-reduce)"
    for name, linear in projections(layer).items():
        if operand(linear) is None:
            return f"the {name} weight is not one the GEMV reads (int4, group-wise or missing)"
    return None


def projections(layer: LlamaLayer) -> dict[str, nn.Module]:
    return {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj, "qkv_rope": layer.self_attn.qkv_proj}


@dataclass
class LayerInputs:
    """Random inputs of one decode layer's projections at `rows` rows (a bucket)."""

    x: torch.Tensor  # [rows, hidden]: the residual stream
    attended: torch.Tensor  # [rows, Hq·D]: the attention output o reads
    act: torch.Tensor  # [rows, intermediate]: what down reads
    positions: torch.Tensor  # [rows]: RoPE's
    slots: torch.Tensor  # [rows]: row t's k and v go to slot t
    kv_cache: tuple[torch.Tensor, torch.Tensor]  # [1, rows, Hkv, D] each


def layer_inputs(model: LlamaForCausalLM, rows: int, dtype: torch.dtype, device: torch.device) -> LayerInputs:
    layer = model.layers[0]
    attn = layer.self_attn
    width = {name: operand(linear)[0].shape[1] for name, linear in projections(layer).items()}
    cache = (1, rows, attn.num_kv_heads, attn.head_dim)
    return LayerInputs(x=torch.randn((rows, width["qkv"]), device=device).to(dtype),
                       attended=torch.randn((rows, width["o"]), device=device).to(dtype),
                       act=torch.randn((rows, width["down"]), device=device).to(dtype),
                       positions=torch.arange(rows, device=device) * 7 + 3, slots=torch.arange(rows, device=device),
                       kv_cache=(torch.zeros(cache, device=device, dtype=dtype),
                                 torch.zeros(cache, device=device, dtype=dtype)))


def fused_call(role: str, layer: LlamaLayer, inputs: LayerInputs, config: GemvConfig) -> Callable[[], torch.Tensor]:
    """One fused projection of `layer` on `inputs`, as the fused layer calls it."""
    p = projections(layer)
    if role == "qkv":
        return lambda: DecodeFusion.normed(p["qkv"], layer.input_layernorm, inputs.x, config)
    if role == "qkv_rope":
        return lambda: DecodeFusion.normed_rope(layer.self_attn, layer.input_layernorm, inputs.x, config,
                                                inputs.positions, inputs.kv_cache, inputs.slots)
    if role == "gate_up":
        return lambda: DecodeFusion.normed(p["gate_up"], layer.post_attention_layernorm, inputs.x, config, True)
    source = inputs.attended if role == "o" else inputs.act
    return lambda: DecodeFusion.residual(p[role], source, inputs.x, config)


def fused_reference(role: str, layer: LlamaLayer, inputs: LayerInputs) -> torch.Tensor:
    """What fused_call computes, in fp32 torch on the dequantized weight."""
    linear = projections(layer)[role]
    weight, scale = operand(linear)
    bias = 0 if linear.bias is None else linear.bias.float()
    if role in WHOLE_K:
        norm = layer.post_attention_layernorm if role == "gate_up" else layer.input_layernorm
        x = inputs.x.float()
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
        y = reference_product(h, weight, scale) + bias
        if role == "qkv":
            return y
        if role == "qkv_rope":
            return rotated_qkv(layer.self_attn, y, inputs.positions)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    source = inputs.attended if role == "o" else inputs.act
    return inputs.x.float() + reference_product(source, weight, scale) + bias


def rotated_qkv(attn: nn.Module, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T, (Hq + 2·Hkv)·D] fp32 -> the same with q and k rotated (rotate-half RoPE at `positions`)."""
    heads = qkv.view(qkv.shape[0], -1, attn.head_dim)  # [T, Hq + 2·Hkv, D]
    cos, sin = attn.rotary.cos[positions][:, None, :], attn.rotary.sin[positions][:, None, :]
    first, second = heads.chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    rotary_heads = attn.num_heads + attn.num_kv_heads
    return torch.cat((rotated[:, :rotary_heads], heads[:, rotary_heads:]), dim=1).reshape(qkv.shape)


def rope_outputs(attn: nn.Module, q: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
    """What normed_rope computed, laid out as q|k|v [T, (Hq + 2·Hkv)·D]: q, and k and v read from the cache."""
    rows = q.shape[0]
    k, v = (cache[0, :rows].reshape(rows, -1) for cache in inputs.kv_cache)  # slot t holds row t
    return torch.cat((q.reshape(rows, -1), k, v), dim=-1)


def fused_error(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when a fused GEMV's output matches the fp32 reference: within a few roundings of its 16-bit dtype
    (SwiGLU rounds gate, up, silu and the product), or fp32's where x is fp32."""
    rtol = 1e-5 if got.dtype == torch.float32 else 2e-2
    err = (got.float() - ref).abs()
    bound = rtol * ref.abs() + rtol / 5 * ref.abs().max()
    if torch.isfinite(got.float()).all() and not (err > bound).any():
        return None
    return f"max |error| {err.max().item():.3g} against torch fp32"


def unfused_layer(layer: LlamaLayer, next_norm: RMSNorm, inputs: LayerInputs) -> Callable[[], object]:
    """One layer's projections as the unfused model runs them on CUDA (each linear through its DecodeGemv plan or
    its own path; add + norm and silu·up as kernels/fused.py's kernels)."""
    attn, mlp = layer.self_attn, layer.mlp

    def run():
        qkv = attn.qkv_proj(inputs.x)  # its input norm is the previous layer's last add + norm
        rope_write(attn, qkv, inputs)
        x, h = layer.post_attention_layernorm.add_forward(inputs.x, attn.o_proj(inputs.attended))
        silu_mul(mlp.gate_up_proj(h))
        return next_norm.add_forward(x, mlp.down_proj(inputs.act))

    return run


def fused_layer(layer: LlamaLayer, inputs: LayerInputs, configs: FusedLayerConfigs) -> Callable[[], object]:
    """One layer's projections as LlamaLayer.fused_forward runs them."""
    if configs.rope:
        qkv = fused_call("qkv_rope", layer, inputs, configs.qkv)
    else:
        project = fused_call("qkv", layer, inputs, configs.qkv)

        def qkv():
            rope_write(layer.self_attn, project(), inputs)

    calls = [qkv] + [fused_call(role, layer, inputs, getattr(configs, role)) for role in ROLES[1:]]

    def run():
        for call in calls:
            call()

    return run


def rope_write(attn: nn.Module, qkv: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
    """The unfused RoPE + cache write (kernels/fused.py) of a projected qkv."""
    return rope_kv_write(qkv, inputs.positions, inputs.slots, attn.rotary.cos, attn.rotary.sin,
                         inputs.kv_cache[0], inputs.kv_cache[1], attn.num_heads, attn.num_kv_heads, attn.head_dim)


class FusionTuner:
    """Chooses a model's DecodeFusion. `measure(bucket, name, calls) -> us` is graph_time on CUDA; tests pass
    fake timings. `candidates(role, element_size)` lists the GEMV configs tried per projection (split-K ones are
    dropped for qkv and gate_up)."""

    def __init__(self, mode: str = "auto", measure: Callable[[int, str, list], float] | None = None,
                 candidates: Callable[[str, int], list[GemvConfig]] | None = None):
        self.mode = resolve_mode(mode)
        self.measure = measure or (lambda bucket, name, calls: graph_time(calls))
        self.candidates = candidates or engine_candidates

    def tune(self, model: nn.Module, act_dtype: torch.dtype, max_rows: int = ROW_BUCKETS[-1]) -> list[FusionDecision]:
        """Set model.decode_fusion (left None when nothing is fused) and return each bucket's decision."""
        if self.mode == "off":
            return []
        why = refusal(model, act_dtype)
        if why is not None:
            log.info("kiln llm: decode layers unfused: %s", why)
            return []
        cap = next(b for b in ROW_BUCKETS if b >= min(max_rows, ROW_BUCKETS[-1]))
        decisions = [self._decide(model, bucket, act_dtype) for bucket in ROW_BUCKETS if bucket <= cap]
        for decision in decisions:
            log.info("kiln llm: decode layers %s", decision.describe())
        plan = {d.bucket: d.configs for d in decisions}
        model.decode_fusion = DecodeFusion(plan) if any(c is not None for c in plan.values()) else None
        return decisions

    def _decide(self, model: LlamaForCausalLM, bucket: int, act_dtype: torch.dtype) -> FusionDecision:
        layers = list(model.layers)
        device = operand(layers[0].self_attn.qkv_proj)[0].device
        inputs = layer_inputs(model, bucket, act_dtype, device)
        decision = FusionDecision(bucket, None)
        best = {}
        for role in ROLES:
            decision.kernels[role] = self._time_role(role, layers, inputs)
            usable = {name: us for name, us in decision.kernels[role].items() if us is not None}
            if not usable:
                return decision
            best[role] = min(usable, key=lambda name: (usable[name], name))
        configs = FusedLayerConfigs(**{role: self._configs(role, layers)[best[role]] for role in ROLES})
        rope = self._rope_config(layers, inputs, decision, best["qkv"])
        if rope is not None:
            configs = replace(configs, qkv=rope, rope=True)
        if self.mode == "on":
            decision.configs = configs
            return decision
        norms = [layer.input_layernorm for layer in layers[1:]] + [model.norm]
        decision.unfused_us = self.measure(bucket, "unfused layer",
                                           [unfused_layer(layer, norm, inputs) for layer, norm in zip(layers, norms)])
        decision.fused_us = self.measure(bucket, "fused layer",
                                         [fused_layer(layer, inputs, configs) for layer in layers])
        if decision.fused_us < decision.unfused_us * (1 - MARGIN):
            decision.configs = configs
        return decision

    def _rope_config(self, layers: list[LlamaLayer], inputs: LayerInputs, decision: FusionDecision,
                     qkv_name: str) -> GemvConfig | None:
        """The q|k|v GEMV config with RoPE and the cache write, where it is faster than the best q|k|v GEMV
        (`qkv_name`) and rope_kv_write after it (MARGIN faster in auto; any that passes its check in on)."""
        decision.kernels["qkv_rope"] = timings = self._time_role("qkv_rope", layers, inputs)
        usable = {name: us for name, us in timings.items() if us is not None}
        if not usable:
            return None
        best = min(usable, key=lambda name: (usable[name], name))
        if self.mode != "on":
            project = self._configs("qkv", layers)[qkv_name]
            pair_us = self.measure(inputs.x.shape[0], "qkv + rope_kv_write", [
                lambda layer=layer: rope_write(layer.self_attn, fused_call("qkv", layer, inputs, project)(), inputs)
                for layer in layers])
            decision.kernels["qkv + rope_kv_write"] = {qkv_name: pair_us}
            if usable[best] >= pair_us * (1 - MARGIN):
                return None
        return self._configs("qkv_rope", layers)[best]

    def _time_role(self, role: str, layers: list[LlamaLayer], inputs: LayerInputs) -> dict[str, float | None]:
        """Each candidate config's time for one fused projection (None where it is off or does not run)."""
        reference = fused_reference(role, layers[0], inputs)
        timings: dict[str, float | None] = {}
        for config in self._configs(role, layers).values():
            try:
                got = fused_call(role, layers[0], inputs, config)()
                if role == "qkv_rope":
                    got = rope_outputs(layers[0].self_attn, got, inputs)
                error = fused_error(got, reference)
            except Exception as failure:  # e.g. a config past this GPU's shared memory
                error = f"{type(failure).__name__}: {str(failure)[:200]}"
            if error is not None:
                log.warning("kiln llm: fused %s GEMV %s rows %d is off or does not run (%s): not used", role,
                            config.name, inputs.x.shape[0], error)
                timings[config.name] = None
                continue
            timings[config.name] = self.measure(inputs.x.shape[0], f"{role} {config.name}",
                                                [fused_call(role, layer, inputs, config) for layer in layers])
        return timings

    def _configs(self, role: str, layers: list[LlamaLayer]) -> dict[str, GemvConfig]:
        """name -> config of the candidates for `role`'s weight (split_k 1 where the fusion needs the whole K)."""
        element_size = operand(projections(layers[0])[role])[0].element_size()
        return {c.name: c for c in self.candidates(role, element_size) if role not in WHOLE_K or c.split_k == 1}


def engine_candidates(role: str, element_size: int) -> list[GemvConfig]:
    """decode_gemv's engine shortlist (bench/gemv.py's H200 sweep) for the weight's element size."""
    return list(ENGINE_CONFIGS.get(element_size, []))
