"""The model repository on disk: Triton's layout, kiln's engines.

    <repository>/<model>/config.pbtxt | config.json     optional (kiln/serve/config.py)
    <repository>/<model>/<version>/model.kiln           an engine, loaded as is
    <repository>/<model>/<version>/model.onnx           built on first load; the engine is cached
                                                        beside it as model.kiln and reused while
                                                        it is newer than the ONNX and fits the config

Versions are the numeric sub-folders; the config's version_policy picks which are served (the
latest one by default). `kiln serve --model file.onnx|file.kiln` is a repository of one model,
named after the file, version 1. Loading is blocking work (reading, building): the server runs
it in a thread.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import kiln
from kiln import Engine
from kiln.errors import KilnError
from kiln.serve.config import ModelConfig, check, complete, read_model_config
from kiln.serve.errors import ModelLoadError, NotFound

ENGINE_FILE, ONNX_FILE = "model.kiln", "model.onnx"


@dataclass
class LoadedVersion:
    name: str
    version: str
    engine: Engine
    config: ModelConfig
    path: Path


class ModelRepository:
    def __init__(self, root: str | os.PathLike | None = None, files: dict[str, Path] | None = None):
        """A repository folder, or `files`: model name -> one .onnx/.kiln file served as version 1."""
        self.root = Path(root) if root is not None else None
        self.files = {name: Path(p) for name, p in (files or {}).items()}
        if self.root is not None and not self.root.is_dir():
            raise KilnError(f"model repository {self.root} is not a folder")
        for path in self.files.values():
            if not path.is_file():
                raise KilnError(f"model file {path} does not exist")
            if path.suffix not in (".onnx", ".kiln"):
                raise KilnError(f"model file {path}: kiln serves .onnx and .kiln files")

    @classmethod
    def single(cls, path: str | os.PathLike, name: str | None = None) -> ModelRepository:
        path = Path(path)
        return cls(files={name or path.stem: path})

    def names(self) -> list[str]:
        found = set(self.files)
        if self.root is not None:
            found |= {p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")}
        return sorted(found)

    def load(self, name: str, override: ModelConfig | None = None) -> list[LoadedVersion]:
        """Every served version of a model: engine loaded (or built) and config completed and checked."""
        if name in self.files:
            path = self.files[name]
            config = override or ModelConfig(name=name)
            config.name = name
            return [self._load_version(name, "1", path.parent, config, file=path)]
        folder = self.root / name if self.root is not None else None
        if folder is None or not folder.is_dir():
            raise NotFound(f"model {name!r} is not in the repository ({self.root or 'no folder'})")
        config = override or read_model_config(folder) or ModelConfig(name=name)
        config.name = name
        versions = [int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0]
        chosen = config.version_policy.select(versions)
        if not chosen:
            raise ModelLoadError(f"model {name!r}: no version folder to serve in {folder} (found {sorted(versions)}; "
                                 f"version policy {config.version_policy.kind})")
        loaded = []
        for v in chosen:
            # every version completes its own copy: versions may differ in their bindings
            copy = ModelConfig(**{**config.__dict__, "inputs": list(config.inputs), "outputs": list(config.outputs)})
            loaded.append(self._load_version(name, str(v), folder / str(v), copy))
        return loaded

    def _load_version(self, name: str, version: str, folder: Path, config: ModelConfig,
                      file: Path | None = None) -> LoadedVersion:
        if file is not None:
            engine_path = file if file.suffix == ".kiln" else file.with_suffix(".kiln")
            onnx_path = file if file.suffix == ".onnx" else None
        else:
            engine_path, onnx_path = folder / ENGINE_FILE, folder / ONNX_FILE
            if not engine_path.exists() and not onnx_path.exists():
                raise ModelLoadError(f"model {name!r} version {version}: neither {ENGINE_FILE} nor {ONNX_FILE} in {folder}")
            if not onnx_path.exists():
                onnx_path = None
        given = _copy(config)
        try:
            engine = self._cached_engine(engine_path, onnx_path)
            if engine is not None:
                try:
                    return LoadedVersion(name, version, engine, complete(_copy(given), engine, name), engine_path)
                except ModelLoadError:
                    if onnx_path is None:
                        raise
                    # the cached engine was built for another config (a smaller max_batch_size): rebuild
            engine = build_engine(onnx_path, given, engine_path)
            return LoadedVersion(name, version, engine, complete(given, engine, name), engine_path)
        except ModelLoadError:
            raise
        except KilnError as e:
            raise ModelLoadError(f"model {name!r} version {version}: {e}") from e

    @staticmethod
    def _cached_engine(engine_path: Path, onnx_path: Path | None) -> Engine | None:
        if not engine_path.exists():
            return None
        if onnx_path is not None and engine_path.stat().st_mtime < onnx_path.stat().st_mtime:
            return None  # the ONNX changed since the engine was built
        try:
            return kiln.load(engine_path)
        except KilnError:
            if onnx_path is None:
                raise
            return None  # built by another kiln version, for another device...: rebuild


def _copy(config: ModelConfig) -> ModelConfig:
    return ModelConfig(**{**config.__dict__, "inputs": list(config.inputs), "outputs": list(config.outputs),
                          "parameters": dict(config.parameters)})


def build_options(config: ModelConfig, onnx_path: Path) -> dict:
    """kiln.build options from a config: its parameters, its device, and a batch profile up to
    max_batch_size when the batch is the model's only symbolic dim (else kiln's default profile)."""
    options: dict = {"device": "cuda" if config.instance_kind == "KIND_GPU" else "cpu"}
    p = config.parameters
    if "precision" in p:
        options["precision"] = p["precision"]
    if "opt_level" in p:
        try:
            options["opt_level"] = int(p["opt_level"])
        except ValueError:
            raise ModelLoadError(f"model {config.name!r}: parameter opt_level {p['opt_level']!r} is not an integer") from None
    if "pad_dims" in p:
        options["pad_dims"] = [d.strip() for d in p["pad_dims"].split(",") if d.strip()]
    if "profile" in p:
        options["profiles"] = [_profile_from_text(p["profile"], config.name)]
    elif config.max_batch_size > 0:
        shapes = _onnx_input_shapes(onnx_path)
        if shapes and all(isinstance(s[0], str) and all(isinstance(d, int) for d in s[1:]) for s in shapes.values()):
            opt = max(config.dynamic_batching.preferred_batch_size, default=1) if config.dynamic_batching else 1
            options["profiles"] = [{n: ([1, *s[1:]], [opt, *s[1:]], [config.max_batch_size, *s[1:]])
                                    for n, s in shapes.items()}]
    return options


def _profile_from_text(text: str, name: str) -> dict:
    """kiln build --profile syntax: NAME:MIN,OPT,MAX;NAME:..."""
    profile = {}
    for part in text.split(";"):
        if ":" not in part:
            raise ModelLoadError(f"model {name!r}: parameter profile {text!r}: expected NAME:MIN,OPT,MAX[;...]")
        key, value = part.split(":", 1)
        profile[key.strip()] = value.strip()
    return profile


def _onnx_input_shapes(path: Path) -> dict[str, list[int | str]]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    shapes = {}
    for value in model.graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
    return shapes


def build_engine(onnx_path: Path | None, config: ModelConfig, engine_path: Path) -> Engine:
    if onnx_path is None:
        raise ModelLoadError(f"model {config.name!r}: {engine_path} does not fit its config and there is no "
                             f"{ONNX_FILE} to rebuild it from")
    engine = kiln.build(str(onnx_path), **build_options(config, onnx_path))
    # written beside the ONNX through a temporary file: a concurrent reader never sees half an engine
    fd, tmp = tempfile.mkstemp(suffix=".kiln.tmp", dir=engine_path.parent)
    os.close(fd)
    try:
        engine.save(tmp)
        os.replace(tmp, engine_path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)  # a read-only repository: serve the engine without caching it
    return engine


__all__ = ["LoadedVersion", "ModelRepository", "build_engine", "build_options", "check"]
