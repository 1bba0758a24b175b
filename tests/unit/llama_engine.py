"""The zoo's llama_tiny built with one profile and saved, a fixture for the unit tests that need it (import `llama`)."""

from __future__ import annotations

import pytest

import kiln
from kiln import zoo


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """The zoo's llama_tiny exported with symbolic batch and sequence, built with one profile and saved: (export, path)."""
    exported = zoo.export("llama_tiny", batch=2, seq=8, dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    path = tmp_path_factory.mktemp("llama") / "llama_tiny.kiln"
    engine.save(str(path))
    return exported, path
