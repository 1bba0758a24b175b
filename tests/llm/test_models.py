"""kiln's models against transformers' own forward on the same random weights (fp32, CPU): logits at
prefill and at every decode step, read back through a paged KV cache with scattered blocks; greedy
generations token for token; log-probabilities through the whole engine; load errors."""

import json
import random

import pytest
import torch

from kiln.llm import LLM, LLMError, SamplingParams
from kiln.llm.config import ModelConfig
from kiln.llm.engine import EngineConfig, LLMEngine
from kiln.llm.request import Request
from kiln.llm.scheduler import ScheduledRequest
from tests.llm.conftest import hf_greedy

# fp32 logits of magnitude ~5: kiln and transformers differ by summation order only (fused q/k/v and
# gate/up GEMMs, SDPA vs eager softmax); measured <= 7e-6
ATOL, RTOL = 5e-5, 1e-5
MODELS = ["llama", "llama_tied_sharded", "llama3_rope", "linear_rope", "yarn_rope", "qwen2", "mistral", "gpt2"]


def engine(folder, **options):
    return LLMEngine(folder, EngineConfig(**{"kv_cache_memory": "4MiB", "block_size": 4, **options}))


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_at_prefill_and_every_decode_step(hf_models, name):
    folder, hf = hf_models(name)
    eng = engine(folder)
    runner = eng.runner
    rng = random.Random(name)
    prompt = [rng.randrange(4, 300) for _ in range(21)]  # past mistral's window of 12
    blocks = rng.sample(range(1, eng.num_kv_blocks), 12)  # scattered: block order is not memory order
    request = Request("r", prompt)
    inputs = runner.prepare([ScheduledRequest(request, prompt, 0, blocks)])
    inputs.logit_rows = torch.arange(len(prompt))
    logits = runner.forward(inputs)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
    ids = list(prompt)
    for _ in range(12):  # crosses three block boundaries
        ids.append(int(expected[-1].argmax()))
        inputs = runner.prepare([ScheduledRequest(request, ids[-1:], len(ids) - 1, blocks)])
        logits = runner.forward(inputs)
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(logits[0], expected[-1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2"])
def test_greedy_generation_is_token_for_token_transformers(hf_models, name):
    folder, hf = hf_models(name)
    llm = LLM(folder, kv_cache_memory="4MiB", block_size=4)
    prompts = ["Hello world, hello", "The quick brown fox", "Paged attention reads keys and values", "Ü"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected, _ = hf_greedy(hf, llm.tokenizer.encode(prompt), 16)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == llm.tokenizer.decode(expected)
        assert out.outputs[0].finish_reason == "length"


def test_engine_logprobs_are_transformers_log_softmax_with_chunks_and_prefix_hits(hf_models):
    """The whole engine path (chunked prefill of 8 tokens a step, a prefix-cache hit, batching):
    each step's log-probabilities equal transformers' log_softmax of that step's logits."""
    folder, hf = hf_models("llama")
    llm = LLM(folder, kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=8)
    shared = list(range(10, 30))
    prompts = [shared + [40, 41, 42], shared + [50], list(range(100, 111))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))
    assert outs[1].num_cached_tokens == 20  # the shared 20 tokens (5 blocks) came from the cache
    for prompt, out in zip(prompts, outs):
        tokens, logits = hf_greedy(hf, prompt, 6)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        for step, (lp, row) in enumerate(zip(completion.logprobs, logits)):
            expected = torch.log_softmax(row, -1)
            assert lp.token_id == tokens[step]
            assert lp.logprob == pytest.approx(expected[tokens[step]].item(), abs=ATOL)
            top = expected.topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=ATOL)


def test_model_config_reads_both_rope_spellings():
    old = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {**old, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}
    del new["rope_theta"], new["rope_scaling"]
    assert ModelConfig.from_dict(old).rope == ModelConfig.from_dict(new).rope
    assert ModelConfig.from_dict(old).rope.theta == 500000.0
    with pytest.raises(LLMError, match="dynamic NTK"):
        ModelConfig.from_dict({**old, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(LLMError, match="model_type 'bert'"):
        ModelConfig.from_dict({**old, "model_type": "bert"})


def test_load_errors_name_the_problem(hf_models, tmp_path):
    folder, _ = hf_models("llama")
    with pytest.raises(LLMError, match="no config.json"):
        LLM(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(LLMError, match="no \\*.safetensors"):
        LLM(broken)
    (broken / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(LLMError, match=r"not in the checkpoint: layers\.2\."):
        LLM(broken)
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(LLMError, match=r"does not fit layers\.0\.mlp\..*: expected \[64, 100\], got \[64, 112\]"):
        LLM(broken)
    with pytest.raises(LLMError, match="at least 2"):
        LLM(folder, kv_cache_memory="1KiB")
    with pytest.raises(LLMError, match="less than one request"):
        LLM(folder, num_kv_blocks=3, block_size=4)
