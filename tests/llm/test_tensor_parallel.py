"""Tensor parallelism over 2 processes with gloo on the CPU: the split model (column/row-parallel
projections, vocabulary-parallel embedding and logits, KV heads split) generates what one process
does, token for token, with log-probabilities equal up to the summation order of the all-reduce."""

import pytest
import torch.distributed as dist

from kiln.llm import LLM, SamplingParams

PROMPTS = ["Hello world, hello", "Paged attention reads keys", "a"]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_two_ranks_generate_what_one_does(hf_models, name):
    folder, _ = hf_models(name)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    single = LLM(folder, kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16).generate(PROMPTS, params)
    with LLM(folder, kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16, tensor_parallel=2) as llm:
        assert llm.engine.model_config.num_kv_heads // 2 == llm.engine.kv_cache_spec.num_kv_heads
        split = llm.generate(PROMPTS, params)
    assert not dist.is_initialized()
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [t.logprob for t in a.outputs[0].logprobs] == pytest.approx([t.logprob for t in b.outputs[0].logprobs],
                                                                           abs=1e-4)


@pytest.mark.slow
def test_ray_actors_as_ranks_generate_what_one_process_does(hf_models):
    """distributed_executor="ray": rank 1 is a Ray actor (a local Ray instance, CPU bundles, gloo)."""
    ray = pytest.importorskip("ray")
    folder, _ = hf_models("llama")
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    options = dict(device="cpu", kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16)
    single = LLM(folder, **options).generate(PROMPTS, params)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with LLM(folder, tensor_parallel=2, distributed_executor="ray", **options) as llm:
            split = llm.generate(PROMPTS, params)
        assert not dist.is_initialized()
        assert not ray.util.placement_group_table() or all(
            g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
    for a, b in zip(single, split):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [t.logprob for t in a.outputs[0].logprobs] == pytest.approx([t.logprob for t in b.outputs[0].logprobs],
                                                                           abs=1e-4)
