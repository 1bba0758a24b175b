"""A kiln C kernel's launch outside a native segment at input sizes it has not met (native_member.RewrittenLaunch):
its size rule's fields written into a copy of one plan bound at the tuned sizes, no kernel built there. Before it,
each new size built the layer's kernel and a KernelBound with its four oneDNN memory objects (llama_tiny's two mask
Wheres, ~90 µs each of a first call at a new shape, bench/results/first-shape-2026-12-06.md).

Oracles: each op's registered implementation (torch), on fresh random inputs at fresh sizes (a batch and a sequence
of 1 included: a broadcast's rule takes other paths there). Exact ops (Where, Add, Cast, Gather) compared exactly;
the norms' float32 sums of up to 96 terms to 8e-5 absolute / 1e-4 relative. The checks that no kernel is built at
the new sizes fail without the rewrite (RewrittenLaunch.of answering None builds one per size)."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.tactics.cpu import native_member
from kiln.tactics.cpu.native_member import RewrittenLaunch
from kiln.tactics.tactic import PlanRule, SizedPlan
from tests.unit.test_tactics_cpu_transformer import prepared

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kiln's C kernels: {kernels.reason()}")

ATOL, RTOL = 8e-5, 1e-4  # the norms (float32 sums); the other ops exact


def _rng(case) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def _inputs(case: str, b: int, s: int, rng: np.random.Generator) -> tuple[list, dict, set[int]]:
    """(inputs, attributes, constant input indices) of a one-layer case at batch b, sequence s."""
    t = torch.from_numpy
    if case == "where mask":  # llama_tiny's Where(IsNaN(p), 0, p) and BERT's mask: a scalar fill, heads broadcast
        return [t(rng.random((b, 1, s, s)) < 0.5), t(np.array(0.0, np.float32)),
                t(rng.standard_normal((b, 4, s, s)).astype(np.float32))], {}, set()
    if case == "where rows":
        return [t(rng.random((b, s, 1)) < 0.5), t(rng.standard_normal((s, 6)).astype(np.float32)),
                t(rng.standard_normal((b, 1, 6)).astype(np.float32))], {}, set()
    if case == "add":
        return [t(rng.standard_normal((b, s, 24)).astype(np.float32)),
                t(rng.standard_normal((24,)).astype(np.float32))], {}, set()
    if case == "cast":
        return [t(rng.integers(-2, 3, (b, s)))], {"to": 9}, set()
    if case == "layer norm":
        return [t((rng.standard_normal((b, s, 96)) * 3 + 1).astype(np.float32)),
                t(rng.standard_normal(96).astype(np.float32)), t(rng.standard_normal(96).astype(np.float32))], \
            {"axis": -1, "epsilon": 1e-5}, {1, 2}
    if case == "rms norm":
        return [t(rng.standard_normal((b, s, 64)).astype(np.float32)), t(rng.standard_normal(64).astype(np.float32))], \
            {"epsilon": 1e-6}, {1}
    if case == "gather":
        return [t(rng.standard_normal((50, 16)).astype(np.float32)), t(rng.integers(0, 50, (b, s)))], {}, {0}
    raise AssertionError(case)


CASES = {"where mask": ("cpu.where.native", "Where", ""), "where rows": ("cpu.where.native", "Where", ""),
         "add": ("cpu.add.native", "Add", ""), "cast": ("cpu.cast.native", "Cast", ""),
         "layer norm": ("cpu.layernormalization.native", "LayerNormalization", ""),
         "rms norm": ("cpu.rmsnorm.native", "RMSNorm", "kiln"), "gather": ("cpu.gather.native", "Gather", "")}


def _built(monkeypatch) -> list[str]:
    """The kernels built from now on (each NativeKernel's `what`)."""
    made: list[str] = []
    real = kernels.NativeKernel.__init__
    caller = threading.get_ident()  # (not another test's engine's background job, under xdist)

    def counted(self, what):
        if threading.get_ident() == caller:
            made.append(what)
        real(self, what)
    monkeypatch.setattr(kernels.NativeKernel, "__init__", counted)
    return made


def _check(launch, op, ctx, inputs, attrs, exact: bool) -> None:
    got = launch(ctx, *inputs, **attrs)
    want = op(ctx, *[x.clone() for x in inputs], **attrs)
    want = want[0] if isinstance(want, tuple) else want
    assert got.shape == want.shape and got.dtype == want.dtype
    if exact:
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    else:
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_a_launch_at_new_sizes_builds_no_kernel_and_matches_the_op(case, monkeypatch):
    tactic, op_type, domain = CASES[case]
    rng = _rng(case)
    inputs, attrs, constant = _inputs(case, 2, 8, rng)
    launch, op, ctx = prepared(tactic, op_type, domain, inputs, attrs, constant)
    _check(launch, op, ctx, inputs, attrs, "norm" not in case)  # at the tuned sizes: the rewrite made here
    made = _built(monkeypatch)
    for b, s in [(1, 8), (3, 5), (2, 1), (1, 1), (4, 13), (3, 5)]:  # (3, 5) again: its kept plan
        fresh, _, _ = _inputs(case, b, s, rng)
        if constant:  # the layer's constants are its own (the tuned ones)
            fresh = [inputs[k] if k in constant else x for k, x in enumerate(fresh)]
        _check(launch, op, ctx, fresh, attrs, "norm" not in case)
    assert not made, made  # each size's plan rewritten, no kernel built


def test_without_the_rewrite_each_new_size_builds_its_kernel(monkeypatch):
    """The check above can fail: with RewrittenLaunch.of answering None (the tree before it) a new size builds."""
    monkeypatch.setattr(RewrittenLaunch, "of", classmethod(lambda cls, *a: None))
    tactic, op_type, domain = CASES["where mask"]
    rng = _rng("without")
    inputs, attrs, _ = _inputs("where mask", 2, 8, rng)
    launch, op, ctx = prepared(tactic, op_type, domain, inputs, attrs, set())
    _check(launch, op, ctx, inputs, attrs, True)
    made = _built(monkeypatch)
    _check(launch, op, ctx, _inputs("where mask", 3, 5, rng)[0], attrs, True)
    assert len(made) == 1


def test_sizes_the_rule_refuses_build_their_kernel(monkeypatch):
    """An Add whose larger operand changes sides: the rule refuses (other memory fields), the kernel there runs it
    and the answer is the op's; the refusal is kept (the kernel's path again at the next call)."""
    rng = _rng("add swapped")
    x, y = torch.from_numpy(rng.standard_normal((2, 8, 24)).astype(np.float32)), \
        torch.from_numpy(rng.standard_normal((24,)).astype(np.float32))
    launch, op, ctx = prepared("cpu.add.native", "Add", "", [x, y], {}, set())
    _check(launch, op, ctx, [x, y], {}, True)
    small = torch.from_numpy(rng.standard_normal((24,)).astype(np.float32))
    big = torch.from_numpy(rng.standard_normal((2, 3, 24)).astype(np.float32))
    made = _built(monkeypatch)
    for _ in range(2):
        _check(launch, op, ctx, [small, big], {}, True)
    assert len(made) == 1  # built at the first call there, kept for the second


def _tuned_where() -> tuple[kernels.Broadcast, dict[int, tuple[int, ...]]]:
    sizes = {0: (2, 1, 8, 8), 1: (), 2: (2, 4, 8, 8)}
    return kernels.Broadcast("where", [sizes[0], sizes[1], sizes[2]]), sizes


def _rule(answer) -> PlanRule:
    return PlanRule(answer, ("test rewritten launch", id(answer)))


def test_a_rule_that_does_not_give_back_the_kernels_plan_makes_no_rewrite():
    kernel, sizes = _tuned_where()

    def honest(at):
        out, fields = kernels.Broadcast.size_fields([at[0], at[1], at[2]])
        return SizedPlan((out,), fields)

    assert RewrittenLaunch.of(kernel, _rule(honest), sizes) is not None

    def wrong_dims(at):  # a field off by one at the tuned sizes
        out, fields = kernels.Broadcast.size_fields([at[0], at[1], at[2]])
        return SizedPlan((out,), dict(fields, dims=(*fields["dims"][:-1], fields["dims"][-1] + 1)))

    def unknown_field(at):
        out, fields = kernels.Broadcast.size_fields([at[0], at[1], at[2]])
        return SizedPlan((out,), dict(fields, nonesuch=1))

    def short_array(at):
        out, fields = kernels.Broadcast.size_fields([at[0], at[1], at[2]])
        return SizedPlan((out,), dict(fields, dims=fields["dims"][:-1]))

    def other_output(at):
        out, fields = kernels.Broadcast.size_fields([at[0], at[1], at[2]])
        return SizedPlan(((*out[:-1], out[-1] + 1),), fields)

    def refusing(at):
        raise ValueError("no")

    for rule in (wrong_dims, unknown_field, short_array, other_output, refusing):
        assert RewrittenLaunch.of(kernel, _rule(rule), sizes) is None, rule.__name__


def test_ones_covers_a_batch_and_a_sequence_of_one():
    found = native_member._ones({0: (2, 1, 8, 8), 1: (), 2: (2, 4, 8, 8)})
    assert {0: (1, 1, 8, 8), 1: (), 2: (1, 4, 8, 8)} in found  # batch 1
    assert {0: (2, 1, 1, 1), 1: (), 2: (2, 4, 1, 1)} in found  # sequence 1
    assert {0: (1, 1, 1, 1), 1: (), 2: (1, 1, 1, 1)} in found  # all three values
    assert len(found) == 7
