"""The zoo's llama_tiny built with one profile and saved, fixtures for the unit tests that need it (import `llama`,
`llama_segments`)."""

from __future__ import annotations

import contextlib

import pytest

import kiln
from kiln import zoo
from kiln.passes import fusion
from kiln.passes.fusion import rotary


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """The zoo's llama_tiny exported with symbolic batch and sequence, built with one profile and saved: (export, path).
    Its attentions fused (GQA, the packed rotary before them): the whole decoder is one native segment."""
    exported = zoo.export("llama_tiny", batch=2, seq=8, dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    path = tmp_path_factory.mktemp("llama") / "llama_tiny.kiln"
    engine.save(str(path))
    return exported, path


@contextlib.contextmanager
def attention_unfused():
    """The builder as it was before a dynamic export's GQA attention fused (fuse_attention off, and fuse_rotary not
    laying out the tables computed at run time): llama_tiny's attentions then run as ~45 torch layers (heads split,
    k/v repeated, Q·Kᵀ, softmax, ...) between five native segments."""
    rules, computed = fusion.RULES, rotary._computed_table
    fusion.RULES = [(name, rule) for name, rule in rules if name != "fuse_attention"]
    rotary._computed_table = lambda table, rank: False
    try:
        yield
    finally:
        fusion.RULES, rotary._computed_table = rules, computed


@pytest.fixture(scope="session")
def llama_segments(tmp_path_factory):
    """llama_tiny as `llama`, built with its attentions unfused (attention_unfused): the engine for the tests of what
    runs layers between native segments (view_steps.py, view_launches.py, views_ahead.py): (export, path)."""
    exported = zoo.export("llama_tiny", batch=2, seq=8, dynamic=True)
    with attention_unfused():
        engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    path = tmp_path_factory.mktemp("llama_segments") / "llama_tiny_segments.kiln"
    engine.save(str(path))
    return exported, path
