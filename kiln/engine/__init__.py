"""Engine plans and the engine file format (read by the lean runtime; written by the builder)."""
