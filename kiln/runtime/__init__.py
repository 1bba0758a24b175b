"""The lean runtime: load an engine file and run it. Imports no ONNX, passes or builder."""

from kiln.runtime.engine import Engine, ExecutionContext, load

__all__ = ["Engine", "ExecutionContext", "load"]
