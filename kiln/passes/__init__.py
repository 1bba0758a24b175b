"""Graph passes on onnx_ir models; `optimize` runs them in order (pipeline.py)."""

from kiln.passes.pipeline import optimize

__all__ = ["optimize"]
