"""The zoo's export cache: exported once per key, reused after, keyed by what made the file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.zoo import cache


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    return tmp_path / "zoo"


def fake_exporter(calls: list):
    def export(folder):
        calls.append(folder)
        (folder / "model.onnx").write_bytes(b"not really onnx")
        return {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    return export


def test_exports_once_then_reuses(tmp_cache):
    calls: list = []
    first = cache.cached_export("toy", {"width": 4}, fake_exporter(calls))
    second = cache.cached_export("toy", {"width": 4}, fake_exporter(calls))
    assert len(calls) == 1 and first.path == second.path
    assert first.path.parent.parent == tmp_cache
    np.testing.assert_array_equal(second.inputs()["x"], np.arange(6, dtype=np.float32).reshape(2, 3))
    meta = json.loads((first.folder / "meta.json").read_text())
    assert meta["versions"]["torch"] and meta["inputs"]["x"] == {"dtype": "float32", "shape": [2, 3]}
    assert not [p for p in tmp_cache.iterdir() if p.is_dir() and p.name.startswith(".")], "staging left behind"


def test_key_changes_with_config_and_versions(tmp_cache, monkeypatch):
    base = cache.cache_key("toy", {"width": 4})
    assert cache.cache_key("toy", {"width": 8}) != base
    assert cache.cache_key("other", {"width": 4}) != base
    monkeypatch.setattr(cache, "ZOO_VERSION", cache.ZOO_VERSION + 1)
    assert cache.cache_key("toy", {"width": 4}) != base


def test_refresh_and_failed_export(tmp_cache):
    calls: list = []
    cache.cached_export("toy", {}, fake_exporter(calls))
    cache.cached_export("toy", {}, fake_exporter(calls), refresh=True)
    assert len(calls) == 2

    def broken(folder):
        raise RuntimeError("exporter crashed")
    with pytest.raises(RuntimeError, match="exporter crashed"):
        cache.cached_export("broken", {}, broken)
    assert not any(p.name.startswith(("broken", ".broken-")) and p.is_dir() for p in tmp_cache.iterdir())
