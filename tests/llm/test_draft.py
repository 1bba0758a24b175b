"""Speculative decoding with a draft model (kiln/llm/draft.py) on the CPU, fp32: whatever the draft proposes,
greedy outputs are exactly the target's own greedy decoding; a draft that is the target itself has its
proposals accepted; a draft of another vocabulary is refused by name; a draft KV cache too small for a
request leaves that request undrafted, not wrong."""

import pytest

from kiln.llm import LLM, LLMError, SamplingParams
from tests.llm import checkpoints

PROMPTS = ["Hello world, hello", "The quick brown fox jumps over the lazy dog. The quick brown", "a",
           "Paged attention reads keys and values from blocks"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def make(folder, **options):
    return LLM(folder, **{"device": "cpu", "kv_cache_memory": "4MiB", "block_size": 4, **options})


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def target(hf_models):
    return hf_models("llama")[0]


@pytest.fixture(scope="module")
def expected(target):
    return tokens(make(target).generate(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Another Llama of the same vocabulary, its own random weights and a smaller shape."""
    folder, _ = checkpoints.llama(tmp_path_factory.mktemp("draft"), seed=21, num_hidden_layers=1)
    return folder


def test_the_target_as_its_own_draft_is_accepted(target, expected):
    llm = make(target, speculative_model=str(target), speculative_tokens=3)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    stats = llm.engine.stats
    assert stats.draft_tokens > 0
    assert stats.accepted_draft_tokens >= 0.9 * stats.draft_tokens  # the same model: near-ties aside, all
    assert not llm.engine.draft.sequences  # finished requests freed their draft blocks


@pytest.mark.parametrize("k", [1, 4])
def test_another_draft_changes_no_token(target, expected, other_draft, k):
    llm = make(target, speculative_model=str(other_draft), speculative_tokens=k)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    stats = llm.engine.stats
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens < stats.draft_tokens
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=5)  # not greedy: no drafts, the same samples
    assert tokens(llm.generate(PROMPTS, sampled)) == tokens(make(target).generate(PROMPTS, sampled))


def test_batching_preemption_and_a_small_draft_cache_change_no_token(target, expected, other_draft):
    llm = make(target, speculative_model=str(other_draft), speculative_tokens=3, max_num_batched_tokens=7,
               kv_cache_memory="40KiB", max_model_len=64, speculative_kv_cache_memory="6KiB", block_size=2)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    stats = llm.engine.stats
    assert stats.draft_tokens > 0 and stats.num_preemptions > 0, (stats.draft_tokens, stats.num_preemptions)


def test_a_draft_of_another_vocabulary_is_refused(target, tmp_path):
    folder, _ = checkpoints.llama(tmp_path / "wide", seed=3, vocab_size=600)
    with pytest.raises(LLMError, match="vocabulary has 600 tokens"):
        make(target, speculative_model=str(folder))
    with pytest.raises(LLMError, match="no config.json"):
        make(target, speculative_model=str(tmp_path / "missing"))
    with pytest.raises(LLMError, match="choose one proposer"):
        make(target, speculative_model=str(folder), speculative_ngram=2)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0, frequency_penalty=1.0, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.7, presence_penalty=0.8, seed=4, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.6, seed=9, ignore_eos=True),
], ids=["greedy+frequency", "sampled+presence", "sampled"])
def test_penalized_and_sampled_requests_draw_what_they_draw_without_drafts(target, params):
    """The target as its own draft proposes its unpenalized greedy tokens: many are accepted, so the rows after
    an accepted draft must see it in their penalties' history, as the plain step would."""
    expected = tokens(make(target).generate(PROMPTS, params))
    llm = make(target, speculative_model=str(target), speculative_tokens=3)
    assert tokens(llm.generate(PROMPTS, params)) == expected
    assert llm.engine.stats.accepted_draft_tokens > 0
