"""Fusion rules, one module each (pattern / check with a reason / rewrite), in the order they run: recognisers of decomposed ops first (so the
layer fusions see a Gelu where the exporter wrote Erf arithmetic), then layer epilogues,
then attention, then the elementwise chains that are left."""

from __future__ import annotations

from kiln.passes.fusion.conv import fuse_conv
from kiln.passes.fusion.gemm import fuse_gemm

RULES = [
    ("fuse_conv", fuse_conv),
    ("fuse_gemm", fuse_gemm),
]
