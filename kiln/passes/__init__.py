"""Graph passes on onnx_ir models; `optimize` runs them in order (pipeline.py)."""

from kiln.passes._rewrite import PassReport
from kiln.passes.pipeline import PassOptions, optimize, why_not

__all__ = ["PassOptions", "PassReport", "optimize", "why_not"]
