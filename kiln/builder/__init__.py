"""The builder: ONNX model -> Engine (build.py, one function calling the stages in order).

    config.py        BuildConfig: every builder option
    lower.py         optimized onnx_ir graph -> ProgramSpec + weights
    precision.py     fp16/bf16 storage, per-layer fp32 pins
    autotune.py      tactic search: check every candidate against the reference, time, choose
    timing_cache.py  timings on disk, keyed by layer signature and environment

Named `builder`, not `build`: a subpackage `kiln.build` would replace the function `kiln.build`
as an attribute of the `kiln` package the moment it is imported.
"""
