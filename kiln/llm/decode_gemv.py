"""Which kernel multiplies a decode step's few rows by each linear layer's weight and the LM head's: the layer's
own path (cuBLAS's F.linear for bf16/fp16; FP8: per-token E4M3 activations + torch._scaled_mm; INT8: the
weight-only GEMM of kernels/quant_gemm.py) or kiln's decode GEMV (kernels/gemv.py). Chosen per (weight shape, weight
dtype, activation dtype, rows bucket) by timing both on the device at engine start, not by a rule, the way
the builder's tactic search picks a layer's kernel; the timings are cached (in the process, and in a
TimingCache file when one is given) under a key that holds the device, the versions and the candidates.

Modes (EngineConfig.gemv, default from the KILN_LLM_GEMV environment variable, else auto):
  auto    per bucket the faster of the layer's own path and the GEMV's candidate configs (the GEMV must win by
          MARGIN, 5%: anything closer keeps the library);
  cublas  the layers' own path for every row count; nothing is timed;
  triton  the GEMV for every bucket, one config per weight shape for all of them (the smallest time summed over
          the buckets), so a row's result does not depend on how many rows the step has (batch invariance:
          kernels/gemv.py). In auto a step of 1 row and one of 8 may run different kernels.
Rows past the last bucket (prefill) always take the layer's own path. Every candidate is checked against
torch in fp32 on the layer's dequantized weight before it is timed; one that is off is never chosen.

Timing: one CUDA graph of calls rotating over every layer of the shape (32 different weights in an 8B model:
the reads come from HBM, as in a decode step, not from L2), median of a few replays.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kiln.builder.timing_cache import TimingCache, environment, signature_key
from kiln.llm.config import LLMError
from kiln.llm.kernels import gemv as gemv_kernels
from kiln.llm.kernels.gemv import DecodeGemv, GemvConfig
from kiln.llm.models.layers import ColumnLinear, RowLinear, VocabEmbedding
from kiln.llm.quantization import FP8Weight, Int8Weight

log = logging.getLogger("kiln.llm")

MODES = ("auto", "cublas", "triton")
ROW_BUCKETS = (1, 2, 4, 8, 16)
LIBRARY = "library"  # a timing's name for the layer's own path
MARGIN = 0.05  # auto: the GEMV is chosen when it is at least 5% faster than the library (timing noise, and a
# GEMV timed alone differs from one between a decode step's other kernels)
LAUNCHES, REPLAYS = 24, 5
_PROCESS_CACHE: dict[str, dict] = {}  # signature key -> timings, for every engine this process starts

# the configs the engine times per weight element size (bytes), chosen among by timing at engine start.
# 2 (bf16/fp16): the shortlist of bench/gemv_sweep.py's H200 sweep (2026-12-02 23:02 UTC, commit e282542:
# bench/results/gemv-2026-12-02b.md): every (shape, rows) winner at Llama-3-8B's shapes, then by geometric-mean
# slowdown; pdl = programmatic dependent launch, pf = W prefetched a tile ahead. 1 (FP8/INT8): bench/gemv.py's
# sweep of 12:28 UTC (no pdl variants timed for 1-byte weights yet)
ENGINE_CONFIGS: dict[int, list[GemvConfig]] = {
    2: [GemvConfig("fma", 8, 512, 1, 4, 1, pdl=True),
        GemvConfig("dot_swap", 64, 256, 1, 4, 4),
        GemvConfig("fma", 4, 512, 1, 4, 1, prefetch=True, pdl=True),
        GemvConfig("dot_swap", 64, 256, 1, 4, 4, pdl=True),
        GemvConfig("dot", 64, 256, 1, 4, 3, pdl=True),
        GemvConfig("dot_swap", 128, 128, 1, 8, 3),
        GemvConfig("dot_swap", 64, 256, 2, 4, 4, "last", pdl=True),
        GemvConfig("dot_swap", 128, 128, 1, 8, 3, pdl=True)],
    1: [GemvConfig("fma", 8, 1024, 1, 4, 1),
        GemvConfig("dot", 64, 256, 8, 4, 3, "last"),
        GemvConfig("fma", 8, 512, 1, 4, 1),
        GemvConfig("dot", 64, 256, 2, 4, 3, "last"),
        GemvConfig("dot", 64, 256, 4, 4, 4, "last"),
        GemvConfig("dot", 64, 256, 4, 4, 3, "last"),
        GemvConfig("dot", 64, 256, 1, 4, 3),
        GemvConfig("fma", 2, 2048, 1, 4, 1)],
}


@dataclass(frozen=True)
class GemvShape:
    """What a timing depends on besides the rows: y[M, n] = x[M, k] · W[n, k]ᵀ."""

    n: int
    k: int
    weight_dtype: str
    act_dtype: str


@dataclass
class GemvDecision:
    shape: GemvShape
    layers: int  # how many layers share the shape
    plan: dict[int, GemvConfig | None]  # rows bucket -> the GEMV's config, or None for the layer's own path
    timings: dict[int, dict[str, float | None]] = field(default_factory=dict)  # bucket -> name -> us (None: off)

    def describe(self) -> str:
        parts = []
        for bucket, config in self.plan.items():
            t = self.timings.get(bucket, {})
            mine = LIBRARY if config is None else config.name
            parts.append(f"M<={bucket}: {mine}" + (f" {t[mine]:.1f} us (library {t[LIBRARY]:.1f})"
                                                   if t.get(mine) is not None and t.get(LIBRARY) else ""))
        s = self.shape
        return f"{s.k}x{s.n} {s.weight_dtype} ({self.layers} layers): " + "; ".join(parts)


def resolve_mode(mode: str) -> str:
    if mode not in MODES:
        raise LLMError(f"gemv {mode!r} (EngineConfig.gemv or KILN_LLM_GEMV): expected one of {', '.join(MODES)}")
    return mode


def decide(timings: dict[int, dict[str, float | None]], configs: dict[str, GemvConfig], mode: str,
           margin: float = MARGIN) -> dict[int, GemvConfig | None]:
    """timings: bucket -> candidate name (LIBRARY or a config's name) -> us, None where it failed its check.
    Returns bucket -> the chosen config (None: the library)."""
    buckets = sorted(timings)
    if mode == "cublas" or not configs:
        return {b: None for b in buckets}
    if mode == "triton":
        usable = [name for name in configs if all(timings[b].get(name) is not None for b in buckets)]
        if not usable:
            raise LLMError("gemv=triton: no GEMV config passed its check at every rows bucket "
                           f"({ {b: timings[b] for b in buckets} }); use gemv=auto or cublas")
        best = min(usable, key=lambda name: (sum(timings[b][name] for b in buckets), name))
        return {b: configs[best] for b in buckets}
    plan = {}
    for b in buckets:
        mine = {name: us for name, us in timings[b].items() if name in configs and us is not None}
        library = timings[b].get(LIBRARY)
        best = min(mine, key=lambda name: (mine[name], name), default=None)
        faster = best is not None and (library is None or mine[best] < library * (1 - margin))
        plan[b] = configs[best] if faster else None
    return plan


def operand(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [N, K] as the GEMV reads it, per-channel scale) of a linear layer or the LM head, or None when the
    GEMV does not take its weight (int4, group-wise 8-bit, a layer without a weight)."""
    if isinstance(layer, VocabEmbedding):
        w = layer.weight
        return (w.data, None) if w.dtype in (torch.bfloat16, torch.float16, torch.float32) else None
    if not isinstance(layer, (ColumnLinear, RowLinear)):
        return None
    if layer.quantized is None:
        w = layer.weight
        usable = w is not None and not w.is_meta and w.dtype in (torch.bfloat16, torch.float16, torch.float32)
        return (w.data, None) if usable else None
    if isinstance(layer.quantized, (FP8Weight, Int8Weight)):
        return layer.quantized.q, layer.quantized.scale
    return None


def library_product(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own x·Wᵀ (no bias, no all-reduce): what the GEMV replaces."""
    if isinstance(layer, VocabEmbedding) or layer.quantized is None:
        return F.linear(x, layer.weight)
    return layer.quantized(x)


def lm_head(model: nn.Module) -> nn.Module | None:
    """The VocabEmbedding whose logits the model computes: its lm_head, or the tied input embedding."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head
    return next((m for m in model.modules() if isinstance(m, VocabEmbedding)), None)


def graph_time(calls: list[Callable[[], object]], launches: int = LAUNCHES, replays: int = REPLAYS) -> float:
    """Microseconds per call on CUDA: `launches` calls rotating over `calls` in one CUDA graph, median of
    `replays` replays (CUDA events)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def gemv_error(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when the GEMV's output matches the fp32 reference within the output dtype's rounding."""
    rtol = 1e-5 if got.dtype == torch.float32 else 1e-2  # bf16 rounds at 2^-9 relative; fp32 sums in another order
    err = (got.float() - ref).abs()
    bound = rtol * ref.abs() + rtol / 5 * ref.abs().max()
    if torch.isfinite(got.float()).all() and not (err > bound).any():
        return None
    return f"max |error| {err.max().item():.3g} against torch fp32"


def reference_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                      rows: int = 8192) -> torch.Tensor:
    """x·dequant(W)ᵀ in fp32 torch, `rows` output features at a time (an LM head in fp32 is 2 GB at once)."""
    parts = []
    for start in range(0, weight.shape[0], rows):
        w = weight[start:start + rows].float()
        if scale is not None:
            w = w * scale[start:start + rows, None]
        parts.append(x.float() @ w.T)
    return torch.cat(parts, dim=-1)


class GemvTuner:
    """Times each weight shape's candidates once per rows bucket and gives its layers a DecodeGemv plan.
    `measure(shape, bucket, name, calls) -> us` is graph_time on CUDA; tests pass fake timings."""

    def __init__(self, mode: str = "auto", cache: TimingCache | None = None,
                 measure: Callable[[GemvShape, int, str, list], float] | None = None,
                 candidates: Callable[[GemvShape, int], list[GemvConfig]] | None = None):
        self.mode = resolve_mode(mode)
        self.cache = cache
        self.measure = measure or (lambda shape, bucket, name, calls: graph_time(calls))
        self.candidates = candidates or (lambda shape, element_size: ENGINE_CONFIGS.get(element_size, []))

    def tune(self, model: nn.Module, act_dtype: torch.dtype, max_rows: int = ROW_BUCKETS[-1]) -> list[GemvDecision]:
        """Attach a DecodeGemv to every linear layer the GEMV can take (none in cublas mode); x in act_dtype,
        steps of up to max_rows rows (the engine's max_num_seqs)."""
        if self.mode == "cublas" or act_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return []
        cap = next(b for b in ROW_BUCKETS if b >= min(max_rows, ROW_BUCKETS[-1]))
        buckets = [b for b in ROW_BUCKETS if b <= cap]
        groups: dict[GemvShape, list[tuple[nn.Module, torch.Tensor, torch.Tensor | None]]] = {}
        head = lm_head(model)
        for layer in model.modules():
            if isinstance(layer, VocabEmbedding) and layer is not head:
                continue  # an input embedding that is not also the LM head multiplies nothing
            found = operand(layer)
            if found is None:
                continue
            layer.decode_gemv = None  # timed on its own path
            w, scale = found
            shape = GemvShape(w.shape[0], w.shape[1], str(w.dtype).removeprefix("torch."),
                              str(act_dtype).removeprefix("torch."))
            groups.setdefault(shape, []).append((layer, w, scale))
        decisions = []
        for shape, members in groups.items():
            configs = {c.name: c for c in self.candidates(shape, members[0][1].element_size())}
            if not configs:  # no GEMV for this weight's element size (fp32): its own path, nothing to time
                continue
            key = signature_key({"what": "kiln.llm decode gemv", "shape": vars(shape), "buckets": buckets,
                                 "candidates": sorted(configs), "environment": environment(members[0][1].device)})
            cached = self.cache.get(key) if self.cache is not None else _PROCESS_CACHE.get(key)
            if cached is not None:
                timings = {int(b): t for b, t in cached["timings"].items()}
            else:
                timings = {b: self._time(shape, b, members, configs) for b in buckets}
                entry = {"timings": {str(b): t for b, t in timings.items()}}
                _PROCESS_CACHE[key] = entry
                if self.cache is not None:
                    self.cache.put(key, entry)
            plan = decide(timings, configs, self.mode)
            for layer, w, scale in members:
                layer.decode_gemv = DecodeGemv(w, scale, plan)
            decision = GemvDecision(shape, len(members), plan, timings)
            log.info("kiln llm: decode GEMV %s", decision.describe())
            decisions.append(decision)
        if self.cache is not None:
            self.cache.save()
        return decisions

    def _time(self, shape: GemvShape, bucket: int, members, configs: dict[str, GemvConfig]) -> dict[str, float | None]:
        """bucket rows: LIBRARY's time and each config's (None where it failed its check). The library is timed
        before and after the configs and keeps the faster: a drifting clock does not favour the GEMV."""
        gemv = gemv_kernels.gemv  # looked up per call: tests wrap it
        layer0, w0, scale0 = members[0]
        x = torch.randn((bucket, shape.k), device=w0.device).to(getattr(torch, shape.act_dtype))
        reference = reference_product(x, w0, scale0)
        library = [lambda m=m: library_product(m, x) for m, _, _ in members]
        timings: dict[str, float | None] = {LIBRARY: self.measure(shape, bucket, LIBRARY, library)}
        for name, config in configs.items():
            try:
                error = gemv_error(gemv(x, w0, scale0, None, config), reference)
            except Exception as failure:  # e.g. E4M3 needs sm_89; a config past this GPU's shared memory
                error = f"{type(failure).__name__}: {str(failure)[:200]}"
            if error is not None:
                log.warning("kiln llm: decode GEMV %s at %dx%d %s rows %d is off or does not run (%s): not used",
                            name, shape.k, shape.n, shape.weight_dtype, bucket, error)
                timings[name] = None
                continue
            timings[name] = self.measure(shape, bucket, name,
                                         [lambda w=w, s=s, c=config: gemv(x, w, s, None, c) for _, w, s in members])
        timings[LIBRARY] = min(timings[LIBRARY], self.measure(shape, bucket, LIBRARY, library))
        return timings
