"""Frontends: ONNX files/protos (and later torch modules) -> kiln IR (onnx_ir.Model)."""
