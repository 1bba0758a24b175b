"""A Llama decode layer's norms, residual adds and SwiGLU fused into its GEMVs (kiln/llm/decode_fusion.py) on the
CPU: the choice per rows bucket from fake timings, the forced modes, a candidate that fails its check, the models
it refuses; and models whose decode steps run the fused layers (the GEMV under Triton's interpreter) generating
transformers' greedy tokens in fp32."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm import LLM, EngineConfig, LLMError, SamplingParams  # noqa: E402
from kiln.llm import decode_fusion  # noqa: E402
from kiln.llm.decode_fusion import DecodeFusion, FusedLayerConfigs, FusionTuner  # noqa: E402
from kiln.llm.kernels import gemv as gemv_kernels  # noqa: E402
from kiln.llm.kernels.gemv import GemvConfig  # noqa: E402
from tests.llm.conftest import hf_greedy  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a CPU model's GEMV launches need TRITON_INTERPRET=1")
# wide tiles: few programs, which is what the interpreter's time goes by
A = GemvConfig("fma", 32, 64, 1, 4, 1)
B = GemvConfig("dot_swap", 32, 64, 1, 4, 1)
SPLIT = GemvConfig("fma", 32, 32, 2, 4, 1, "last")  # o and down only: the norm and SwiGLU need the whole of K


class FakeTimer:
    """The fused layer wins at 1 row and loses at 2; per projection A beats B, SPLIT beats both; q|k|v with RoPE
    (3 us at A) beats q|k|v + rope_kv_write at 1 row, not at 2."""

    def __init__(self):
        self.names = []

    def __call__(self, bucket, name, calls):
        assert calls and all(callable(c) for c in calls)
        self.names.append((bucket, name))
        layer = {1: {"fused layer": 8.0, "unfused layer": 10.0, "qkv + rope_kv_write": 5.0},
                 2: {"fused layer": 9.9, "unfused layer": 10.0, "qkv + rope_kv_write": 3.0}}
        if name in layer[bucket]:
            return layer[bucket][name]
        return {A.name: 3.0, B.name: 4.0, SPLIT.name: 2.0}[name.split(" ", 1)[1]]


def candidates(role, element_size):
    return [A, B, SPLIT]


@pytest.fixture(scope="module")
def llama_llm(hf_models):
    folder, _ = hf_models("llama")
    return LLM(folder, kv_cache_memory="4MiB", max_num_seqs=2)


@pytest.fixture
def unfused_after(llama_llm):
    yield llama_llm.engine.model
    llama_llm.engine.model.decode_fusion = None


def test_auto_fuses_the_buckets_where_the_fused_layer_is_faster(unfused_after):
    model = unfused_after
    timer = FakeTimer()
    decisions = FusionTuner("auto", measure=timer, candidates=candidates).tune(model, torch.float32, max_rows=2)
    assert [d.bucket for d in decisions] == [1, 2]
    assert decisions[0].configs == FusedLayerConfigs(qkv=A, o=SPLIT, gate_up=A, down=SPLIT, rope=True)
    assert decisions[1].configs is None  # 1% faster: inside the margin
    assert decisions[1].kernels["qkv"] == {A.name: 3.0, B.name: 4.0}  # SPLIT never tried where K is whole
    assert decisions[1].kernels["qkv_rope"] == {A.name: 3.0, B.name: 4.0}
    assert decisions[1].kernels["qkv + rope_kv_write"] == {A.name: 3.0}  # RoPE fused: not faster at 2 rows
    assert model.decode_fusion.plan == {1: decisions[0].configs, 2: None}
    assert model.decode_fusion.configs_for(1) == decisions[0].configs
    assert model.decode_fusion.configs_for(2) is None and model.decode_fusion.configs_for(3) is None
    # per bucket: 2 + 3 + 2 + 3 candidates, 2 with RoPE and the pair they replace, then the layer both ways
    assert len(timer.names) == 2 * (10 + 3 + 2) and (1, "unfused layer") in timer.names


def test_on_fuses_every_bucket_without_timing_the_layer_and_off_times_nothing(unfused_after):
    model = unfused_after
    timer = FakeTimer()
    decisions = FusionTuner("1", measure=timer, candidates=candidates).tune(model, torch.float32, max_rows=1)
    assert decisions[0].configs == FusedLayerConfigs(qkv=A, o=SPLIT, gate_up=A, down=SPLIT, rope=True)
    assert all("layer" not in n and "+" not in n for _, n in timer.names)
    model.decode_fusion = None
    assert FusionTuner("off", measure=timer, candidates=candidates).tune(model, torch.float32) == []
    assert model.decode_fusion is None
    with pytest.raises(LLMError, match="decode_fusion 'yes'"):
        FusionTuner("yes")
    with pytest.raises(LLMError, match="KILN_LLM_FUSE"):
        EngineConfig(decode_fusion="yes").check()


def test_a_candidate_off_against_torch_is_never_used(unfused_after, monkeypatch):
    model = unfused_after
    real = gemv_kernels.gemv

    def off_for_a(x, weight, scale=None, bias=None, config=A, **fusions):
        y = real(x, weight, scale, bias, config, **fusions)
        return y + 1.0 if config == A else y

    monkeypatch.setattr(gemv_kernels, "gemv", off_for_a)
    decisions = FusionTuner("auto", measure=FakeTimer(), candidates=candidates).tune(model, torch.float32, 1)
    assert decisions[0].kernels["gate_up"][A.name] is None
    assert decisions[0].kernels["qkv_rope"][A.name] is None
    assert decisions[0].configs == FusedLayerConfigs(qkv=B, o=SPLIT, gate_up=B, down=SPLIT, rope=True)


def test_models_it_cannot_fuse_are_left_alone(hf_models):
    folder, _ = hf_models("gpt2")
    model = LLM(folder, kv_cache_memory="4MiB", max_num_seqs=1).engine.model
    assert FusionTuner("on", measure=FakeTimer(), candidates=candidates).tune(model, torch.float32) == []
    assert decode_fusion.refusal(model, torch.float32) == "GPT2LMHeadModel is not a Llama-family model"


def recording(monkeypatch):
    """The fusions each GEMV launch asked for: (rows, norm?, residual?, swiglu, rope?)."""
    seen = []
    real = gemv_kernels.gemv

    def wrapped(x, weight, scale=None, bias=None, config=A, **fusions):
        seen.append((x.shape[0], fusions.get("norm") is not None, fusions.get("residual") is not None,
                     fusions.get("swiglu", False), fusions.get("rope") is not None))
        return real(x, weight, scale, bias, config, **fusions)

    monkeypatch.setattr(gemv_kernels, "gemv", wrapped)
    return seen


@interpreted
@pytest.mark.parametrize("name,config,rope", [("llama", A, False), ("llama", B, True), ("qwen2", A, True)])
def test_fused_decode_layers_generate_transformers_greedy_tokens(hf_models, monkeypatch, name, config, rope):
    """qwen2: q/k/v bias through the norm (and RoPE) GEMV."""
    folder, hf = hf_models(name)
    llm = LLM(folder, kv_cache_memory="4MiB", max_num_seqs=2)
    model = llm.engine.model
    model.decode_fusion = DecodeFusion({1: FusedLayerConfigs(config, SPLIT, config, config, rope)})
    seen = recording(monkeypatch)
    prompt = [5, 9, 14, 3, 77]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert tokens == hf_greedy(hf, prompt, 4)[0]
    layers = model.config.num_layers
    # 3 decode steps (the first token comes from the prefill, unfused): 4 fused GEMVs a layer
    assert seen.count((1, True, False, False, rope)) == 3 * layers  # qkv
    assert seen.count((1, True, False, True, False)) == 3 * layers  # gate_up + SwiGLU
    assert seen.count((1, False, True, False, False)) == 3 * 2 * layers  # o, down
    assert len(seen) == 3 * 4 * layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fused_bf16_logits_within_bf16_error_of_fp32_on_cuda(hf_models, name):
    """decode_fusion="on" with the engine's real candidates: 12 rows (a bucket <= 16) run the fused layers;
    their logits are within the error transformers' own bf16 run makes against fp32."""
    from kiln.llm.request import Request
    from kiln.llm.scheduler import ScheduledRequest

    folder, hf = hf_models(name)
    prompt = list(range(5, 17))
    with torch.no_grad():
        reference = hf.float()(torch.tensor([prompt])).logits[0]
        hf_bf16 = hf.to("cuda", torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
        hf.to("cpu", torch.float32)
    llm = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", block_size=16, max_num_seqs=16,
              decode_fusion="on", cuda_graphs=False)
    assert llm.engine.model.decode_fusion.configs_for(len(prompt)) is not None
    runner = llm.engine.runner
    inputs = runner.prepare([ScheduledRequest(Request("r", prompt), prompt, 0, [1, 2, 3, 4])])
    inputs.logit_rows = torch.arange(len(prompt), device="cuda")
    kiln_bf16 = runner.forward(inputs).cpu()
    assert (kiln_bf16 - reference).abs().max() <= 2 * (hf_bf16 - reference).abs().max() + 1e-2
