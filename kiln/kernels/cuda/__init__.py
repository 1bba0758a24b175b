"""CUDA kernels. `kiln.kernels.cuda.triton` holds kiln's Triton kernels (generated elementwise
chains, LayerNorm / RMSNorm / Softmax, GEMM epilogues and a GEMM template); importing it needs
the `triton` package, so this package does not import it eagerly."""
