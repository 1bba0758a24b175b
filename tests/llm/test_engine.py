"""The engine end to end on the CPU (fp32): batch invariance, chunked prefill, preemption and prefix
caching leave every request's tokens unchanged; streaming, cancellation, stop strings and tokens,
seeds, penalties against transformers, speculative n-gram decoding exact under greedy."""

import random

import pytest
import torch

from kiln.llm import LLM, LLMError, SamplingParams

PROMPTS = ["Hello world, hello", "The quick brown fox jumps over the lazy dog. The quick brown",
           "Paged attention", "In-flight batching admits new requests every step; prefix caching", "Ü 日本語", "a"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def make(folder, **options):
    return LLM(folder, **{"kv_cache_memory": "4MiB", "block_size": 4, **options})


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models("llama")[0]


@pytest.fixture(scope="module")
def alone(llama):
    """Each prompt run by itself: the reference for every batching test."""
    llm = make(llama)
    return [tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


def test_batch_invariance_greedy(llama, alone):
    llm = make(llama)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == alone
    assert tokens(llm.generate(PROMPTS[::-1], GREEDY)) == alone[::-1]
    # requests arriving while others decode (streamed: the engine admits each into a running batch)
    seen = {}
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY, request_id=str(i))
        for out in engine.step():
            seen[out.request_id] = out
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id] = out
    assert [seen[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == alone


def test_chunked_prefill_and_small_steps_change_nothing(llama, alone):
    llm = make(llama, max_num_batched_tokens=5, max_num_seqs=3)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == alone


def test_preemption_by_recompute_changes_nothing(llama, alone):
    # 15 usable blocks of 4 tokens: six requests growing to ~40 tokens cannot all fit
    llm = make(llama, num_kv_blocks=16, max_model_len=60, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.stats.num_preemptions > 0
    llm = make(llama, num_kv_blocks=16, max_model_len=60)  # with prefix caching: resumes from cached blocks
    assert tokens(llm.generate(PROMPTS, GREEDY)) == alone
    assert llm.engine.stats.num_preemptions > 0


def test_prefix_caching_computes_a_shared_prompt_once(llama):
    llm = make(llama)
    system = "You are a helpful assistant. Answer briefly and precisely, please. "
    first = llm.generate([system + "Hello"], GREEDY)[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate([system + "Hello", system + "The quick"], GREEDY)
    shared = len(llm.tokenizer.encode(system + "Hello")) - 1
    assert outs[0].num_cached_tokens == shared // 4 * 4  # all but the last token, in whole blocks
    assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
    blocks = llm.engine.block_manager
    assert blocks.prefix_hits > 0 and blocks.num_free_blocks == blocks.num_blocks - 1
    no_cache = make(llama, enable_prefix_caching=False)
    assert tokens(no_cache.generate([system + "The quick"], GREEDY)) == tokens(outs[1:])


def test_n_samples_share_the_prompt_and_seeded_samples_are_batch_invariant(llama):
    llm = make(llama)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, n=3)
    together = llm.generate(PROMPTS[:3], params)
    assert [len(o.outputs) for o in together] == [3, 3, 3]
    assert len({tuple(c.token_ids) for c in together[0].outputs}) > 1  # n children draw different seeds
    for prompt, out in zip(PROMPTS[:3], together):
        again = make(llama, max_num_batched_tokens=7).generate([prompt], params)[0]
        assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    unseeded = [llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=1.0))[0] for _ in range(3)]
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_filters_that_keep_one_token_are_greedy(llama, alone):
    llm = make(llama)
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        sampled = SamplingParams(max_tokens=20, temperature=1.5, ignore_eos=True, **params)
        assert tokens(llm.generate(PROMPTS[:2], sampled)) == alone[:2], params


def test_repetition_penalty_matches_transformers(hf_models):
    folder, hf = hf_models("llama")
    llm = make(folder)
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.5,
                                                ignore_eos=True))[0]
    ids = torch.tensor([prompt])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                           repetition_penalty=1.5, eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected
    plain = tokens(llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))[0]
    assert plain != expected  # the penalty did something


def test_streaming_deltas_add_up_to_the_final_output(llama, alone):
    llm = make(llama)
    texts, ids, finals = {}, {}, {}
    for out in llm.stream(PROMPTS, GREEDY):
        c = out.outputs[0]
        texts[out.request_id] = texts.get(out.request_id, "") + c.delta_text
        ids[out.request_id] = ids.get(out.request_id, []) + c.delta_token_ids
        if out.finished:
            finals[out.request_id] = c
    assert len(finals) == len(PROMPTS)
    for request_id, final in finals.items():
        assert texts[request_id] == final.text and ids[request_id] == final.token_ids
    assert sorted(ids.values()) == sorted(alone)


