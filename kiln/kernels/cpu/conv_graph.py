"""2-D convolution through oneDNN Graph (torch's TorchScript LLGA bridge): set-up once, run cheap.

torch's eager oneDNN entry points (`_convolution_pointwise`, conv2d) rebuild the convolution's
primitive descriptor on every call: ~30-50 µs here whatever the layer's size, as much as the
convolution itself on MobileNetV2's 14x14 and 7x7 layers (measured: a 12-conv MobileNetV2 chain
runs 990 µs through `_convolution_pointwise`, its oneDNN primitives only 410 µs of it).
oneDNN Graph compiles a partition once per input shape and layout and then only executes it:
the same chain, one traced-and-frozen layer per call, runs in ~630 µs.

`GraphConv` traces the layer (conv + bias + activation + residual, out of place so oneDNN Graph
can fuse the epilogue) on example inputs of the tuned size in channels-last layout, freezes it
(the weight becomes a constant oneDNN packs once) and warms it up with fusion enabled; the
process-wide TorchScript fusion switch is put back as it was afterwards: the compiled plan
keeps its fused partition. Any other input shape or layout fails the plan's guard and runs the
unfused TorchScript fallback (same result, eager speed).

The traced module is frozen in a compilation unit of its own (`_private_copy`): freezing clones the module's
methods into its type's compilation unit with the weight as a graph constant, and a traced module's type lies in
TorchScript's process-wide unit (torch.jit.trace ignores `_compilation_unit` for modules), which never lets a
function go. Frozen there, every layer ever compiled kept its channels-last weight to the end of the process: the
tactic search's candidates (2.25 MiB per 256x256x3x3 layer; 22.5 MiB alive at ResNet-50's last layer tuned,
bench/results/mem5-2026-12-05d.md). A module loaded by torch.jit.load has a unit of its own, which goes with it.
"""

from __future__ import annotations

import gc
import io

import torch
import torch.nn.functional as F

_WARMUP_RUNS = 3  # the profiling executor records shapes on the first runs, then compiles the fused plan

_ACTIVATIONS = {  # out of place: oneDNN Graph fuses these as post-ops (see kiln/ops/fused.py for the maths)
    "": lambda y, alpha, beta: y,
    "Relu": lambda y, alpha, beta: torch.relu(y),
    "Clip": lambda y, alpha, beta: torch.clamp(y, alpha, beta),
    "Sigmoid": lambda y, alpha, beta: torch.sigmoid(y),
    "Tanh": lambda y, alpha, beta: torch.tanh(y),
    "SiLU": lambda y, alpha, beta: F.silu(y),
    "HardSwish": lambda y, alpha, beta: F.hardswish(y),
    "Gelu": lambda y, alpha, beta: F.gelu(y),
    "GeluTanh": lambda y, alpha, beta: F.gelu(y, approximate="tanh"),
    "LeakyRelu": lambda y, alpha, beta: F.leaky_relu(y, alpha),
    "HardSigmoid": lambda y, alpha, beta: torch.clamp(y * alpha + beta, 0.0, 1.0),
}


def graph_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.jit, "enable_onednn_fusion")


def graph_activation_supported(activation: str) -> bool:
    return activation in _ACTIVATIONS


class _Layer(torch.nn.Module):
    """y = act(conv(x, W) + b [+ r]) [+ r], as the epilogue of kiln::FusedConv orders it."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, padding: list[int], stride: list[int],
                 dilation: list[int], groups: int, activation: str, alpha: float, beta: float,
                 residual_after_activation: bool):
        super().__init__()
        self.w = torch.nn.Parameter(w.contiguous(memory_format=torch.channels_last), requires_grad=False)
        self.b = None if b is None else torch.nn.Parameter(b.contiguous(), requires_grad=False)
        self.geometry = (stride, padding, dilation, groups)
        self.act = _ACTIVATIONS[activation]
        self.alpha, self.beta = alpha, beta
        self.after = residual_after_activation

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        stride, padding, dilation, groups = self.geometry
        y = F.conv2d(x, self.w, self.b, stride, padding, dilation, groups)  # x: [N, C, H, W] NHWC
        if residual is not None and not self.after:
            y = y + residual
        y = self.act(y, self.alpha, self.beta)
        if residual is not None and self.after:
            y = y + residual
        return y


def _frozen_private_copy(layer: _Layer, examples: tuple[torch.Tensor, ...]) -> torch.jit.ScriptModule:
    """`layer` (handed over: the caller keeps no reference) traced, saved, loaded again and frozen: the module's
    type in a compilation unit of its own.

    torch.jit.load makes a new unit per load, and freezing clones into the module's own unit, so the frozen
    graph (and the weight it holds as a constant) is freed with the module. Each form of the weight goes as soon
    as the next exists (the layer's, which the traced module shares, once saved; the archive once loaded; the
    loaded module once frozen): two at a time. Held to the end, they were four: ResNet-50's 9.4 MiB 3x3 layers took
    +52 MiB resident while one was prepared, and the tactic search prepares one per conv layer
    (bench/results/mem8-2026-12-06.md).
    """
    traced = torch.jit.trace(layer, examples, check_trace=False)
    del layer
    archive = io.BytesIO()
    torch.jit.save(traced, archive)
    del traced
    gc.collect(1)  # tracing leaves the layer in a reference cycle: only a collection frees it (young: cheap)
    archive.seek(0)
    loaded = torch.jit.load(archive)
    del archive
    return torch.jit.freeze(loaded)


class GraphConv:
    """One FusedConv layer compiled by oneDNN Graph for `input_size` (channels-last input)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, padding: list[int], stride: list[int],
                 dilation: list[int], groups: int, activation: str, alpha: float, beta: float,
                 residual_after_activation: bool, input_size: list[int], with_residual: bool):
        layers = [_Layer(w, b, padding, stride, dilation, groups, activation, alpha, beta,
                         residual_after_activation).eval()]
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(input_size, generator=generator).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            shape = layers[0](x).shape
            examples = (x, torch.randn(shape, generator=generator).contiguous(memory_format=torch.channels_last)) \
                if with_residual else (x,)
            # the layer handed over: its channels-last weight goes once the archive holds it
            module = _frozen_private_copy(layers.pop(), examples)
            was_enabled = torch.jit.onednn_fusion_enabled()
            torch.jit.enable_onednn_fusion(True)
            try:
                for _ in range(_WARMUP_RUNS):
                    module(*examples)
            finally:
                torch.jit.enable_onednn_fusion(was_enabled)
        self.module = module
        self.with_residual = with_residual

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)  # the layout the plan was compiled for
        if self.with_residual:
            return self.module(x, residual.contiguous(memory_format=torch.channels_last))
        return self.module(x)
