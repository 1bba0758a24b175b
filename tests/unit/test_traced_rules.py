"""TracedRule (kiln/tactics/traced_rules.py): a size rule answered from its traced closed forms must give the rule's
own answer at every size, whatever the rule reads: products of dims, thresholds on them, values read as ints,
comparisons between inputs, type checks, C calls."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from kiln.tactics import traced_rules
from kiln.tactics.cpu.attention import attention_plan
from kiln.tactics.tactic import PlanRule, SizedPlan
from kiln.tactics.traced_rules import TracedRule


def _counted(function):
    """A PlanRule of `function` that counts its runs (plain ints or symbols)."""
    runs = []

    def rule(sizes):
        runs.append(sizes)
        return function(sizes)

    return PlanRule(rule, ("test", id(runs)), traceable=True), runs


def _gemm_like(size):  # rows = prod(leading dims); a thread count by a threshold on rows; strides
    rows = math.prod(size[:-1])
    return SizedPlan(((*size[:-1], 64),), {"M": rows, "threads": 1 if rows * size[-1] <= 4096 else 0,
                                           "strides": (size[1] * size[2], size[2], 1)})


def _fresh_sizes(rng, count):
    return [(int(b), int(s), 32) for b, s in zip(rng.integers(1, 9, count), rng.integers(1, 300, count))]


def test_answers_equal_the_rule_at_fresh_sizes_and_follow_few_paths():
    rng = np.random.default_rng()
    rule, runs = _counted(_gemm_like)
    traced = TracedRule(rule)
    for size in _fresh_sizes(rng, 200):
        assert traced(size) == _gemm_like(size), size
    # paths: one per threshold outcome (rows*32 <= 4096 or not), each run twice (ints, then symbols)
    assert traced._paths <= 2 and len(runs) <= 2 * traced._paths + 2


def _two_inputs(sizes):  # a layer reading inputs 0 and 2 (a view's dict of input index -> size), in that order
    a, b = sizes[0], sizes[2]
    rows = math.prod(a[:-1])
    return SizedPlan(((*a[:-1], b[-1]),), {"M": rows, "K": a[-1], "N": b[-1], "big": rows > 64,
                                           "strides": (a[1] * a[2], b[0] * b[1])})


def test_at_equals_the_call_on_the_dict_or_the_one_size_and_answers_from_the_trace():
    """TracedRule.at (what a view asks: input indices and their sizes as tuples) gives __call__'s answer on the dict
    (or, one input, on the size) at fresh sizes, from the traced paths once they are traced (the rule not run), and
    never a traced answer for a structure naming an input twice (a dict of those would hold one)."""
    rng = np.random.default_rng()
    rule, runs = _counted(_two_inputs)
    traced = TracedRule(rule)
    for b, s, k, n in zip(rng.integers(1, 9, 100), rng.integers(1, 200, 100), rng.integers(1, 64, 100),
                          rng.integers(1, 64, 100)):
        a_size, b_size = (int(b), int(s), int(k)), (int(k), int(s), int(n))
        want = _two_inputs({0: a_size, 2: b_size})
        got = traced.at((0, 2), (a_size, b_size))
        assert got == want and list(got.fields) == list(want.fields), (a_size, b_size)
    assert len(runs) <= 2 * traced._paths + 2  # at most the traces' runs: the others answered from them
    one = lambda sizes: SizedPlan((sizes[0],), {"n": sizes[0][0] * sizes[0][1]})  # noqa: E731
    keyed = TracedRule(_counted(one)[0])
    keyed.at((0,), ((2, 3),))  # traced at structure ((0, 2),)
    assert keyed.at((0, 0), ((2, 3), (5, 7))) == one({0: (5, 7)})  # the dict's answer: the last size kept
    single, _ = _counted(_gemm_like)
    alone, by_call = TracedRule(single), TracedRule(_counted(_gemm_like)[0])
    for size in _fresh_sizes(rng, 50):
        assert alone.at(None, (size,)) == by_call(size) == _gemm_like(size), size


def test_a_new_batch_at_a_known_sequence_is_not_a_new_path():
    rule, runs = _counted(lambda size: SizedPlan((size,), {"count": size[0] * size[1]}))
    traced = TracedRule(rule)
    assert traced((1, 7)) == SizedPlan(((1, 7),), {"count": 7})
    ran = len(runs)
    assert traced((5, 7)) == SizedPlan(((5, 7),), {"count": 35})
    assert traced((3, 11)) == SizedPlan(((3, 11),), {"count": 33})
    assert len(runs) == ran  # answered from the closed form


def test_a_dim_read_as_an_int_keys_the_answer():
    """A rule that reads a dim's value (int()) is not served another size's answer."""
    rule, _ = _counted(lambda size: SizedPlan((size,), {"n": int(size[0]) + 0 * size[1]}))
    traced = TracedRule(rule)
    for b, s in [(2, 3), (5, 3), (2, 9), (7, 9), (2, 3)]:
        assert traced((b, s)).fields == {"n": b}


def test_a_rule_reading_another_dim_by_comparison_is_not_stale():
    """Two inputs' dims compared (a broadcast's rule): the outcome is a guard, so a size where they compare otherwise
    runs the rule."""
    def rule(sizes):
        a, b = sizes[0], sizes[1]
        out = tuple(x if x != 1 else y for x, y in zip(a, b))
        return SizedPlan((out,), {"strides": tuple(0 if x == 1 and y != 1 else 1 for x, y in zip(a, b))})

    traced = TracedRule(PlanRule(rule, ("broadcast-like",), traceable=True))
    rng = np.random.default_rng()
    for _ in range(300):
        a = tuple(int(v) for v in rng.choice([1, 2, 3], 3))
        b = tuple(int(v) if x == 1 else x for v, x in zip(rng.choice([1, 2, 3], 3), a))
        assert traced({0: a, 1: b}) == rule({0: a, 1: b}), (a, b)


def test_fields_keep_the_rules_order():
    """A view writes a rule's fields in their order: an answer for sizes given in another order is the rule's own,
    order included."""
    def rule(sizes):
        return SizedPlan((sizes[0],), {f"n{k}": size[0] * 2 for k, size in sizes.items()})

    traced = TracedRule(PlanRule(rule, ("ordered",), traceable=True))
    for sizes in ({0: (3,), 1: (4,)}, {1: (5,), 0: (6,)}, {0: (7,), 1: (8,)}, {1: (9,), 0: (2,)}):
        answer = traced(sizes)
        assert answer == rule(sizes) and list(answer.fields) == list(rule(sizes).fields), sizes


def test_a_rule_branching_on_type_is_run_always():
    """isinstance(d, int) is False for a symbol: the trace's answer differs from the rule's, and the rule is kept
    untraced (its answers are its own)."""
    rule, runs = _counted(lambda size: SizedPlan((size,), {"n": size[0] if isinstance(size[0], int) else 0}))
    traced = TracedRule(rule)
    for b in (3, 4, 5):
        assert traced((b, 2)).fields == {"n": b}
    assert not traced._traceable


def test_a_rule_passing_a_dim_to_c_reads_its_value():
    def rule(size):
        return SizedPlan((size,), {"n": ctypes.c_long(size[0]).value * size[1]})

    traced = TracedRule(PlanRule(rule, ("c",), traceable=True))
    for b, s in [(2, 3), (5, 3), (5, 4)]:
        assert traced((b, s)).fields == {"n": b * s}


def test_a_rule_raising_raises_through_the_trace():
    def rule(size):
        if size[0] > 4:
            raise ValueError(f"too wide: {size}")
        return SizedPlan((size,), {"n": size[0]})

    traced = TracedRule(PlanRule(rule, ("raising",), traceable=True))
    assert traced((2,)).fields == {"n": 2}
    with pytest.raises(ValueError, match="too wide"):
        traced((7,))
    assert traced((3,)).fields == {"n": 3}


def test_a_rule_not_marked_traceable_is_run_with_ints_only():
    """A rule with a side effect (here a cache of what it saw, as a kernel-making rule has) is never run with
    symbols: nothing it keeps holds one."""
    seen = {}

    def rule(size):
        seen[size] = True
        return SizedPlan((size,), {"n": size[0] * size[1]})

    traced = TracedRule(PlanRule(rule, ("kernel-like",)))
    for b, s in [(2, 3), (5, 3), (5, 4)]:
        assert traced((b, s)).fields == {"n": b * s}
    assert list(seen) == [(2, 3), (5, 3), (5, 4)] and all(type(d) is int for size in seen for d in size)


def test_paths_are_bounded():
    rule, _ = _counted(lambda size: SizedPlan((size,), {"n": int(size[0])}))
    traced = TracedRule(rule)
    for b in range(traced_rules.TRACES + 20):
        assert traced((b,)).fields == {"n": b}
    assert traced._paths == traced_rules.TRACES


@pytest.mark.parametrize("mask_batch", [1, None])
def test_attention_size_rule_traced_equals_attention_plan(mask_batch):
    """BERT's attention rule (fused QKV [B, S, 3*768], a [B or 1, 1, S, S] mask) at fresh sizes, traced and plain."""
    attrs = {"qkv_split": [768, 768, 768], "q_num_heads": 12, "kv_num_heads": 12, "k_perm": [0, 2, 1, 3],
             "q_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3], "out_merge_heads": 1}

    def plan(sizes):
        found = attention_plan(attrs, sizes, torch.float32)
        if isinstance(found, str):
            raise ValueError(found)
        return SizedPlan((found["output_size"],), {"B": found["dims"]["B"], "S": found["dims"]["S"],
                                                  "q": found["q"], "os": found["out_strides"], "ms": found["mask"][1]})

    traced = TracedRule(PlanRule(plan, ("attention-test",), traceable=True))
    rng = np.random.default_rng()
    for b, s in zip(rng.integers(1, 9, 60), rng.integers(1, 200, 60)):
        b, s = int(b), int(s)
        sizes = {0: (b, s, 2304), 3: (mask_batch or b, 1, s, s)}
        assert traced(sizes) == plan(sizes), (b, s, mask_batch)
    assert traced._traceable and traced._paths <= 4


def test_closed_forms_answer_as_the_computation_does_on_every_traced_path_and_none_off_them():
    """A computation over dims built of a traced rule's answers (TracedRule.traced on symbols), arithmetic and checks
    (kiln/runtime/view_trace.py's walk): learned at a few dims, its compiled paths give its own answer wherever their
    guards hold, and None elsewhere (the caller computes it)."""
    traced, _ = _counted(lambda size: SizedPlan(((size[0] * size[1],),), {"M": size[0] * size[1],
                                                                          "threads": int(size[0] * size[1] >= 64)}))
    rule = TracedRule(traced)

    def compute(dims):
        batch, seq, width = dims
        if seq > width:  # a check the caller refuses at
            return None
        sized = rule.traced(None, ((batch, seq),))
        if sized is None:
            return None
        return (sized.fields["M"], sized.fields["threads"], batch * seq * width), ((batch, seq, width),)

    def direct(dims):
        batch, seq, width = dims
        rows = batch * seq
        return None if seq > width else ((rows, int(rows >= 64), rows * width), (dims,))

    forms = traced_rules.ClosedForms()
    assert forms.learn((2, 3, 8), compute, direct((2, 3, 8))) is False  # the rule has no traced path yet
    rule((2, 3))  # traces its path below 64 rows
    assert forms.learn((2, 3, 8), compute, direct((2, 3, 8))) and forms.paths == 1
    rng = np.random.default_rng()
    answered = 0
    for _ in range(200):
        dims = tuple(int(v) for v in rng.integers(1, 40, 3))
        found = forms(dims)
        if found is not None:
            assert found == direct(dims), dims
            answered += 1
        elif direct(dims) is not None:
            rule((dims[0], dims[1]))  # as the int walk asks it (tracing the rule's path there)
            assert forms.learn(dims, compute, direct(dims)), dims  # a new path of the walk
    assert answered > 50 and 2 <= forms.paths <= 4  # below 64 rows and past: a path each (and the refusals)
    assert forms.learn((1, 9, 4), compute, None) is False and forms.traceable  # a check refuses: no path, no harm

    def untraceable(dims):
        raise traced_rules.Untraceable("a part symbols cannot follow")

    other = traced_rules.ClosedForms()
    assert other.learn((2, 3, 8), untraceable, None) is False and not other.traceable
    wrong = traced_rules.ClosedForms()  # a compiled answer that is not the computation's own is not kept
    assert wrong.learn((2, 3, 8), compute, ((0, 0, 0), ((2, 3, 8),))) is False and not wrong.traceable
    assert wrong((2, 3, 8)) is None
