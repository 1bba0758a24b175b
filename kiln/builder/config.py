"""BuildConfig: every builder option, with the defaults a user gets from `kiln.build`."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BuildConfig:
    # 0: as is; 1: folding/cleanups; 2: + BN folding, fusions; 3-5: wider tactic search and fusion.LEVEL3_RULES
    opt_level: int = 2  # (kiln/passes/pipeline.py)
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | tf32 | fp16 | bf16 | int8 | fp8 | best
    shapes: dict[str, list[int]] = field(default_factory=dict)  # the shapes tactics are tuned at (a profile's opt)
    # optimization profiles: [{input: (min, opt, max) | "1x1,8x128,32x512"}]; [] = kiln's default for
    # symbolic dims (kiln/builder/profiles.py)
    profiles: list[dict[str, Any]] = field(default_factory=list)
    # symbolic dims where zero padding is exact, besides batch and a masked sequence (runtime/buckets.py)
    pad_dims: list[str] = field(default_factory=list)
    # layer name -> "fp32" (pinned float) or, in an int8/fp8 build, "weight_only" (its weights quantized, input float),
    # or in an int8 CPU build "w8a16" (int8 weights, the input at 16 bits: kiln/tactics/cpu/w8a16.py)
    layer_precision: dict[str, str] = field(default_factory=dict)
    cuda_graphs: bool = True  # capture the whole engine per input shape on CUDA
    timing_cache: str | None = None  # JSON file of tactic timings, reused by later builds (kiln/tactics)
    tactics: list[str] = field(default_factory=list)  # tactic names (or prefixes: "cpu.conv") allowed; []: all
    tuning_runs: int = 10  # timed rounds per layer in the tactic search (median)
    # on the CPU, GEMM and conv tactics close to each other alone timed again in the network
    # (kiln/builder/in_context.py)
    in_context: bool = True
    # processes compiling a CUDA build's Triton kernels while the search runs (kiln/builder/precompile.py);
    # None: the cores less one; 0: none (each kernel compiles on its first launch, on the building thread)
    compile_workers: int | None = None
    # post-training quantization (precision int8 / fp8): calibration data (a folder of .npy/.npz or of
    # images, or an iterable of {input: array}), the calibrator, a cache of the measured ranges, how
    # images are preprocessed, and "auto" (quantize the layers an int8/fp8 kernel of the device runs;
    # the others stay float, said in the header) or "emulate" (quantize every Conv/Gemm/MatMul and run
    # it as its kernel would compute, in float: accuracy studies on any machine)
    calibration: Any = None
    calibrator: str = "entropy"  # minmax | percentile | entropy | mse (kiln/quant/calibrators.py)
    calibration_cache: str | None = None
    calibration_preprocessing: str = "imagenet"
    quantization: str = "auto"
    # the largest output error (relative to the output's scale, on the first calibration batches) an
    # emulated int8/fp8 engine may have: the most sensitive layers stay float until it is met
    accuracy_target: float | None = None
    # what the target bounds (kiln/builder/sensitivity.py): "error", the largest output error relative to the
    # output's scale; "top1" (classifiers), the share of calibration inputs whose top-1 class stays fp32's (0.97)
    accuracy_metric: str = "error"
    # before the target keeps a layer float, the search tries it weight-only: its weights quantized, its input
    # float (kiln/builder/sensitivity.py; on the CPU the fp32 kernel on int8-grid weights, so such a layer costs a
    # float layer's time); False: float layers only, as before
    accuracy_weight_only: bool = True
    # "top1": the search aims at accuracy_target + this (at most 1): its expected agreement on the calibration inputs
    # overestimates new inputs' (MobileNetV2: 0.971 expected, 96.4% of 202 held out; 0.980 -> 97.1%)
    accuracy_margin: float = 0.01
    # "top1" on an int8 CPU build with W8A16 kernels: layers moved up from int8 by accuracy gained per millisecond
    # (each layer's kernels timed in int8, W8A16 and fp32; kiln/builder/layer_cost.py); False: the fewest layers
    accuracy_by_cost: bool = True
    # int8 CPU builds: layers (or runs of layers) whose int8 form, its quantize steps included, is not measured faster
    # than fp32 in the engines on this machine stay fp32, and the engine is checked against the fp32 one
    # (kiln/builder/int8_speed.py). "auto": with an accuracy target on a CPU without int8 dot products (VNNI/AMX);
    # "on": every int8 CPU build; "off": the int8 kernels wherever the tuner timed them faster alone
    speed_check: str = "auto"
    # the per-layer times that check uses ({"int8": {layer: ms}, "fp32": {layer: ms}, "quantize_ms_per_element": r,
    # "quantizes_own_input": [...]}, int8_speed.measure's): given, no engine is measured (tests; a rebuild)
    layer_times: dict[str, Any] | None = None
    # the inputs of depthwise convolutions quantized with one scale per channel, folded into the layer's
    # per-channel weight scales (kiln/quant/qdq.py): MobileNet-style networks' largest int8 error otherwise
    per_channel_depthwise: bool = True
    # bias correction: each quantized layer's bias absorbs the mean shift its weights' rounding causes,
    # from the per-channel means of its input on the calibration data (kiln/quant/qdq.py)
    bias_correction: bool = True
    # GPTQ (kiln/quant/gptq.py): int8 weight integers rounded column by column against each layer's input second
    # moments on the calibration data, each rounding error spread over the columns not yet rounded; scales unchanged
    gptq: bool = False
    # SmoothQuant's migration strength alpha in [0, 1] (None: off): the inputs of MatMul/Gemm layers fed
    # by a LayerNorm or a MatMul/Gemm are smoothed per channel before calibration (kiln/quant/smoothquant.py)
    smoothquant: float | None = None
    # cross-layer equalization's strength alpha in (0, 1] (None: off): every Conv -> Relu/ReLU6 -> Conv pair's
    # narrow channels are grown towards the widest before calibration, the float model unchanged
    # (kiln/quant/equalize.py)
    equalize: float | None = None
    # weights that a refit can replace by any others (kiln refit): none stored once for being equal to
    # another, so an engine built from a freshly initialised model takes trained weights (TensorRT's REFIT)
    refittable: bool = False
    # padding-free encoder (kiln/passes/remove_padding.py): the layers after the padding mask's attention run on
    # the real tokens only; outputs at padding positions are zeros (not what the model computes there)
    remove_padding: bool = False
    verbose: bool = False
    verify: bool = False  # run the IR verifier between passes (tests set KILN_VERIFY=1)

    def to_json(self) -> dict:
        calibration = self.calibration
        self.calibration = None  # an iterable of batches: neither copied nor stored
        try:
            doc = asdict(self)
        finally:
            self.calibration = calibration
        if calibration is not None:
            doc["calibration"] = str(calibration) if isinstance(calibration, (str, os.PathLike)) else \
                f"<{type(calibration).__name__}>"
        return doc

    @classmethod
    def from_kwargs(cls, **kwargs) -> BuildConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown build option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
