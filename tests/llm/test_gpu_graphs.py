"""CUDA graphs for decode (kiln/llm/cuda_graphs.py) on a CUDA device (skipped here): graphed decode
gives the eager step's tokens (fp32 and bf16 greedy, seeded sampling, penalties and log-probabilities
through the graph's logits, batches at and between buckets), decode logits within transformers' own
bf16 error, and batch invariance with graphs on. Passed on the H200 on 2026-12-01 (commit 3717590). Async
scheduling (on by default with graphs) gives the tokens of the engine that waits for each step."""

import pytest
import torch

from kiln.llm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["Hello world", "Paged attention reads keys and values from blocks", "a",
           "In-flight batching admits new requests every step; prefix caching computes a shared prompt once."]


def generate(folder, graphs: bool, prompts, params, dtype="float32", **options):
    llm = LLM(folder, device="cuda", dtype=dtype, kv_cache_memory="64MiB", block_size=16, cuda_graphs=graphs,
              max_num_seqs=8, seed=11, **options)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm.engine.runner.num_graph_steps, outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("count", [1, 4])  # bucket sizes: the same GEMM shapes eagerly and graphed
def test_graphed_greedy_decode_equals_eager(hf_models, dtype, count):
    folder, _ = hf_models("llama")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eager, eager_steps, _ = generate(folder, False, PROMPTS[:count], params, dtype)
    graphed, graph_steps, _ = generate(folder, True, PROMPTS[:count], params, dtype)
    assert eager_steps == 0 and graph_steps >= 39
    assert graphed == eager


@pytest.mark.parametrize("name", ["qwen2", "gpt2", "mistral"])
def test_graphed_decode_other_models_and_padded_buckets(hf_models, name):
    folder, _ = hf_models(name)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eager, _, _ = generate(folder, False, PROMPTS[:3], params)  # 3 rows run in bucket 4: one padding row
    graphed, steps, _ = generate(folder, True, PROMPTS[:3], params)
    assert steps >= 29 and graphed == eager


def test_graphed_sampling_equals_eager(hf_models):
    folder, _ = hf_models("llama")
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_k=20, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=1.3, min_p=0.05, ignore_eos=True),  # engine-seeded
              SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=32, temperature=1.0, seed=9, ignore_eos=True)]
    eager, _, _ = generate(folder, False, PROMPTS, params)
    graphed, steps, _ = generate(folder, True, PROMPTS, params)
    assert steps >= 31 and graphed == eager
    assert len({tuple(t) for t in graphed}) == 4 and len(set(graphed[0])) > 5  # it did sample


def test_penalties_and_logprobs_through_the_graphs_logits(hf_models):
    folder, _ = hf_models("llama")
    params = [SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.7, seed=3, logprobs=3, ignore_eos=True)]
    eager, _, eager_outs = generate(folder, False, PROMPTS[:2], params)
    graphed, steps, graph_outs = generate(folder, True, PROMPTS[:2], params)
    assert steps >= 23 and graphed == eager
    a = [(lp.token_id, lp.logprob) for lp in eager_outs[1].outputs[0].logprobs]
    b = [(lp.token_id, lp.logprob) for lp in graph_outs[1].outputs[0].logprobs]
    assert [t for t, _ in a] == [t for t, _ in b]
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-5


def test_bf16_decode_logits_within_bf16_error_of_fp32(hf_models):
    """Each graphed decode step's logits (the graph's static buffer) against transformers' fp32 forward over
    the same tokens, within twice the error of transformers' own bf16 forward."""
    folder, hf = hf_models("llama")
    prompt = list(range(5, 40))
    llm = LLM(folder, device="cuda", dtype="bfloat16", kv_cache_memory="64MiB", block_size=16, max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    steps, rows, tokens = 0, [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if runner.num_graph_steps > steps:
            steps = runner.num_graph_steps
            rows.append(runner.graphs.logits[1][0].float().cpu())
    assert len(rows) == 11
    ids = torch.tensor([prompt + list(tokens)])
    with torch.no_grad():
        reference = hf.float()(ids).logits[0].float()
        hf_bf16 = hf.to("cuda", torch.bfloat16)(ids.cuda()).logits[0].float().cpu()
        hf.to("cpu", torch.float32)
    at = [len(prompt) + i for i in range(11)]  # decode step i+1 reads output token i at position P + i
    kiln = torch.stack(rows)
    assert (kiln - reference[at]).abs().max() <= 2 * (hf_bf16[at] - reference[at]).abs().max() + 1e-2


def test_batch_invariance_with_graphs(hf_models):
    folder, _ = hf_models("llama")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    together, steps, _ = generate(folder, True, PROMPTS, params)
    alone = [generate(folder, True, [p], params)[0][0] for p in PROMPTS]
    assert steps > 0 and together == alone


def test_graph_memory_is_measured_and_bounded(hf_models):
    folder, _ = hf_models("llama")
    llm = LLM(folder, device="cuda", dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=64)
    graphs = llm.engine.runner.graphs
    assert graphs.buckets == [1, 2, 4, 8, 16, 32, 64]
    assert 0 < graphs.memory_bytes < 256 * 2**20


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_draft_model_and_fp8_kv_on_cuda(hf_models, kv):
    """A draft model on CUDA (eager draft steps, graphed target decode between verifications): fp32 greedy and
    seeded sampling as without speculation; with an FP8 cache, the same with and without the draft."""
    folder, _ = hf_models("llama")
    for params in (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.7, seed=3, ignore_eos=True)):
        plain, _, _ = generate(folder, True, PROMPTS, params, kv_cache_dtype=kv)
        drafted, _, outs = generate(folder, True, PROMPTS, params, kv_cache_dtype=kv, speculative_model=str(folder),
                                    speculative_tokens=3)
        assert drafted == plain


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_gives_the_waiting_engines_tokens(hf_models, dtype):
    """Steps launched ahead (the next step's input ids gathered on the device, tokens back by an async copy)
    give the tokens of the engine that waits for each step, through requests stopping mid-batch on a token
    (as on EOS: the step planned ahead has a wasted row) and by length at different steps."""
    folder, _ = hf_models("llama")
    full = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    waiting, _, _ = generate(folder, True, PROMPTS, full, dtype, async_scheduling=False)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[waiting[0][9]]),
              SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[waiting[2][25]]),
              full]
    cut = [waiting[0][:waiting[0].index(waiting[0][9]) + 1], waiting[1][:17],
           waiting[2][:waiting[2].index(waiting[2][25]) + 1], waiting[3]]
    llm = LLM(folder, device="cuda", dtype=dtype, kv_cache_memory="64MiB", block_size=16, max_num_seqs=8, seed=11,
              async_scheduling=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, full)] == waiting
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == cut
    assert llm.engine.runner.graphs.num_launches >= 60
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks - 1
