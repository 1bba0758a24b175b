"""ONNX backend node cases kiln does not run, each with its reason (patterns are regexes)."""

EXCLUDED: dict[str, str] = {
}
