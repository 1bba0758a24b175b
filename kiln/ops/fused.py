"""kiln-domain fused ops that the optimizer emits (domain "kiln")."""

from __future__ import annotations

from kiln.ops.registry import register  # noqa: F401
