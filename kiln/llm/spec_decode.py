"""Speculative decoding's draft proposer: n-gram prompt lookup. The request's latest n tokens
(n from ngram_max down to ngram_min) are looked up earlier in its own tokens; the tokens that followed
the most recent match are the drafts. The model checks them all in one step (a request with k drafts
computes k + 1 positions) and keeps the ones its own choice agrees with, plus its next token: the output is
exactly the plain decoding's, in fewer steps when text repeats (code, quotes, extraction). Greedy and sampled
requests alike: the sampler's draw for a position is a function of the request's seed and that position only
(kiln/llm/sampling.py), and penalties see each draft row's history as it would be were the drafts accepted, so a
sampled request draws the same tokens with or without drafts."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], num_drafts: int, ngram_min: int, ngram_max: int) -> list[int]:
    total = len(token_ids)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        pattern = token_ids[total - n:]
        for start in range(total - n - 1, -1, -1):  # latest earlier occurrence first
            if token_ids[start:start + n] == pattern:
                return token_ids[start + n:start + n + num_drafts]
    return []
