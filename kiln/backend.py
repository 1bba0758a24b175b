"""kiln as an `onnx.backend.base.Backend`, the way `onnxruntime.backend` exposes ORT.

`prepare` builds an engine with `kiln.build`; `run` feeds inputs positionally through
`engine.run`. This is how the ONNX backend node suite drives kiln.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

import kiln


class KilnRep(BackendRep):
    def __init__(self, engine: kiln.Engine):
        self.engine = engine

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            feeds = dict(zip(self.engine.input_names, inputs))
        outputs = self.engine.run(feeds)
        return tuple(outputs[name] for name in self.engine.output_names)


class KilnBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return device.upper() == "CPU"

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> KilnRep:
        return KilnRep(kiln.build(model))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU", outputs_info=None, **kwargs):
        raise NotImplementedError("kiln runs whole models; build a one-node model instead")


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
supports_device = KilnBackend.supports_device
