"""The sampler on known logits: greedy, the distribution it samples (temperature, top-k, top-p, min-p),
penalties by formula, seeds independent of the batch, raw log-probabilities."""

import math

import pytest
import torch

from kiln.llm.sampling import Sampler
from kiln.llm.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
V = LOGITS.numel()
N = 20000  # rows sampled at once: frequencies within ~4 sigma of the probabilities


def sample(params: SamplingParams, rows: int = N, logits=LOGITS, seed: int = 0, histories=None):
    sampler = Sampler(logits.numel(), torch.device("cpu"), seed=seed)
    batch = logits.expand(rows, -1).clone()
    histories = histories or [[0]] * rows
    return sampler(batch, [params] * rows, [f"r{i}" for i in range(rows)], histories, [1] * rows)


def frequencies(params: SamplingParams) -> torch.Tensor:
    return torch.bincount(sample(params).token_ids, minlength=V).float() / N


def assert_distribution(freq: torch.Tensor, probs: torch.Tensor):
    sigma = (probs * (1 - probs) / N).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-9).all(), (freq, probs)


def test_greedy_is_argmax():
    out = sample(SamplingParams(temperature=0), rows=3)
    assert out.token_ids.tolist() == [0, 0, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_samples_follow_softmax_over_temperature(temperature):
    assert_distribution(frequencies(SamplingParams(temperature=temperature)), torch.softmax(LOGITS / temperature, 0))


def test_top_k_keeps_the_k_best():
    probs = torch.softmax(LOGITS[:3], 0)
    assert_distribution(frequencies(SamplingParams(top_k=3)), torch.cat([probs, torch.zeros(3)]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, 0)  # 0.574, 0.211, 0.128, ...: 0.7 needs the first two
    assert full[0] < 0.7 <= full[:2].sum()
    kept = torch.softmax(LOGITS[:2], 0)
    assert_distribution(frequencies(SamplingParams(top_p=0.7)), torch.cat([kept, torch.zeros(4)]))


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    full = torch.softmax(LOGITS, 0)
    keep = full >= 0.2 * full.max()  # tokens 0, 1, 2
    assert keep.tolist() == [True, True, True, False, False, False]
    expected = torch.where(keep, full, torch.zeros(V))
    assert_distribution(frequencies(SamplingParams(min_p=0.2)), expected / expected.sum())


def test_penalties_by_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0, 0.0]])
    history = [3, 1, 1, 2]  # prompt [3], output [1, 1, 2]
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = Sampler(V, torch.device("cpu"))._penalize(logits.clone(), [params], [history], [1])
    expected = logits.clone()[0]
    expected[3] = 1.0 / 2  # seen in the prompt: positive / penalty
    expected[1] = -1.0 * 2 - 0.5 * 2 - 0.25  # generated twice: negative * penalty, then frequency, presence
    expected[2] = 0.5 / 2 - 0.5 - 0.25
    torch.testing.assert_close(got[0], expected)


def test_seeded_rows_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(V, torch.device("cpu"))(LOGITS[None].clone(), [params], ["a"], [[0]], [1]).token_ids.item()
    sampler = Sampler(V, torch.device("cpu"), seed=7)
    mixed = [SamplingParams(temperature=1.0), params, SamplingParams(temperature=0.3)]
    batch = sampler(LOGITS.expand(3, -1).clone(), mixed, ["x", "a", "y"], [[0]] * 3, [1] * 3)
    assert batch.token_ids[1].item() == alone
    # a request's draw depends on its seed and position only: 20 positions alone == the same among others
    s1, s2 = Sampler(V, torch.device("cpu")), Sampler(V, torch.device("cpu"))
    seq1 = [s1(LOGITS[None].clone(), [params], ["a"], [[0] * n], [1]).token_ids.item() for n in range(1, 21)]
    seq2 = [s2(LOGITS.expand(2, -1).clone(), [SamplingParams(temperature=1.0), params], ["z", "a"], [[0] * 7, [0] * n],
               [1] * 2).token_ids[1].item() for n in range(1, 21)]
    assert seq1 == seq2 and len(set(seq1)) > 1
    # the same position again (a request recomputed after preemption) draws the same token
    again = [s1(LOGITS[None].clone(), [params], ["b"], [[0] * n], [1]).token_ids.item() for n in range(1, 21)]
    assert again == seq1


def test_engine_seed_fixes_unseeded_requests():
    params = [SamplingParams(temperature=1.0)] * 64
    draws = [Sampler(V, torch.device("cpu"), seed=s)(LOGITS.expand(64, -1).clone(), params, [f"r{i}" for i in range(64)],
                                                     [[0]] * 64, [1] * 64).token_ids.tolist() for s in (3, 3, 4)]
    assert draws[0] == draws[1] != draws[2]


def test_counter_based_draws_are_uniform():
    """u = hash(key, token): uniform on (0, 1) per token and independent across rows and tokens, by moments
    and by a chi-square over 16 bins (10^6 draws)."""
    from kiln.llm.sampling import mix32, row_keys

    keys = row_keys(torch.arange(1000, dtype=torch.int64), torch.zeros(1000, dtype=torch.int64),
                    torch.arange(1000, dtype=torch.int64) * 7)
    vocab_keys = mix32(torch.arange(1000, dtype=torch.int64) + 0x9E3779B9)
    u = ((mix32(keys[:, None] ^ vocab_keys[None, :]) >> 8).double() + 0.5) / 2 ** 24
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.bincount((u * 16).long().flatten(), minlength=16).double()
    chi2 = (((counts - u.numel() / 16) ** 2) / (u.numel() / 16)).sum().item()
    assert chi2 < 45  # 15 degrees of freedom: p ~ 1e-4
    corr = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()
    assert abs(corr) < 5e-3


def test_logprobs_are_of_the_raw_logits():
    out = sample(SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=1.3), rows=4)
    expected = torch.log_softmax(LOGITS, 0)
    torch.testing.assert_close(out.logprobs, expected[out.token_ids])
    assert out.top_ids[0].tolist() == [0, 1]
    assert out.top_logprobs[0].tolist() == pytest.approx(expected[:2].tolist())
    assert math.isclose(out.top_logprobs[0].exp().sum().item() + expected[2:].exp().sum().item(), 1, rel_tol=1e-6)
