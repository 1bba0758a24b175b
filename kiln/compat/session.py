"""kiln.InferenceSession: onnxruntime's InferenceSession, running kiln engines.

    import kiln.compat as onnxruntime            # or: from kiln import InferenceSession
    session = onnxruntime.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    logits, = session.run(["logits"], {"input_ids": ids})

The model is read and checked when the session is made (a model kiln cannot run fails there, every
unsupported node named); the engine is built at the first run, or loaded from the engine cache
(kiln/compat/cache.py), and a line on stderr says which. A run whose shapes lie outside the engine's
optimization profile rebuilds it once with the profile widened to hold them, with a warning (the
TensorRT provider's behaviour, said out loud). Errors follow onnxruntime's: a missing input is a
ValueError, a wrong name, type, rank or dimension an InvalidArgument with onnxruntime's wording.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import torch

from kiln.builder.build import build as kiln_build
from kiln.builder.config import BuildConfig
from kiln.compat import cache
from kiln.compat import options as session_options
from kiln.compat.iobinding import IOBinding, OrtValue
from kiln.compat.nodes import ModelMetadata, NodeArg, Signature
from kiln.errors import BindingError, EngineRebuildWarning, ModelError
from kiln.frontend import onnx as onnx_frontend
from kiln.ir import dtypes
from kiln.runtime.engine import Engine, ExecutionContext
from kiln.runtime.engine import load as kiln_load

FIX = " Please fix either the inputs/outputs or the model."


class InvalidArgument(BindingError):
    """onnxruntime's INVALID_ARGUMENT: a wrong input or output name, element type, rank or dimension."""


def _read_model(source: str | bytes | Any) -> tuple[onnx.ModelProto, bytes, Path | None]:
    if isinstance(source, (bytes, bytearray)):
        data, path = bytes(source), None
    elif isinstance(source, onnx.ModelProto):
        data, path = source.SerializeToString(), None
    else:
        path = Path(source)
        if not path.is_file():
            raise ModelError(f"{path}: no such model file")
        data = path.read_bytes()
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as e:  # noqa: BLE001  protobuf raises several types on garbage
        raise ModelError(f"{path or 'the given bytes'}: not a readable ONNX model ({e})") from None
    return model, data, path


def _external_files(model: onnx.ModelProto, base: Path | None) -> list[Path]:
    if base is None:
        return []
    files = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = {e.key: e.value for e in t.external_data}.get("location", "")
            if (base / location).is_file():
                files.add(base / location)
    return sorted(files)


