"""ONNX op semantics on torch tensors, one module per op family.

Importing this package registers every implementation (see registry.py for the contract).
The implementations are device-agnostic torch code: they run on CPU tensors, and serve as
the fallback for any layer on CUDA that no specialised kernel covers.
"""

from kiln.ops import (  # noqa: F401  (imported for their registrations)
    activation,
    cast,
    contrib,
    contrib_microsoft,
    control_flow,
    elementwise,
    fused,
    generators,
    indexing,
    matmul,
    ml,
    nn,
    normalization,
    object_detection,
    quantization,
    quantized,
    reduction,
    relayout,
    resize,
    rnn,
    sequence,
    signal,
    tensor,
    text,
    tokens,
)
