"""String ops on numpy object arrays: normalizing, concatenating, splitting, regex, n-grams."""

from __future__ import annotations

import re

import numpy as np
import torch

from kiln.ops._util import to_numpy
from kiln.ops.registry import register


def _strings(x) -> np.ndarray:
    return np.asarray(x, dtype=object)


@register("StringNormalizer", min_opset=10)
def string_normalizer(ctx, X, *, case_change_action="NONE", is_case_sensitive=0, locale="",
                      stopwords=None):
    """X [C] or [1, C]: drop stop words (whole elements), then change case."""
    x = _strings(X)
    words = list(x.reshape(-1))
    if stopwords:
        if is_case_sensitive:
            stops = set(stopwords)
            words = [w for w in words if w not in stops]
        else:
            stops = {s.lower() for s in stopwords}
            words = [w for w in words if w.lower() not in stops]
    if case_change_action == "LOWER":
        words = [w.lower() for w in words]
    elif case_change_action == "UPPER":
        words = [w.upper() for w in words]
    elif case_change_action != "NONE":
        raise ValueError(f"StringNormalizer: unknown case_change_action {case_change_action!r}")
    out = np.array(words or [""], dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


@register("StringConcat", min_opset=20)
def string_concat(ctx, X, Y):
    x, y = np.broadcast_arrays(_strings(X), _strings(Y))
    out = np.empty(x.shape, dtype=object)
    out.reshape(-1)[:] = [a + b for a, b in zip(x.reshape(-1), y.reshape(-1))]
    return out


@register("StringSplit", min_opset=20)
def string_split(ctx, X, *, delimiter="", maxsplit=None):
    """-> (Y [..., max parts] padded with "", Z [...] int64 part counts).

    No delimiter splits on runs of whitespace, like Python's str.split().
    """
    x = _strings(X)
    sep = delimiter or None
    limit = -1 if maxsplit is None else maxsplit
    parts = [s.split(sep, limit) for s in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    out = np.full((len(parts), width), "", dtype=object)
    for i, p in enumerate(parts):
        out[i, : len(p)] = p
    return out.reshape(*x.shape, width), torch.from_numpy(counts)


@register("RegexFullMatch", min_opset=20)
def regex_full_match(ctx, X, *, pattern):
    """RE2 patterns run on Python's re, which accepts the RE2 syntax ONNX models use."""
    regex = re.compile(pattern)
    x = _strings(X)
    matched = np.array([regex.fullmatch(s) is not None for s in x.reshape(-1)], dtype=bool)
    return torch.from_numpy(matched.reshape(x.shape))


@register("TfIdfVectorizer", min_opset=9)
def tfidf_vectorizer(ctx, X, *, max_gram_length, max_skip_count, min_gram_length, mode,
                     ngram_counts, ngram_indexes, pool_int64s=None, pool_strings=None,
                     weights=None):
    """Count the pool's n-grams (with up to max_skip_count skipped items between members).

    X [C] -> [output_size]; X [B, C] -> [B, output_size]. Unigrams are counted once, not once
    per skip distance.
    """
    pool = list(pool_strings) if pool_strings else [int(v) for v in (pool_int64s or [])]
    grams: dict[tuple, int] = {}  # n-gram -> output column
    bounds = list(ngram_counts) + [len(pool)]
    gram_id = 0
    for size_minus_one, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        size = size_minus_one + 1
        for offset in range(start, end, size):
            grams[tuple(pool[offset : offset + size])] = ngram_indexes[gram_id]
            gram_id += 1
    output_size = max(ngram_indexes) + 1
    x = to_numpy(X)
    rows = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    counts = np.zeros((rows.shape[0], output_size), dtype=np.float32)
    for r, row in enumerate(rows):
        items = row.tolist()
        for size in range(max(min_gram_length, 1), max_gram_length + 1):
            skips = range(1) if size == 1 else range(max_skip_count + 1)
            for skip in skips:
                step = skip + 1
                for start in range(len(items) - (size - 1) * step):
                    column = grams.get(tuple(items[start : start + (size - 1) * step + 1 : step]))
                    if column is not None:
                        counts[r, column] += 1
    if mode == "TF":
        out = counts
    elif mode == "IDF":
        out = (counts > 0).astype(np.float32)
        if weights:
            out = out * np.asarray(weights, dtype=np.float32)
    elif mode == "TFIDF":
        out = counts * np.asarray(weights, dtype=np.float32) if weights else counts
    else:
        raise ValueError(f"TfIdfVectorizer: unknown mode {mode!r}")
    out = torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
    return out[0] if x.ndim == 1 else out
