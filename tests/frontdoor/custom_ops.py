"""A custom op kiln cannot know: registered with torch.library, opaque to torch.export and the ONNX
exporter. Imported by the tests (and by a fresh process that loads a saved compiled model)."""

import torch


@torch.library.custom_op("kilntest::scaled_relu", mutates_args=())
def scaled_relu(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.clamp(min=0) * scale


@scaled_relu.register_fake
def _(x, scale):
    return torch.empty_like(x)
