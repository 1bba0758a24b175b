"""Triton kernels of the LLM runtime (GPU path; tested on the CPU under TRITON_INTERPRET=1)."""
