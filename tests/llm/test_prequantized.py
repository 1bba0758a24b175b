"""Pre-quantized checkpoints (AutoAWQ GEMM, GPTQ, compressed-tensors) loaded as they are.

Each checkpoint is written here from a transformers Llama with random weights: every projection but one
(layer 1's down_proj, left in full precision as an `ignore`d layer) is quantized by a plain reference
quantizer and packed by a reference packer written from the formats' documentation — numpy, one loop
per nibble, nothing from kiln. The oracle is transformers' own forward on the dequantized weights (fp32,
exact values: a small integer times an fp16/bf16/fp32 scale). Checked: kiln's dequantized weights equal
the reference bit for bit, logits at prefill and decode match, greedy generations are token for token,
a tensor-parallel split generates what one process does, and what kiln cannot load is refused by name
before any weight is read.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kiln.llm import LLM, LLMError, SamplingParams
from kiln.llm.config import ModelConfig
from kiln.llm.engine import EngineConfig, LLMEngine
from kiln.llm.models import build_model
from kiln.llm.models.layers import RowLinear
from kiln.llm.parallel import TensorParallel
from kiln.llm.prequantized import convert_weights, read_format
from kiln.llm.request import Request
from kiln.llm.scheduler import ScheduledRequest
from kiln.llm.weights import iterate_weights
from tests.llm import checkpoints
from tests.llm.conftest import hf_greedy

# fp32 on the CPU; kiln and transformers multiply the same dequantized weights and differ by summation
# order (fused GEMMs, SDPA) — and for int8/fp8 by applying the per-channel scale after the GEMM, not before
ATOL, RTOL = 5e-5, 1e-5
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEPT = "model.layers.1.mlp.down_proj"  # left unquantized in every checkpoint (an ignored layer)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds output column 8j + AWQ_ORDER[i]


# -- reference quantizers: weight [out, in] fp32 -> stored integers, scales, zeros and the exact dequantized weight

def quantize_groups(w: np.ndarray, group: int, symmetric: bool, bits: int = 4, scale_dtype=np.float16):
    """Per (output row, group of `group` inputs): q in 0..2^bits-1, w ≈ (q - z) · s. Symmetric: z = 2^(bits-1)."""
    out, inp = w.shape
    top, middle = 2**bits - 1, 2 ** (bits - 1)
    g = w.reshape(out, inp // group, group)
    if symmetric:
        scale = (np.abs(g).max(-1) / (middle - 1)).astype(scale_dtype)
        zero = np.full(scale.shape, middle, dtype=np.int64)
    else:
        low, high = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = ((high - low) / top).astype(scale_dtype)
        zero = np.clip(np.round(-low / scale.astype(np.float32)), 0, top).astype(np.int64)
    s32 = scale.astype(np.float32)
    q = np.clip(np.round(g / s32[..., None]) + zero[..., None], 0, top).astype(np.int64)
    dequantized = ((q - zero[..., None]) * s32[..., None]).reshape(out, inp).astype(np.float32)
    return q.reshape(out, inp), scale, zero, dequantized


def pack_sequential(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Consecutive values along `axis` into int32 words, value i of a word at bits [bits·i, bits·(i+1))."""
    per_word = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    pad = -v.shape[-1] % per_word
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint32)], axis=-1)
    words = np.zeros(v.shape[:-1] + (v.shape[-1] // per_word,), np.uint32)
    for i in range(per_word):
        words |= v[..., i::per_word] << np.uint32(bits * i)
    return np.moveaxis(words, -1, axis).view(np.int32)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """[rows, cols] 0..15 -> [rows, cols/8] int32: column 8j + AWQ_ORDER[i] in nibble i of word j."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for i, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


@dataclass
class Layout:
    """One way a checkpoint stores its projections: writes a layer's tensors, returns its exact weight."""

    name: str
    quantization_config: dict

    def write(self, w: np.ndarray, prefix: str, tensors: dict) -> np.ndarray:
        kind = self.quantization_config["quant_method"]
        if kind == "awq":
            group = self.quantization_config["group_size"]
            q, scale, zero, exact = quantize_groups(w, group, symmetric=False)
            tensors[f"{prefix}.qweight"] = t(pack_awq(q.T))  # [in, out/8]
            tensors[f"{prefix}.qzeros"] = t(pack_awq(zero.T))  # [in/group, out/8]
            tensors[f"{prefix}.scales"] = t(scale.T)  # [in/group, out] fp16
            return exact
        if kind == "gptq":
            config = self.quantization_config
            group = config["group_size"] if config["group_size"] > 0 else w.shape[1]
            bits = config["bits"]
            q, scale, zero, _ = quantize_groups(w, group, symmetric=config["sym"], bits=bits)
            v1 = config.get("checkpoint_format", "gptq") == "gptq"
            stored = (zero - 1) % 2**bits if v1 else zero  # AutoGPTQ's packer stores zero - 1; its kernels add 1 back
            tensors[f"{prefix}.qweight"] = t(pack_sequential(q.T, bits, axis=0))  # [in/(32/bits), out]
            tensors[f"{prefix}.qzeros"] = t(pack_sequential(stored.T, bits, axis=1))  # [groups, out/(32/bits)]
            tensors[f"{prefix}.scales"] = t(scale.T)  # [groups, out]
            tensors[f"{prefix}.g_idx"] = t((np.arange(w.shape[1]) // group).astype(np.int32))
            effective = stored + 1 if v1 else stored  # what the checkpoint means (a stored 15 in v1 reads as 16)
            g = q.reshape(w.shape[0], -1, group)  # [out, groups, group]
            exact = (g - effective[..., None]) * scale.astype(np.float32)[..., None]
            return exact.reshape(w.shape).astype(np.float32)
        return self._write_compressed_tensors(w, prefix, tensors)

    def _write_compressed_tensors(self, w: np.ndarray, prefix: str, tensors: dict) -> np.ndarray:
        scheme = self.quantization_config["config_groups"]["group_0"]["weights"]
        fmt = self.quantization_config["format"]
        if scheme["type"] == "float":  # FP8 E4M3: one scale per channel or one for the tensor
            if scheme["strategy"] == "channel":
                scale = torch.from_numpy(np.abs(w).max(axis=1, keepdims=True) / 448.0).float()  # [out, 1]
            else:
                scale = torch.tensor([np.abs(w).max() / 448.0], dtype=torch.float32)  # [1]
            q = (torch.from_numpy(w) / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale"] = q, scale
            tensors[f"{prefix}.input_scale"] = torch.tensor([0.02])  # static activation scale: read, not applied
            return (q.float() * scale.reshape(-1, 1)).numpy()
        if scheme["num_bits"] == 8 and (scheme["strategy"] == "group" or not scheme["symmetric"]):
            # 8 bits with zero points (asymmetric) per group or channel: stored q + 128, zero points likewise
            group = scheme["group_size"] or w.shape[1]
            q, scale, zero, exact = quantize_groups(w, group, scheme["symmetric"], bits=8)
            if fmt == "pack-quantized":
                tensors[f"{prefix}.weight_packed"] = t(pack_sequential(q, 8, axis=1))
                tensors[f"{prefix}.weight_shape"] = torch.tensor(w.shape)
                zero_point = t(pack_sequential(zero, 8, axis=0))  # [out/4, groups]
            else:  # naive: signed int8 as they are
                tensors[f"{prefix}.weight"] = t((q - 128).astype(np.int8))
                zero_point = t((zero - 128).astype(np.int8))
            tensors[f"{prefix}.weight_scale"] = t(scale)
            if not scheme["symmetric"]:
                tensors[f"{prefix}.weight_zero_point"] = zero_point
            return exact
        if scheme["num_bits"] == 8:  # symmetric int8, per channel (or tensor), scales in bf16
            per_channel = scheme["strategy"] == "channel"
            absmax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max().reshape(1)
            scale = torch.tensor(absmax / 127.0).to(torch.bfloat16)
            q = np.clip(np.round(w / scale.float().reshape(-1, 1).numpy()), -128, 127).astype(np.int64)
            if fmt == "pack-quantized":
                tensors[f"{prefix}.weight_packed"] = t(pack_sequential(q + 128, 8, axis=1))
                tensors[f"{prefix}.weight_shape"] = torch.tensor(w.shape)
            else:
                tensors[f"{prefix}.weight"] = t(q.astype(np.int8))
            tensors[f"{prefix}.weight_scale"] = scale
            return (q * scale.float().reshape(-1, 1).numpy()).astype(np.float32)
        # int4 pack-quantized: signed q in -8..7 stored as q + 8; zero points likewise, packed along outputs
        group, symmetric = scheme["group_size"], scheme["symmetric"]
        q, scale, zero, exact = quantize_groups(w, group, symmetric)
        tensors[f"{prefix}.weight_packed"] = t(pack_sequential(q, 4, axis=1))  # [out, in/8]
        tensors[f"{prefix}.weight_shape"] = torch.tensor(w.shape)
        tensors[f"{prefix}.weight_scale"] = t(scale)  # [out, groups]
        if not symmetric:
            tensors[f"{prefix}.weight_zero_point"] = t(pack_sequential(zero, 4, axis=0))  # [out/8, groups]
        return exact


def compressed(fmt: str, **weights) -> dict:
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16, "actorder": None,
              "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": None}},
            "ignore": ["lm_head", KEPT], "kv_cache_scheme": None}


LAYOUTS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": [KEPT]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
    "gptq_v2_sym_per_channel": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True,
                                "checkpoint_format": "gptq_v2"},
    "ct_int4_group_sym": compressed("pack-quantized"),
    "ct_int4_group_asym": compressed("pack-quantized", symmetric=False, group_size=32),
    "ct_int8_channel_packed": compressed("pack-quantized", num_bits=8, strategy="channel", group_size=None),
    "ct_int8_tensor": compressed("int-quantized", num_bits=8, strategy="tensor", group_size=None),
    "gptq_8bit": {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False, "sym": False},
    "ct_int8_group_asym_packed": compressed("pack-quantized", num_bits=8, symmetric=False, group_size=32),
    "ct_int8_channel_asym": compressed("naive-quantized", num_bits=8, symmetric=False, strategy="channel",
                                       group_size=None),
    "ct_fp8_channel": compressed("float-quantized", num_bits=8, type="float", strategy="channel", group_size=None),
    "ct_fp8_tensor": compressed("float-quantized", num_bits=8, type="float", strategy="tensor", group_size=None),
}
# the kiln module each layout becomes
MODULES = {"awq": "Int4Weight", "gptq": "Int4Weight", "gptq_v2_sym_per_channel": "Int4Weight",
           "ct_int4_group_sym": "Int4Weight", "ct_int4_group_asym": "Int4Weight",
           "ct_int8_channel_packed": "Int8Weight", "ct_int8_tensor": "Int8Weight",
           "gptq_8bit": "Int8GroupWeight", "ct_int8_group_asym_packed": "Int8GroupWeight",
           "ct_int8_channel_asym": "Int8GroupWeight", "ct_fp8_channel": "FP8Weight", "ct_fp8_tensor": "FP8Weight"}
