"""CPU kernels on torch's oneDNN (mkldnn) and MKL entry points, as Inductor's CPU backend calls them.

conv.py: convolution with oneDNN-blocked weights packed once and the bias/activation/residual
epilogue fused as oneDNN post-ops. gemm.py: linear layers on packed weights (oneDNN, MKL).
Each kernel is a pair: `pack_*` (once, at engine load) and a launch on the packed weight.
"""

from __future__ import annotations

import torch


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def mkl_available() -> bool:
    return bool(torch._C.has_mkl) and hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear")
