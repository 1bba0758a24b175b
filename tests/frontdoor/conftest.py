import pytest


@pytest.fixture(autouse=True)
def engine_cache(tmp_path, monkeypatch):
    """Each test its own engine cache (kiln.InferenceSession caches engines under $KILN_CACHE/engines)."""
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "engines"
