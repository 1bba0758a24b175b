"""Quantization: calibrators (calibrators.py), calibration data (data.py), Q/DQ insertion from measured
ranges (qdq.py) and the calibration cache (cache.py). The builder runs calibration (it owns the
lowering that makes the model runnable): kiln/builder/calibration.py."""