GROUPS_OF_64 = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}


@pytest.fixture(scope="module")
def quantized_checkpoints(tmp_path_factory):
    """layout -> (folder, transformers model on the exact dequantized weights, {layer: exact weight})."""
    made = {}
    _, hf = checkpoints.llama(tmp_path_factory.mktemp("base"), seed=11, intermediate_size=128)

    def get(name):
        if name not in made:
            layout = Layout(name, LAYOUTS.get(name, GROUPS_OF_64))
            folder = tmp_path_factory.mktemp(name)
            reference = copy.deepcopy(hf)
            tensors, exact = {}, {}
            for key, value in hf.state_dict().items():
                prefix = key.rpartition(".")[0]
                if prefix.rpartition(".")[2] in PROJECTIONS and key.endswith(".weight") and prefix != KEPT:
                    exact[prefix] = layout.write(value.numpy(), prefix, tensors)
                    reference.get_parameter(key).data.copy_(torch.from_numpy(exact[prefix]))
                else:
                    tensors[key] = value.contiguous()
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
            config = hf.config.to_dict()
            config["quantization_config"] = layout.quantization_config
            (folder / "config.json").write_text(json.dumps(config))
            checkpoints.write_tokenizer(folder)
            made[name] = folder, reference.eval(), exact
        return made[name]

    return get


