"""ONNX backend node cases kiln does not run, each with its reason (patterns are regexes)."""

EXCLUDED: dict[str, str] = {
    # control flow (h5): tests/unit/test_ops_misc.py checks this case's output element by element
    r"^test_loop16_seq_none_cpu$": "the ONNX runner cannot compare a sequence holding a 0-d tensor "
    "(it calls len() on each element); kiln's output equals the expected one",
    # signal (h5): kiln computes the DFT in float64; the expected data carries float32 FFT noise
    r"^test_dft_inverse(_opset19)?_cpu$": "expected output holds float32 FFT rounding noise "
    "(1.9e-7 where the exact value is 0) above the case's atol of 1e-7",
    # softmax (h4): kiln's Softmax accumulates fp16 in fp32 (DESIGN: precision); the expanded
    # graph's data comes from numpy's per-step fp16 softmax (bit-exact when kiln does the same)
    r"^test_attention_4d_causal_fp16_expanded_cpu$": "expected data rounds softmax to fp16 at "
    "every step; kiln accumulates in fp32, a 1-ulp difference above the case's atol of 1e-7",
    # random ops (h2): the expected outputs are one draw of the reference's generator
    r"^test_bernoulli": "random op: test data is one random draw, values cannot match",
    r"^test_training_dropout(_default)?(_mask)?_cpu$": "random mask in training mode: test data is one random draw",
}
