"""Triton kernel tests run on CPU tensors under Triton's interpreter (no GPU in CI).

TRITON_INTERPRET must be set before triton is first imported: @triton.jit reads it when a
kernel module is imported. Set TRITON_INTERPRET=0 to run the same tests on a GPU instead.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds a scalar argument as a 1-element array and turns it into a
    Python int with int(array), which numpy ≥ 2.4 refuses: `range(0, n, BLOCK)` over a runtime
    `n` fails. Newer Triton squeezes first (upstream fix); do the same for older ones."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if not getattr(original, "kiln_fixed", False):
        patch_lang_tensor.kiln_fixed = True
        interpreter._patch_lang_tensor = patch_lang_tensor


def _fix_interpreter_bf16_dot() -> None:
    """Triton 3.6's interpreter stores bf16 as uint16 bit patterns and its tl.dot multiplies those
    integers. Widen bf16 operands to fp32 first (exact: bf16 is the top half of an fp32)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "kiln_fixed", False):
        return

    def widen(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.kiln_fixed = True
    builder.create_dot = create_dot


def _fix_interpreter_fp8_cast() -> None:
    """The interpreter's float -> FP8 E4M3 conversion (triton.runtime.interpreter._convert_float) ORs the
    rounded-up mantissa into the exponent instead of adding the carry (1.94 becomes 1.0, not 2.0) and rounds
    ties up: convert to float8e4nv with torch's cast instead (round to nearest even, as the GPU's cvt.rn)."""
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._convert_float
    if getattr(original, "kiln_fixed", False):
        return
    sources = {tl.float32: (np.uint32, torch.float32), tl.float16: (np.uint16, torch.float16),
               tl.bfloat16: (np.uint16, torch.bfloat16)}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in sources:
            return original(input, input_dtype, output_dtype, rounding_mode)
        bits, dtype = sources[input_dtype]
        raw = np.ascontiguousarray(np.asarray(input)).view(bits).reshape(-1)
        values = torch.from_numpy(raw.copy()).view(dtype)
        return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(np.shape(input))

    convert.kiln_fixed = True
    interpreter._convert_float = convert


if os.environ["TRITON_INTERPRET"] == "1":
    _fix_interpreter_scalar_index()
    _fix_interpreter_bf16_dot()
    _fix_interpreter_fp8_cast()


def pytest_configure(config):
    # the interpreter evaluates masked-off lanes too (log of padding, exp overflow): numpy warns, harmlessly
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