def test_closing_a_stream_cancels_and_frees_blocks(llama):
    llm = make(llama)
    blocks = llm.engine.block_manager
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=50, temperature=0))
    next(stream)
    assert blocks.num_free_blocks < blocks.num_blocks - 1
    stream.close()
    assert not llm.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks - 1
    assert llm.engine.abort("no-such-request") is False


def test_stop_strings_cut_the_text(llama, alone):
    llm = make(llama)
    full = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0]
    stop = full.text[5:8]
    assert stop and stop in full.text
    cut = full.text[:full.text.index(stop)]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0, stop=[stop, "never"]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (cut, "stop", stop)
    assert full.token_ids[:len(out.token_ids)] == out.token_ids
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0, stop=stop,
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == cut + stop
    streamed = "".join(o.outputs[0].delta_text for o in llm.stream(
        [PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0, stop=[stop])))
    assert streamed == cut  # never sent past the stop, though it arrived token by token


def test_stop_token_ids_and_eos(llama, alone):
    llm = make(llama)
    target = alone[0][3]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[target]))[0]
    first = alone[0].index(target)
    assert out.outputs[0].token_ids == alone[0][:first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", target)


def test_speculative_ngram_is_exact_under_greedy(llama):
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
               "Hello world, hello world, hello world, hello"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = tokens(make(llama).generate(prompts, params))
    llm = make(llama, speculative_ngram=4)
    assert tokens(llm.generate(prompts, params)) == expected
    stats = llm.engine.stats
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0
    sampled = SamplingParams(max_tokens=10, temperature=0.7, seed=3)
    assert tokens(llm.generate(prompts, sampled)) == tokens(make(llama).generate(prompts, sampled))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0.3, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, presence_penalty=0.2, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.5, frequency_penalty=0.5, seed=2, ignore_eos=True),
], ids=["sampled", "top-k/top-p", "greedy+penalties", "sampled+penalties"])
def test_speculation_is_exact_for_sampled_and_penalized_requests(llama, params):
    """Drafts for every request: a seeded draw depends on the position only, and each draft row's penalties
    see the history it has if the drafts before it are accepted: the same tokens as without speculation."""
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
               "Hello world, hello world, hello world, hello"]
    expected = tokens(make(llama).generate(prompts, params))
    llm = make(llama, speculative_ngram=4)
    assert tokens(llm.generate(prompts, params)) == expected
    assert llm.engine.stats.draft_tokens > 0


def test_bad_requests(llama):
    llm = make(llama, max_model_len=32)
    with pytest.raises(LLMError, match="length limit is 32"):
        llm.generate(["word " * 40])
    with pytest.raises(LLMError, match="outside the vocabulary"):
        llm.generate([[5, 100000]])
    with pytest.raises(LLMError, match="top_p must be in"):
        SamplingParams(top_p=0)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("seed", range(6))
def test_random_engine_settings_never_change_greedy_tokens(llama, alone, seed):
    """Block size, step budget, seats, cache size (preemption), prefix caching, chunking and drafts drawn
    at random: every request still gets exactly the tokens it gets alone."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 8, 16])
    options = dict(block_size=block_size, max_num_batched_tokens=rng.choice([3, 7, 64]),
                   max_num_seqs=rng.choice([1, 2, 5]), enable_prefix_caching=rng.random() < 0.7,
                   enable_chunked_prefill=True, speculative_ngram=rng.choice([0, 0, 3]), max_model_len=80,
                   num_kv_blocks=rng.choice([80 // block_size + 2, 400 // block_size]))
    llm = LLM(llama, **options)
    order = rng.sample(range(len(PROMPTS)), len(PROMPTS))
    outs = llm.generate([PROMPTS[i] for i in order], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [alone[i] for i in order], options
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks - 1 and not llm.engine.has_unfinished()


def test_cuda_graphs_refused_where_they_cannot_run(hf_models):
    from kiln.llm import LLM
    from kiln.llm.config import LLMError

    folder, _ = hf_models("llama")
    with pytest.raises(LLMError, match="cuda_graphs needs a CUDA device"):
        LLM(folder, device="cpu", kv_cache_memory="2MiB", cuda_graphs=True)
    assert LLM(folder, device="cpu", kv_cache_memory="2MiB").engine.runner.graphs is None  # auto: off on the CPU
