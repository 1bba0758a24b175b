"""onnxruntime's Python API over kiln engines: switching an application is one import.

    import kiln.compat as onnxruntime
    session = onnxruntime.InferenceSession("model.onnx", providers=onnxruntime.get_available_providers())

InferenceSession, SessionOptions, RunOptions, GraphOptimizationLevel, ExecutionMode, OrtValue,
IOBinding, NodeArg, ModelMetadata and get_available_providers()/get_device() behave as onnxruntime's
do where kiln can honour them; what it cannot is named in an UnhonouredOptionWarning
(docs/frontdoors.md).
"""

from __future__ import annotations

import torch

from kiln.compat.iobinding import IOBinding, OrtValue
from kiln.compat.nodes import ModelMetadata, NodeArg
from kiln.compat.options import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    RunOptions,
    SessionOptions,
    UnhonouredOptionWarning,
    available_providers,
)
from kiln.compat.session import EngineRebuildWarning, InferenceSession, InvalidArgument


def get_available_providers() -> list[str]:
    return available_providers()


def get_all_providers() -> list[str]:
    return available_providers()


def get_device() -> str:
    return "GPU" if torch.cuda.is_available() else "CPU"


__all__ = [
    "EngineRebuildWarning", "ExecutionMode", "ExecutionOrder", "GraphOptimizationLevel", "IOBinding",
    "InferenceSession", "InvalidArgument", "ModelMetadata", "NodeArg", "OrtValue", "RunOptions", "SessionOptions",
    "UnhonouredOptionWarning", "get_all_providers", "get_available_providers", "get_device",
]
