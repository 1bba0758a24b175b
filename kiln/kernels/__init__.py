"""Kernels kiln launches: `cpu/` (torch CPU through oneDNN/MKL) and `cuda/` (torch CUDA libraries
and kiln's own Triton kernels). Tactics (kiln/tactics) wrap these; nothing here imports above it."""
