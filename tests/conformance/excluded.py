"""ONNX backend node cases kiln does not run, each with its reason (patterns are regexes)."""

EXCLUDED: dict[str, str] = {
    # signal (h5): kiln computes the DFT in float64; the expected data carries float32 FFT noise
    r"^test_dft_inverse(_opset19)?_cpu$": "expected output holds float32 FFT rounding noise "
    "(1.9e-7 where the exact value is 0) above the case's atol of 1e-7",
    # random ops (h2): the expected outputs are one draw of the reference's generator
    r"^test_bernoulli": "random op: test data is one random draw, values cannot match",
    r"^test_training_dropout(_default)?(_mask)?_cpu$": "random mask in training mode: test data is one random draw",
}
