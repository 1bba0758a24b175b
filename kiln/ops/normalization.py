"""normalization ops."""

from __future__ import annotations

from kiln.ops.registry import register  # noqa: F401