def engine(folder, **options):
    """fp32 on the CPU, also on a machine with a GPU (the CUDA kernels have their own test below)."""
    return LLMEngine(folder, EngineConfig(**{"kv_cache_memory": "4MiB", "block_size": 4, "device": "cpu", **options}))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dequantized_weights_are_the_checkpoints_exactly(quantized_checkpoints, name):
    folder, _, exact = quantized_checkpoints(name)
    model = engine(folder).model
    for index, layer in enumerate(model.layers):
        prefix = f"model.layers.{index}"
        qkv = layer.self_attn.qkv_proj.quantized.dequantize(torch.float32)
        expected = np.concatenate([exact[f"{prefix}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(qkv, torch.from_numpy(expected)), f"{prefix} q/k/v"
        gate_up = layer.mlp.gate_up_proj.quantized.dequantize(torch.float32)
        expected = np.concatenate([exact[f"{prefix}.mlp.{p}"] for p in ("gate_proj", "up_proj")])
        assert torch.equal(gate_up, torch.from_numpy(expected)), f"{prefix} gate/up"
        o = layer.self_attn.o_proj.quantized.dequantize(torch.float32)
        assert torch.equal(o, torch.from_numpy(exact[f"{prefix}.self_attn.o_proj"]))
        if f"{prefix}.mlp.down_proj" == KEPT:
            assert layer.mlp.down_proj.quantized is None and layer.mlp.down_proj.weight is not None
        else:
            assert layer.mlp.down_proj.weight is None
            assert torch.equal(layer.mlp.down_proj.quantized.dequantize(torch.float32),
                               torch.from_numpy(exact[f"{prefix}.mlp.down_proj"]))
        assert type(layer.self_attn.qkv_proj.quantized).__name__ == MODULES[name]
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert all(b.is_contiguous() for b in module.quantized.buffers())  # the Triton GEMMs read row-major


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logits_match_transformers_on_the_dequantized_weights(quantized_checkpoints, name):
    folder, hf, _ = quantized_checkpoints(name)
    runner = engine(folder).runner
    rng = random.Random(name)
    prompt = [rng.randrange(4, 300) for _ in range(13)]
    blocks = rng.sample(range(1, 40), 6)
    request = Request("r", prompt)
    inputs = runner.prepare([ScheduledRequest(request, prompt, 0, blocks)])
    inputs.logit_rows = torch.arange(len(prompt))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(runner.forward(inputs), expected, atol=ATOL, rtol=RTOL)
    ids = list(prompt)
    for _ in range(4):  # decode steps through the paged cache
        ids.append(int(expected[-1].argmax()))
        inputs = runner.prepare([ScheduledRequest(request, ids[-1:], len(ids) - 1, blocks)])
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(runner.forward(inputs)[0], expected[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["awq", "gptq", "ct_int4_group_asym", "ct_fp8_tensor"])
def test_greedy_generation_is_token_for_token_the_dequantized_model(quantized_checkpoints, name):
    folder, hf, _ = quantized_checkpoints(name)
    llm = LLM(folder, device="cpu", kv_cache_memory="4MiB", block_size=4)
    prompts = ["Hello world, hello", "Paged attention reads keys and values"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected, _ = hf_greedy(hf, llm.tokenizer.encode(prompt), 12)
        assert out.outputs[0].token_ids == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["awq", "gptq", "gptq_v2_sym_per_channel", "ct_int4_group_asym",
                                  "ct_int8_channel_packed", "gptq_8bit", "ct_int8_channel_asym"])
def test_cuda_kernels_generate_what_the_dequantized_model_does(quantized_checkpoints, name):
    """fp32 on CUDA: the Triton int4/int8 GEMMs (exact fp32 products), CUDA graphs, the fused kernels."""
    folder, hf, _ = quantized_checkpoints(name)
    llm = LLM(folder, device="cuda", dtype="float32", kv_cache_memory="64MiB", block_size=16)
    prompts = ["Hello world, hello", "Paged attention reads keys and values"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected, _ = hf_greedy(hf, llm.tokenizer.encode(prompt), 12)
        assert out.outputs[0].token_ids == expected


def test_two_ranks_generate_what_one_does(quantized_checkpoints):
    """Column-parallel ranks take their rows of each fused part, row-parallel ones their whole groups."""
    folder, _, _ = quantized_checkpoints("ct_int4_group_asym")
    options = dict(device="cpu", kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    single = LLM(folder, **options).generate(["Hello world, hello", "a"], params)
    with LLM(folder, tensor_parallel=2, **options) as llm:
        split = llm.generate(["Hello world, hello", "a"], params)
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == pytest.approx([x.logprob for x in b.outputs[0].logprobs],
                                                                           abs=1e-4)


def test_a_rank_slice_across_a_group_is_refused(quantized_checkpoints):
    """GPTQ groups of 64 over down_proj's 128 inputs: 4 row-parallel ranks would each hold half a group.
    (o_proj's 64 inputs are one group: a scale per output channel, which any slice keeps.)"""
    folder, _, _ = quantized_checkpoints("groups_of_64")
    weights = dict(convert_weights(iterate_weights(folder), read_format(GROUPS_OF_64, "config.json")))
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert down.shape == (64, 128) and down.scale.shape == (64, 2)
    RowLinear(128, 64, False, TensorParallel(rank=1, size=2), "down").load("weight", down)  # whole groups: fine
    with pytest.raises(LLMError, match=r"down_proj \(gptq\): a tensor-parallel rank's input features \[32, 64\) do "
                                       r"not fall on the checkpoint's groups of 64"):
        RowLinear(128, 64, False, TensorParallel(rank=1, size=4), "down").load("weight", down)
    o_proj = weights["model.layers.0.self_attn.o_proj.weight"]
    RowLinear(64, 64, False, TensorParallel(rank=1, size=4), "o").load("weight", o_proj)


def write_config_only(folder: Path, quantization_config: dict, **overrides) -> Path:
    """config.json and a weights file that is not safetensors: a refusal must come before reading it."""
    config = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "quantization_config": quantization_config, **overrides}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return folder


REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}, "AWQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    (compressed("nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized' is not supported"),
    (compressed("pack-quantized", actorder="group"), "actorder 'group'"),
    (compressed("pack-quantized", symmetric=False, strategy="tensor"), "one zero point per tensor"),
    (compressed("pack-quantized", num_bits=3), "3-bit integer weights"),
    (compressed("float-quantized", num_bits=8, type="float", strategy="block", group_size=None),
     "weight strategy 'block'"),
    ({**compressed("pack-quantized"), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
]


@pytest.mark.parametrize("quantization_config,message", REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_variants_are_refused_by_name_before_weights_are_read(tmp_path, quantization_config, message):
    with pytest.raises(LLMError, match=message):
        LLM(write_config_only(tmp_path, quantization_config))


def test_requantizing_and_other_families_are_refused(tmp_path):
    folder = write_config_only(tmp_path, LAYOUTS["awq"])
    with pytest.raises(LLMError, match=r"already quantized \(awq\): leave quantization unset"):
        LLM(folder, quantization="int4")
    gpt2 = {"model_type": "gpt2", "vocab_size": 320, "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 64,
            "quantization_config": LAYOUTS["gptq"]}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(LLMError, match="pre-quantized gpt2 checkpoints are not supported"):
        LLM(tmp_path)


def test_a_layers_tensors_may_lie_in_different_shards(quantized_checkpoints, tmp_path):
    """qweight in one shard, qzeros and scales in another (model.safetensors.index.json lists them)."""
    folder, _, _ = quantized_checkpoints("awq")
    tensors = dict(iterate_weights(folder))
    shards = {"a.safetensors": {n: w for n, w in tensors.items() if not n.endswith((".qzeros", ".scales"))},
              "b.safetensors": {n: w for n, w in tensors.items() if n.endswith((".qzeros", ".scales"))}}
    for shard, part in shards.items():
        save_file(part, str(tmp_path / shard), metadata={"format": "pt"})
    index = {"weight_map": {n: shard for shard, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    split, whole = engine(tmp_path).model, engine(folder).model
    for a, b in zip(split.layers, whole.layers):
        assert torch.equal(a.mlp.gate_up_proj.quantized.dequantize(torch.float32),
                           b.mlp.gate_up_proj.quantized.dequantize(torch.float32))


def test_quantized_layers_never_allocate_a_full_precision_weight(quantized_checkpoints):
    """Linear weights are built on the meta device and allocated only when a full-precision tensor arrives."""
    folder, _, _ = quantized_checkpoints("awq")
    config = ModelConfig.from_folder(folder)
    model = build_model(config, 64)
    model.load_weights(convert_weights(iterate_weights(folder), read_format(config.quantization_config, "x")))
    assert model.layers[0].self_attn.qkv_proj.weight.is_meta and model.layers[0].mlp.down_proj.weight.is_meta
    assert not model.layers[1].mlp.down_proj.weight.is_meta  # the unquantized layer


def test_group_indices_are_read_and_checked():
    """A g_idx of i // group is the plain order (dropped); any other order is act-order: refused."""
    gptq, ct = read_format(LAYOUTS["gptq"], "x"), read_format(LAYOUTS["ct_int4_group_sym"], "x")
    plain = torch.arange(64, dtype=torch.int32) // 32
    assert list(convert_weights([("l.g_idx", plain)], gptq)) == []
    assert list(convert_weights([("l.weight_g_idx", torch.arange(64, dtype=torch.int32) // 16)], ct)) == []
    with pytest.raises(LLMError, match=r"l.g_idx is not i // group_size \(32\)"):
        list(convert_weights([("l.g_idx", plain.flip(0))], gptq))
    with pytest.raises(LLMError, match=r"l.weight_g_idx is not i // group_size \(16\)"):
        list(convert_weights([("l.weight_g_idx", plain)], ct))


def test_a_layer_missing_a_tensor_is_named(quantized_checkpoints):
    folder, _, _ = quantized_checkpoints("awq")
    weights = [(n, w) for n, w in iterate_weights(folder) if n != "model.layers.0.mlp.up_proj.qzeros"]
    with pytest.raises(LLMError, match=r"model.layers.0.mlp.up_proj: has qweight, scales, lacks qzeros"):
        list(convert_weights(weights, read_format(LAYOUTS["awq"], "x")))
