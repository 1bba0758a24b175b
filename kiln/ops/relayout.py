"""kiln::Relayout: a chain of Reshapes and Transposes as one permutation of elements.

    y = x.reshape(dims).permute(perm).reshape(shape)

Every chain of Reshape / Transpose / Flatten / Squeeze / Unsqueeze moves x's elements by one such map
(kiln/passes/fusion/relayout.py finds dims and perm); MobileViT's unfold ([1, C, H, W] -> [4, H*W/4, C],
five ONNX nodes) is one. `strided_form` is the algebra both the pass and the CPU kernel
(kiln/kernels/cpu/relayout.py) use: which strided walk of a source gives an index table.
"""

from __future__ import annotations

import numpy as np

from kiln.ops.registry import register

# An index table costs 4 bytes an element at build: past this many elements the pass and the kernel refuse
TABLE_LIMIT = 1 << 26


@register("Relayout", domain="kiln")
def relayout(ctx, x, *, dims, perm, shape):
    """x [..] -> x.reshape(dims).permute(perm).reshape(shape), a copy (row-major) of x's elements."""
    return x.reshape([int(d) for d in dims]).permute([int(p) for p in perm]).reshape([int(s) for s in shape])


def strided_form(table: np.ndarray) -> list[tuple[int, int]] | None:
    """[(size, stride)] outer to inner such that table.reshape(-1)[i] == sum(index_k(i) * stride_k) where
    index_k are the digits of i in the mixed radix of the sizes (the walk of a strided view), or None when
    no strided walk gives the table. Dims that merge are merged (at most as many as the table needs).

    Greedy from the innermost: a dim's run is as long as the table stays linear in steps of the block
    below it; a run that is a whole number of true dims is what a strided table gives, and the end check
    makes a wrong guess a None, never a wrong answer."""
    flat = np.asarray(table).reshape(-1).astype(np.int64)
    n = flat.size
    if n == 0:
        return None
    base = int(flat[0])
    found: list[tuple[int, int]] = []  # inner to outer
    block = 1
    while block < n:
        stride = int(flat[block]) - base
        steps = flat[::block] - base  # the table at the starts of each block
        run = 1
        while run < steps.size and steps[run] == run * stride:
            run += 1
        while (n // block) % run:  # a run ends at a dim boundary: it divides what is left
            run -= 1
        if run <= 1:
            return None
        found.append((run, stride))
        block *= run
    if base != 0 and found:
        return None  # a table that does not start at its source's first element is not a permutation's
    form = found[::-1]
    if not _walks(form, flat):
        return None
    return form or [(1, 1)]


def _walks(form: list[tuple[int, int]], flat: np.ndarray) -> bool:
    """Whether the strided walk `form` (outer to inner) gives exactly `flat`."""
    walk = np.zeros(1, dtype=np.int64)
    for size, stride in form:
        walk = (walk[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return walk.size == flat.size and bool(np.array_equal(walk, flat))


def dims_and_perm(form: list[tuple[int, int]], numel: int) -> tuple[list[int], list[int]] | None:
    """A strided walk of a row-major source of `numel` elements as (dims, perm): the source reshaped to
    dims, permuted by perm, is walked in order. None when the strides are not a row-major refinement."""
    order = sorted(range(len(form)), key=lambda k: -form[k][1])  # source dims, outermost first
    dims = [form[k][0] for k in order]
    expected = 1
    for k in reversed(order):  # strides of a row-major [dims]: each the product of the sizes inside it
        if form[k][1] != expected:
            return None
        expected *= form[k][0]
    if expected != numel:
        return None
    perm = [order.index(k) for k in range(len(form))]
    return dims, perm
