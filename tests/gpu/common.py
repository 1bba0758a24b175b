"""What the GPU test files share: CUDA-graph capture of a launch, timing for their printed tables (printed, never
asserted), and a GEMM-heavy model whose answers show two contexts' graphs corrupting each other (deep_mlp)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

DEEP_WIDTH, DEEP_HIDDEN, DEEP_BLOCKS = 256, 8192, 4
# deep_mlp's build: its GEMMs by cuBLAS (the one tactic allowed, or each layer's default, torch's matmul), whose
# workspace is what is shared; a Triton GEMM winning the tactic search would keep the test from seeing the race
CUBLAS_ONLY = ["cuda.gemm.cublas_addmm_act"]


def deep_mlp(seed: int = 14) -> tuple[onnx.ModelProto, list[tuple[np.ndarray, np.ndarray]]]:
    """x FP32 [batch, 256] -> y FP32 [batch, 256] through DEEP_BLOCKS blocks h = Relu(h @ A) @ B (A: 256 x 8192,
    B: 8192 x 256), and its weights. The B GEMMs are the kind cuBLAS splits along K for a few rows (K = 8192,
    M x N = rows x 256), keeping partial sums in its workspace: what two contexts' graphs sharing one workspace corrupt
    when they replay at once (issue 14, kiln/runtime/capture_streams.py). Weights scaled so |y| stays O(1)."""
    rng = np.random.default_rng(seed)
    weights, nodes, initializers = [], [], []
    h = "x"
    for k in range(DEEP_BLOCKS):
        a = (rng.standard_normal((DEEP_WIDTH, DEEP_HIDDEN)) / np.sqrt(DEEP_WIDTH)).astype(np.float32)
        b = (rng.standard_normal((DEEP_HIDDEN, DEEP_WIDTH)) * np.sqrt(2.0 / DEEP_HIDDEN)).astype(np.float32)
        weights.append((a, b))
        initializers += [numpy_helper.from_array(a, f"A{k}"), numpy_helper.from_array(b, f"B{k}")]
        out = "y" if k == DEEP_BLOCKS - 1 else f"h{k + 1}"
        nodes += [helper.make_node("MatMul", [h, f"A{k}"], [f"u{k}"]), helper.make_node("Relu", [f"u{k}"], [f"r{k}"]),
                  helper.make_node("MatMul", [f"r{k}", f"B{k}"], [out])]
        h = out
    graph = helper.make_graph(nodes, "deep_mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DEEP_WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", DEEP_WIDTH])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), weights


def deep_reference(weights: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """deep_mlp's y in float64 (the oracle)."""
    h = x.astype(np.float64)
    for a, b in weights:
        h = np.maximum(h @ a, 0.0) @ b
    return h


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn captured into a CUDA graph (capture fails on any host synchronisation inside it), after one
    warm-up call on a side stream (Triton compiles, cuBLAS/cuDNN pick their workspaces outside the
    capture); returns the graph and the output it writes on each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_replay(fn: Callable[[], Any]) -> Any:
    """fn captured into a CUDA graph and replayed once; its output."""
    graph, out = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    return out


def median_ms(fn: Callable[[], Any], warmup: int = 10, iters: int = 50) -> float:
    """Median of CUDA-event timings of fn(), each call timed on its own."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