class InferenceSession:
    """onnxruntime.InferenceSession's interface over a kiln engine."""

    def __init__(self, path_or_bytes: str | bytes | Any, sess_options: Any = None, providers: list | None = None,
                 provider_options: list[dict] | None = None, **kwargs: Any):
        self._model, data, self._path = _read_model(path_or_bytes)
        self._signature = Signature.of(self._model)
        self._sess_options = sess_options
        self._lock = threading.Lock()
        self._local = threading.local()
        self._engine: Engine | None = None
        self._workers: ThreadPoolExecutor | None = None  # run_async's, made at its first call
        base = self._path.parent if self._path is not None else None
        self._digest = cache.model_digest(data, _external_files(self._model, base))
        self._configure(providers, provider_options, kwargs)
        # Import now: a model kiln cannot run fails here, as onnxruntime's would, every node named.
        self._imported: ir.Model | None = onnx_frontend.load(self._path if self._path is not None else self._model)

    def _configure(self, providers: list | None, provider_options: list[dict] | None, kwargs: dict) -> None:
        self._settings = session_options.read(self._sess_options, providers, provider_options,
                                              torch.cuda.is_available())
        for key, value in kwargs.items():
            if value not in (None, [], {}, ()):
                self._settings.unhonoured.append(f"InferenceSession({key}=...)")
        session_options.warn_unhonoured(self._settings, stacklevel=4)
        if self._settings.threads > 0:
            torch.set_num_threads(self._settings.threads)

    # ---- what onnxruntime reports ----------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return list(self._signature.inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._signature.outputs)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return list(self._signature.initializers)

    def get_modelmeta(self) -> ModelMetadata:
        return ModelMetadata.of(self._model)

    def get_providers(self) -> list[str]:
        return list(self._settings.providers)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        return {name: dict(self._settings.provider_options.get(name, {})) for name in self._settings.providers}

    def get_session_options(self) -> Any:
        return self._sess_options if self._sess_options is not None else session_options.SessionOptions()

    def set_providers(self, providers: list | None = None, provider_options: list[dict] | None = None) -> None:
        """Choose the providers again: the next run loads or builds the engine for them."""
        self._configure(providers, provider_options, {})
        with self._lock:
            self._engine = None

    def end_profiling(self) -> str:
        return ""  # enable_profiling is not honoured (warned at creation): no profile file was written

    @property
    def engine(self) -> Engine:
        """kiln's addition: the engine this session runs (built or loaded on first use)."""
        return self._engine_for(None)

    # ---- running ---------------------------------------------------------------------------------

    def run(self, output_names: list[str] | None, input_feed: dict[str, Any], run_options: Any = None) -> list[Any]:
        names = self._output_names(output_names)
        feeds = self._checked_feeds(input_feed)
        results = self._context(feeds).run(feeds)
        return [results[name] for name in names]

    def run_async(self, output_names: list[str] | None, input_feed: dict[str, Any],
                  callback: Callable[[list[Any], Any, str], None], user_data: Any, run_options: Any = None) -> None:
        """onnxruntime's run_async: returns at once; a worker thread of the session runs the model, then
        calls callback(outputs, user_data, err) with the outputs and err "" on success, [] and the error's
        message on failure. Missing inputs raise here, as onnxruntime checks them before it hands off."""
        self._missing(input_feed)
        feed = dict(input_feed)  # the caller may refill its dict for the next run
        with self._lock:
            if self._workers is None:
                self._workers = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                                   thread_name_prefix="kiln-session")
            workers = self._workers
        workers.submit(self._run_then_call, output_names, feed, callback, user_data)

    def _run_then_call(self, output_names: list[str] | None, feed: dict[str, Any],
                       callback: Callable[[list[Any], Any, str], None], user_data: Any) -> None:
        try:
            outputs, err = self.run(output_names, feed), ""
        except Exception as e:  # noqa: BLE001  onnxruntime hands every failure of the run to the callback
            outputs, err = [], str(e)
        try:
            callback(outputs, user_data, err)
        except Exception:  # noqa: BLE001  reported as an uncaught exception of this thread; the pool lives on
            threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), threading.current_thread())))

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: Any = None) -> None:
        self._output_names(list(iobinding.outputs))
        feeds = self._checked_feeds({name: value.as_tensor() for name, value in iobinding.inputs.items()})
        iobinding.store(self._context(feeds).run(feeds))

    def _output_names(self, output_names: list[str] | None) -> list[str]:
        known = [o.name for o in self._signature.outputs]
        if not output_names:
            return known
        for name in output_names:
            if name not in known:
                raise InvalidArgument(f"Invalid output name:{name} (the model's outputs are {known})")
        return list(output_names)

    def _missing(self, input_feed: dict[str, Any]) -> None:
        missing = [i.name for i in self._signature.inputs if i.name not in input_feed]
        if missing:
            raise ValueError(f"Required inputs ({missing}) are missing from input feed ({list(input_feed)}).")

    def _checked_feeds(self, input_feed: dict[str, Any]) -> dict[str, Any]:
        """The feed as onnxruntime checks it: names, element types, ranks, fixed dimensions."""
        expected = {i.name: i for i in self._signature.inputs}
        self._missing(input_feed)
        overridable = {i.name for i in self._signature.initializers}
        feeds = {}
        for name, value in input_feed.items():
            if name in overridable:
                raise InvalidArgument(f"input {name!r} is an initializer of the model; kiln folds initializers into "
                                      "the engine, so it cannot be overridden at run time (rebuild with the new value, "
                                      "or refit the engine: docs/frontdoors.md)")
            if name not in expected:
                raise InvalidArgument(f"Invalid input name: {name} (the model's inputs are {list(expected)})")
            feeds[name] = self._checked_value(expected[name], value)
        return feeds

    @staticmethod
    def _checked_value(arg: NodeArg, value: Any) -> Any:
        if isinstance(value, OrtValue):
            value = value.as_tensor()
        want = arg.type[len("tensor("):-1] if arg.type.startswith("tensor(") else None
        if not isinstance(value, (np.ndarray, torch.Tensor)):
            dt = dtypes.BY_NAME.get(want) if want else None
            value = np.asarray(value, dtype=dt.numpy if dt is not None else None)
        if want is None:
            return value
        given = (dtypes.from_torch(value.dtype) if isinstance(value, torch.Tensor) else dtypes.from_numpy(value.dtype)).name
        if given != want:
            raise InvalidArgument(f"Unexpected input data type. Actual: (tensor({given})) , expected: ({arg.type})")
        shape = list(value.shape)
        if len(shape) != len(arg.shape) and not (arg.shape == [] and not shape):
            raise InvalidArgument(f"Invalid rank for input: {arg.name} Got: {len(shape)} Expected: {len(arg.shape)}"
                                  + FIX)
        wrong = [f" index: {i} Got: {got} Expected: {want_d}" for i, (got, want_d) in enumerate(zip(shape, arg.shape))
                 if isinstance(want_d, int) and got != want_d]
        if wrong:
            raise InvalidArgument(f"Got invalid dimensions for input: {arg.name} for the following indices\n"
                                  + "\n".join(wrong) + "\n" + FIX)
        return value

    def _context(self, feeds: dict[str, Any]) -> ExecutionContext:
        """This thread's execution context on an engine whose profiles hold the feeds' shapes."""
        shapes = {name: tuple(v.shape) for name, v in feeds.items() if isinstance(v, (np.ndarray, torch.Tensor))}
        engine = self._engine_for(shapes)
        held = getattr(self._local, "held", None)
        if held is None or held[0] is not engine:  # contexts are per thread: a session serves many
            held = (engine, engine.create_execution_context())
            self._local.held = held
        return held[1]

    # ---- building --------------------------------------------------------------------------------

    def _engine_for(self, shapes: dict[str, tuple[int, ...]] | None) -> Engine:
        with self._lock:
            if self._engine is None:
                self._engine = self._load_or_build(self._settings.build, "first run")
            engine = self._engine
            if shapes and engine.profiles and all(p.outside(shapes) is not None for p in engine.profiles):
                wider = _widened(engine, shapes)
                warnings.warn(f"kiln.InferenceSession: input shapes {({k: list(v) for k, v in shapes.items()})} lie "
                              f"outside the engine's optimization profile ({engine.profiles[0].describe()}): "
                              "rebuilding it with the profile widened to hold them; give the shapes you will run at "
                              "up front (TensorrtExecutionProvider's trt_profile_*_shapes, or KilnExecutionProvider's "
                              "profiles) to build once", EngineRebuildWarning, stacklevel=4)
                self._engine = engine = self._load_or_build({**self._settings.build, "profiles": [wider]},
                                                            "shapes outside its profile")
            return engine

    def _say(self, message: str) -> None:
        if not self._settings.quiet:
            print(f"kiln: {message}", file=sys.stderr, flush=True)

    def _load_or_build(self, build_options: dict, why: str) -> Engine:
        label = self._path.name if self._path is not None else (self._model.graph.name or "the model")
        device = build_options.get("device", "cpu")
        if not self._settings.cache:
            return self._build(build_options, label, why, None)
        key = cache.engine_key(self._digest, build_options, device)
        folder = Path(self._settings.cache_dir) if self._settings.cache_dir else cache.default_dir()
        with cache.locked(folder, key) as path:
            if path.is_file():
                engine = kiln_load(path)
                self._say(f"loaded the cached engine for {label} ({device}) from {path}")
                return engine
            return self._build(build_options, label, why, path)

    def _build(self, build_options: dict, label: str, why: str, path: Path | None) -> Engine:
        device = build_options.get("device", "cpu")
        self._say(f"building an engine for {label} on {device} ({why}); this happens once"
                  + (f", then it is cached at {path}" if path is not None else " per session (cache off)"))
        start = time.perf_counter()
        model = self._imported
        self._imported = None  # the builder consumes the imported graph; a rebuild imports again
        if model is None:
            model = onnx_frontend.load(self._path if self._path is not None else self._model)
        engine = kiln_build(model, BuildConfig.from_kwargs(**build_options))
        if self._path is not None:  # where refit and `kiln bench --against onnxruntime` find the model
            engine.plan.header["source"] = {"path": str(self._path.resolve()), "name": self._path.name}
        if path is not None:
            engine.save(path)
        self._say(f"built the engine for {label} in {time.perf_counter() - start:.1f} s")
        return engine


def _widened(engine: Engine, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """The first profile's ranges widened to hold `shapes` (opt unchanged)."""
    profile = engine.profiles[0]
    ranges = {}
    for name, r in profile.inputs.items():
        shape = shapes.get(name)
        if shape is None or len(shape) != len(r.min):
            ranges[name] = (r.min, r.opt, r.max)
            continue
        ranges[name] = ([min(a, s) for a, s in zip(r.min, shape)], r.opt, [max(a, s) for a, s in zip(r.max, shape)])
    return ranges
