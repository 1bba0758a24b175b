"""An exported encoder whose engine keeps the exporter's mask machinery, for the tests of shape arithmetic
(tests/unit/test_shape_function.py, test_shape_plans.py)."""

from __future__ import annotations

import kiln
from kiln import zoo
from kiln.passes import fusion


def bert_tiny_with_mask_machinery(profile: str):
    """bert_tiny exported with symbolic batch and sequence, built for `profile` (input_ids' min,opt,max) without the
    attention_key_mask rule, which would reduce its [B,1,S,S] mask to the padding mask and leave the Range, Concat
    and index grids these tests compute nothing to do. Returns (exported, engine)."""
    exported = zoo.export("bert_tiny", dynamic=True)
    rules = fusion.RULES
    fusion.RULES = [(name, rule) for name, rule in rules if name != "attention_key_mask"]
    try:
        return exported, kiln.build(str(exported.path), profiles=[{"input_ids": profile}])
    finally:
        fusion.RULES = rules
