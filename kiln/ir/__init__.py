"""kiln's IR helpers. The graph itself is onnx_ir's (Graph/Node/Value); dtypes.py is the type
table the lean runtime uses; verify.py and printer.py work on onnx_ir models at build time."""
