"""compressed-tensors checkpoints (quant_method "compressed-tensors", written by llm-compressor), weights
only; one quantization scheme for the Linear layers, layers in `ignore` stored in full precision:

    pack-quantized   int4 or int8 as int32 words, consecutive input features in nibbles (bytes) 0..7 (0..3):
                     weight_packed [out, ceil(in·bits/32)], weight_shape [2] = (out, in),
                     weight_scale [out, in/group] (group) or [out, 1] (channel) or [1] (tensor),
                     weight_zero_point [ceil(out·bits/32), groups] packed along outputs (asymmetric only).
                     Stored values are q + 2^(bits-1) (signed q made unsigned), zero points likewise:
                     w = (q - zp) · s.
    naive-/int-quantized  weight int8 [out, in], weight_scale, weight_zero_point int8 [out, groups]
                     (asymmetric only): w = (q - zp) · s.
    float-quantized  weight float8_e4m3fn [out, in], weight_scale [out, 1] or [1]: w = q · s.

Activation quantization in the scheme (W8A8, FP8 static `input_scale`) is not applied: activations stay in
the model's dtype (FP8 weights on Hopper quantize activations per token on the fly, as for quantization="fp8").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.config import LLMError
from kiln.llm.prequantized.base import CheckpointFormat, unpack_int32
from kiln.llm.prequantized.tensor import QuantizedTensor

FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")


@dataclass
class CompressedTensors(CheckpointFormat):
    format: str  # one of FORMATS
    bits: int
    strategy: str  # tensor | channel | group
    group_size: int | None
    symmetric: bool
    name = "compressed-tensors"

    @property
    def components(self) -> tuple[str, ...]:
        zero_point = () if self.symmetric else ("weight_zero_point",)
        if self.format == "pack-quantized":
            return ("weight_packed", "weight_scale", "weight_shape") + zero_point
        return ("weight", "weight_scale") + zero_point

    @classmethod
    def from_config(cls, config: dict, source: str) -> CompressedTensors:
        what = f"{source}: compressed-tensors"
        if config.get("sparsity_config"):
            raise LLMError(f"{what} with a sparsity_config (sparse weights) is not supported")
        if config.get("kv_cache_scheme"):
            raise LLMError(f"{what} with a kv_cache_scheme (a quantized KV cache) is not supported")
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise LLMError(f"{what}: quantization_status {status!r}: kiln reads compressed checkpoints only")
        groups = config.get("config_groups") or {}
        schemes = [g for g in groups.values() if isinstance(g, dict) and g.get("weights")]
        if len(schemes) != 1:
            raise LLMError(f"{what}: {len(schemes)} weight schemes in config_groups ({', '.join(groups)}); kiln "
                           "supports exactly one")
        scheme = schemes[0]
        targets = scheme.get("targets", ["Linear"])
        if targets != ["Linear"]:
            raise LLMError(f"{what}: the scheme targets {targets}; kiln supports [\"Linear\"]")
        fmt = scheme.get("format") or config.get("format")
        if fmt not in FORMATS:
            raise LLMError(f"{what} format {fmt!r} is not supported ({', '.join(FORMATS)})")
        w = scheme["weights"]
        bits, kind = w.get("num_bits", 8), w.get("type", "int")
        strategy, group, symmetric = w.get("strategy", "tensor"), w.get("group_size"), w.get("symmetric", True)
        if w.get("actorder") not in (None, False, "weight", "static"):
            raise LLMError(f"{what}: actorder {w['actorder']!r} (a weight_g_idx reordering input rows into groups) is "
                           "not supported; actorder \"weight\" or none is")
        if strategy not in ("tensor", "channel", "group"):
            raise LLMError(f"{what}: weight strategy {strategy!r} is not supported (tensor, channel, group)")
        if w.get("dynamic"):
            raise LLMError(f"{what}: dynamic weight quantization is not a stored checkpoint")
        if fmt == "float-quantized":
            if (kind, bits) != ("float", 8) or strategy == "group":
                raise LLMError(f"{what}: float-quantized {kind} {bits} bits {strategy}: kiln reads FP8 (float, 8 bits) "
                               "with per-tensor or per-channel scales")
        elif kind != "int":
            raise LLMError(f"{what} {fmt} with weight type {kind!r}: expected int")
        elif bits == 4:
            if fmt != "pack-quantized":
                raise LLMError(f"{what}: 4-bit weights in format {fmt!r}: expected pack-quantized")
            if strategy == "group" and (not isinstance(group, int) or group <= 0):
                raise LLMError(f"{what}: group strategy with group_size {group!r}")
        elif bits == 8:
            if strategy == "group" and (not isinstance(group, int) or group <= 0):
                raise LLMError(f"{what}: group strategy with group_size {group!r}")
        else:
            raise LLMError(f"{what}: {bits}-bit integer weights are not supported (4 or 8)")
        if fmt == "float-quantized" and not symmetric:
            raise LLMError(f"{what}: asymmetric FP8 weights are not supported")
        if not symmetric and strategy == "tensor":
            raise LLMError(f"{what}: asymmetric weights with one zero point per tensor are not supported "
                           "(per channel or group are)")
        return cls(fmt, bits, strategy, group if strategy == "group" else None, symmetric)

    def holds(self, component: str, tensor: torch.Tensor) -> bool:
        if component == "weight":  # quantized layers store an int8/fp8 weight; ignored layers a float one
            return self.format != "pack-quantized" and tensor.dtype in (torch.int8, torch.float8_e4m3fn)
        return component in self.components

    def drops(self, component: str, tensor: torch.Tensor, layer: str) -> bool:
        if component == "weight_g_idx":  # some writers store one without act-order: it must be i // group
            group = self.group_size or tensor.shape[0]
            if not torch.equal(tensor.long(), torch.arange(tensor.shape[0]) // group):
                raise LLMError(f"{layer}.weight_g_idx is not i // group_size ({group}): the checkpoint reorders input "
                               "rows (act-order), which kiln does not support")
            return True
        return component in ("input_scale", "input_zero_point", "output_scale", "output_zero_point")

    def unpack(self, group: dict[str, torch.Tensor], layer: str) -> QuantizedTensor:
        source = f"{layer} (compressed-tensors {self.format})"
        scale = group["weight_scale"].float()
        if self.format == "pack-quantized":
            out_features, in_features = (int(v) for v in group["weight_shape"].tolist())
            packed = group["weight_packed"]
            per_word = 32 // self.bits
            if packed.dtype != torch.int32 or list(packed.shape) != [out_features, -(-in_features // per_word)]:
                raise LLMError(f"{source}: weight_packed {list(packed.shape)} {packed.dtype} does not hold "
                               f"weight_shape {[out_features, in_features]} at {self.bits} bits in int32 words")
            values = unpack_int32(packed, self.bits, dim=1)[:, :in_features]
        else:
            values = group["weight"]
            out_features, in_features = values.shape
        scale = self._scale_rows(scale, out_features, in_features, source)
        size = in_features // scale.shape[1]
        if self.format == "float-quantized":
            if values.dtype != torch.float8_e4m3fn:
                raise LLMError(f"{source}: weight is {values.dtype}, expected float8_e4m3fn")
            return QuantizedTensor("fp8", values, scale, None, size, source)
        offset = 1 << (self.bits - 1)  # stored unsigned: q + 2^(bits-1)
        if self.bits == 8:
            if self.format == "pack-quantized":
                values = (values - offset).to(torch.int8)
            elif values.dtype != torch.int8:
                raise LLMError(f"{source}: weight is {values.dtype}, expected int8")
            if self.symmetric and scale.shape[1] == 1:  # kiln's int8: symmetric, one scale per output channel
                return QuantizedTensor("int8", values.contiguous(), scale, None, size, source)
            zero = torch.full_like(scale, offset)
            if not self.symmetric:
                stored = group["weight_zero_point"]
                zero = (unpack_int32(stored, 8, dim=0)[:out_features].float() if self.format == "pack-quantized"
                        else stored.float().reshape(scale.shape) + offset)
            if zero.shape != scale.shape:
                raise LLMError(f"{source}: weight_zero_point gives {list(zero.shape)}, expected {list(scale.shape)}")
            unsigned = (values.to(torch.int32) + offset).to(torch.uint8).contiguous()  # q + 128, zero likewise
            return QuantizedTensor("int8-group", unsigned, scale, zero, size, source)
        if self.symmetric:
            zero = torch.full_like(scale, offset)
        else:
            zero = unpack_int32(group["weight_zero_point"], 4, dim=0)[:out_features].float()
            if zero.shape != scale.shape:
                raise LLMError(f"{source}: weight_zero_point unpacks to {list(zero.shape)}, expected "
                               f"{list(scale.shape)} (one per output channel and group)")
        return QuantizedTensor.int4(values, scale, zero, size, source)

    def _scale_rows(self, scale: torch.Tensor, out_features: int, in_features: int, source: str) -> torch.Tensor:
        """weight_scale as [out, groups]: a per-tensor scale repeated for every output channel."""
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(out_features, 1).contiguous()
        groups = 1 if self.group_size is None else in_features // self.group_size
        if list(scale.shape) != [out_features, groups] or (self.group_size and in_features % self.group_size):
            raise LLMError(f"{source}: weight_scale {list(scale.shape)}, expected {[out_features, groups]} for "
                           f"{self.strategy} scales of weight [{out_features}, {in_features}]")
        return scale.contiguous()
