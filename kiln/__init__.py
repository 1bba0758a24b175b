"""kiln: an inference optimizer and runtime for ONNX models and torch modules.

    engine = kiln.build("model.onnx")      # import, optimize, plan -> Engine
    outputs = engine.run({"input": array})  # numpy in -> numpy out; torch in -> torch out
    engine.save("model.kiln"); engine = kiln.load("model.kiln")

`kiln.load` and the runtime import no ONNX machinery (the lean runtime); `kiln.build`
imports the builder on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.openmp import choose_wait_policy

choose_wait_policy()  # before torch loads libgomp: a short spin on a busy machine (kiln/openmp.py)

from kiln.kernels.cpu.cpu_features import cap_libraries  # noqa: E402

cap_libraries()  # KILN_CPU_ISA=avx2: oneDNN, MKL and ATen capped too, before their first kernel (cpu_features.py)

from kiln import errors  # noqa: E402
from kiln.errors import (  # noqa: E402
    BindingError,
    EngineFormatError,
    EngineRebuildWarning,
    KilnError,
    ModelError,
    UnsupportedModelError,
)
from kiln.runtime import engine as _engine_module  # noqa: E402
from kiln.runtime.engine import Engine, ExecutionContext, load  # noqa: E402
from kiln.runtime.heap import static_heap  # noqa: E402
from kiln.version import __version__  # noqa: E402

if TYPE_CHECKING:
    from kiln.builder.config import BuildConfig


def build(model: Any, config: BuildConfig | None = None, *, progress=None, **options: Any) -> Engine:
    """Build an engine from an ONNX path, bytes or ModelProto; options map to BuildConfig."""
    from kiln.builder.build import build as _build
    from kiln.builder.config import BuildConfig

    if config is None:
        config = BuildConfig.from_kwargs(**options)
    elif options:
        raise TypeError("pass either a BuildConfig or keyword options, not both")
    return _build(model, config, progress=progress)


def compile(module: Any, example_inputs: Any, **options: Any) -> Any:
    """A torch.nn.Module -> a callable running it in kiln engines, with PyTorch where kiln cannot
    (kiln/torch_backend.py; docs/frontdoors.md)."""
    from kiln.torch_backend import compile as _compile

    return _compile(module, example_inputs, **options)


def _refit(engine: Engine, weights: Any, **options: Any) -> Any:
    """Engine.refit's derivation: the builder's (kiln/builder/refit.py), imported on first use."""
    from kiln.builder.refit import refit

    return refit(engine, weights, **options)


_engine_module.REFIT = _refit  # the runtime calls up through this hook, never by importing the builder


def __getattr__(name: str) -> Any:
    # onnxruntime's InferenceSession (kiln/compat): imported on first use, so `kiln.load` stays lean
    if name == "InferenceSession":
        from kiln.compat.session import InferenceSession

        return InferenceSession
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


__all__ = [
    "BindingError", "Engine", "EngineFormatError", "EngineRebuildWarning", "ExecutionContext", "InferenceSession",
    "KilnError",
    "ModelError", "UnsupportedModelError", "__version__", "build", "compile", "errors", "load", "static_heap",
]
