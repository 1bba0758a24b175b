"""The scheduler, exactly: what each step computes (token slices, block tables), chunked prefill,
mixing prefill and decode, prefix hits, preemption by recompute and its order, cancellation,
stop conditions. Plain Python, no torch: the model is replaced by fixed sampled tokens."""

import pytest

from kiln.llm.block_manager import BlockManager
from kiln.llm.config import LLMError
from kiln.llm.request import Request, RequestStatus
from kiln.llm.sampling_params import SamplingParams
from kiln.llm.scheduler import Scheduler, SchedulerConfig

BS = 4
EOS = 99


def make(num_blocks=20, max_num_seqs=8, max_tokens_per_step=64, max_model_len=64, chunked=True, caching=True):
    blocks = BlockManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_per_step, max_model_len, chunked), blocks)


def req(request_id, prompt, max_tokens=16, **params):
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def plan(out):
    """{id: (tokens, start, blocks, sample)} of a SchedulerOutput."""
    return {s.request_id: (s.token_ids, s.start_position, s.block_ids, s.sample) for s in out.scheduled}


def run_step(s: Scheduler, token=7, tokens=None):
    out = s.schedule()
    sampled = {item.request_id: [tokens.get(item.request_id, token) if tokens else token]
               for item in out.scheduled if item.sample}
    finished = s.update(out, sampled)
    return out, finished


def test_prefill_then_decode():
    s = make()
    a = req("a", range(10, 16))
    s.add(a)
    out, _ = run_step(s, token=20)
    assert plan(out) == {"a": ([10, 11, 12, 13, 14, 15], 0, [1, 2], True)}
    assert a.token_ids[-1] == 20 and a.num_computed_tokens == 6 and a.status == RequestStatus.RUNNING
    out, _ = run_step(s, token=21)
    assert plan(out) == {"a": ([20], 6, [1, 2], True)}
    out, _ = run_step(s, token=22)
    assert plan(out) == {"a": ([21], 7, [1, 2], True)}
    out, _ = run_step(s, token=23)  # position 8 opens block 3
    assert plan(out) == {"a": ([22], 8, [1, 2, 3], True)}


def test_new_requests_join_a_running_batch_every_step():
    s = make()
    s.add(req("a", range(5)))
    run_step(s)
    s.add(req("b", range(100, 103)))
    out, _ = run_step(s)
    assert plan(out) == {"a": ([7], 5, [1, 2], True), "b": ([100, 101, 102], 0, [3], True)}
    assert out.num_batched_tokens == 4


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    s = make(max_tokens_per_step=8)
    s.add(req("a", range(20)))
    out, _ = run_step(s)
    assert plan(out) == {"a": (list(range(8)), 0, [1, 2], False)}  # no token sampled mid-prompt
    out, _ = run_step(s)
    assert plan(out) == {"a": (list(range(8, 16)), 8, [1, 2, 3, 4], False)}
    s.add(req("b", range(50, 54)))
    out, _ = run_step(s, token=30)
    # a finishes its prompt (4 tokens) and b's prompt fills the rest of the budget
    assert plan(out) == {"a": (list(range(16, 20)), 16, [1, 2, 3, 4, 5], True),
                         "b": ([50, 51, 52, 53], 0, [6], True)}
    assert s.requests["a"].output_token_ids == [30]


def test_budget_cuts_a_new_prompt_and_chunking_off_makes_it_wait():
    s = make(max_tokens_per_step=8)
    s.add(req("a", range(6)))
    s.add(req("b", range(100, 110)))
    out, _ = run_step(s)
    assert plan(out) == {"a": (list(range(6)), 0, [1, 2], True), "b": ([100, 101], 0, [3], False)}
    s = make(max_tokens_per_step=8, chunked=False)
    s.add(req("a", range(6)))
    s.add(req("b", range(100, 110)))
    out, _ = run_step(s)
    assert plan(out) == {"a": (list(range(6)), 0, [1, 2], True)}
    assert [r.request_id for r in s.waiting] == ["b"]


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", range(i * 10, i * 10 + 3)))
    out, _ = run_step(s)
    assert set(plan(out)) == {"r0", "r1"} and [r.request_id for r in s.waiting] == ["r2"]


def test_prefix_hit_skips_cached_tokens():
    s = make()
    s.add(req("a", range(10)))
    run_step(s)
    s.add(req("b", list(range(8)) + [77, 78]))
    out, _ = run_step(s)
    assert plan(out)["a"] == ([7], 10, [1, 2, 3], True)  # a decodes in its third block
    assert plan(out)["b"] == ([77, 78], 8, [1, 2, 4], True)
    assert s.requests["b"].num_cached_tokens == 8
    assert s.requests["a"].num_cached_tokens == 0


def test_preemption_frees_the_newest_and_recomputes_it_later():
    # 6 usable blocks; two requests of 8 prompt tokens take 2 each, then grow until blocks run out
    s = make(num_blocks=7, caching=False)
    s.add(req("a", range(8), max_tokens=20))
    s.add(req("b", range(100, 108), max_tokens=20))
    out, _ = run_step(s)
    assert plan(out) == {"a": (list(range(8)), 0, [1, 2], True), "b": (list(range(100, 108)), 0, [3, 4], True)}
    out, _ = run_step(s)  # position 8 of each: a takes 5, b takes 6
    assert plan(out) == {"a": ([7], 8, [1, 2, 5], True), "b": ([7], 8, [3, 4, 6], True)}
    for _ in range(3):
        run_step(s)  # positions 9..11 fit
    out, _ = run_step(s)  # position 12: a needs a 4th block; none free: b (newest) is preempted
    assert out.preempted == ["b"]
    # b's blocks return last first (6, 4, 3): a takes 6
    assert plan(out) == {"a": ([7], 12, [1, 2, 5, 6], True)}
    assert list(s.block_manager.free_queue) == [4, 3]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert s.block_manager.block_ids("b") == [] and list(s.waiting) == [b]
    # b's 8 prompt tokens + 5 sampled come back as one prefill once there is room
    assert b.num_tokens == 13 and b.output_token_ids == [7] * 5


def test_preemption_order_is_newest_first_and_no_admission_that_step():
    s = make(num_blocks=5, caching=False)  # 4 usable blocks
    for name in ("a", "b", "c"):
        s.add(req(name, range(4), max_tokens=20))  # one block each, full
    out, _ = run_step(s)
    assert plan(out) == {"a": ([0, 1, 2, 3], 0, [1], True), "b": ([0, 1, 2, 3], 0, [2], True),
                         "c": ([0, 1, 2, 3], 0, [3], True)}
    s.add(req("d", range(2), max_tokens=20))
    out, _ = run_step(s)  # each needs a 2nd block: a takes 4, b preempts c and takes c's, c would need one more
    assert out.preempted == ["c"]
    assert plan(out) == {"a": ([7], 4, [1, 4], True), "b": ([7], 4, [2, 3], True)}
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # preempted go to the front; d not admitted
    out, _ = run_step(s)
    assert plan(out) == {"a": ([7], 5, [1, 4], True), "b": ([7], 5, [2, 3], True)}  # still no room for c


def test_a_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=4, caching=False, max_model_len=12)  # 3 usable blocks
    s.add(req("a", range(4), max_tokens=8))
    s.add(req("b", range(4), max_tokens=8))
    run_step(s)  # a: [1], b: [2]
    out, _ = run_step(s)  # a takes 3; b finds none, preempts itself
    assert out.preempted == ["b"] and plan(out) == {"a": ([7], 4, [1, 3], True)}
    assert s.block_manager.num_free_blocks == 1


def test_preempted_request_resumes_from_its_cached_prefix():
    s = make(num_blocks=6)  # prefix caching on: 5 usable
    s.add(req("a", range(8), max_tokens=20))
    s.add(req("b", range(100, 108), max_tokens=20))
    run_step(s)  # a: 1 2, b: 3 4
    out, _ = run_step(s)  # a takes 5, b has none: preempted (4, 3 back to the free queue, hashes kept)
    assert out.preempted == ["b"]
    s.finish("a")  # frees 5, 2, 1
    out, _ = run_step(s)
    b = s.requests["b"]
    # b's two full prompt blocks are still cached: only the sampled token is recomputed
    assert plan(out) == {"b": ([7], 8, [3, 4, 5], True)}
    assert b.num_cached_tokens == 0  # the first admission's count is what usage reports


def test_cancellation_frees_blocks_at_once():
    s = make()
    s.add(req("a", range(10)))
    s.add(req("b", range(50, 55)))
    run_step(s)
    free_before = s.block_manager.num_free_blocks
    aborted = s.finish("a")
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert s.block_manager.num_free_blocks == free_before + 3
    assert "a" not in s.requests and [r.request_id for r in s.running] == ["b"]
    s.add(req("c", range(3)))
    assert s.finish("c").status == RequestStatus.FINISHED_ABORTED  # waiting: just dropped
    assert s.finish("nope") is None


def test_a_request_cancelled_during_its_step_gets_no_tokens():
    s = make()
    s.add(req("a", range(5)))
    out = s.schedule()
    s.finish("a")
    assert s.update(out, {"a": [7]}) == []
    assert s.requests == {}


def test_stop_conditions():
    s = make(max_model_len=12)
    s.add(req("eos", range(4)))
    s.add(req("len", range(10, 14), max_tokens=2))
    s.add(req("tok", range(20, 24), stop_token_ids=[42]))
    s.add(req("min", range(30, 34), min_tokens=2))
    s.add(req("ign", range(40, 44), ignore_eos=True, max_tokens=3))
    s.add(req("model_len", range(50, 60), max_tokens=None))
    tokens = {"eos": EOS, "len": 5, "tok": 42, "min": EOS, "ign": EOS, "model_len": 5}
    _, finished = run_step(s, tokens=tokens)
    assert {r.request_id: (r.status.finish_reason, r.stop_reason) for r in finished} == {
        "eos": ("stop", None), "tok": ("stop", 42)}
    _, finished = run_step(s, tokens=tokens)
    assert {r.request_id: r.status.finish_reason for r in finished} == {"len": "length", "min": "stop",
                                                                        "model_len": "length"}  # 10 + 2 = 12
    _, finished = run_step(s, tokens=tokens)
    assert {r.request_id: r.status.finish_reason for r in finished} == {"ign": "length"}
    assert s.num_unfinished == 0 and s.block_manager.num_free_blocks == 19


def test_drafts_are_scheduled_and_rejected_ones_rolled_back():
    s = make()
    a = req("a", range(6), max_tokens=10)
    s.add(a)
    run_step(s, token=8)  # 7 tokens, 6 computed
    a.spec_token_ids = [9, 10, 11]
    out = s.schedule()
    item = out.scheduled[0]
    assert (item.token_ids, item.start_position, item.num_draft_tokens, item.block_ids) == ([8, 9, 10, 11], 6, 3, [1, 2, 3])
    s.update(out, {"a": [9, 10, 5]})  # drafts 9, 10 accepted, 11 rejected; the model's own next token is 5
    assert a.output_token_ids == [8, 9, 10, 5]
    assert a.num_computed_tokens == 9 and a.spec_token_ids == []
    out = s.schedule()
    assert plan(out) == {"a": ([5], 9, [1, 2, 3], True)}


def test_accepted_drafts_past_a_stop_are_dropped():
    s = make()
    a = req("a", range(6), max_tokens=10)
    s.add(a)
    run_step(s, token=8)
    a.spec_token_ids = [EOS, 3]
    out = s.schedule()
    finished = s.update(out, {"a": [EOS, 3, 4]})
    assert finished == [a] and a.output_token_ids == [8, EOS]


def test_bad_requests_are_refused():
    s = make(max_model_len=8)
    with pytest.raises(LLMError, match="length limit is 8"):
        s.add(req("a", range(8)))
    with pytest.raises(LLMError, match="empty"):
        s.add(req("b", []))
    s.add(req("c", range(3)))
    with pytest.raises(LLMError, match="already in use"):
        s.add(req("c", range(3)))


def test_random_workload_finishes_everything_and_frees_every_block():
    import random

    rng = random.Random(1)
    s = make(num_blocks=12, max_num_seqs=4, max_tokens_per_step=16, max_model_len=40)
    made = 0
    for step in range(600):
        if made < 40 and rng.random() < 0.3:
            prompt = rng.choice([list(range(8)), []]) + [rng.randrange(90) for _ in range(rng.randrange(1, 12))]
            s.add(req(f"r{made}", prompt, max_tokens=rng.randrange(1, 12)))
            made += 1
        if rng.random() < 0.05 and s.requests:
            s.finish(rng.choice(sorted(s.requests)))
        out, _ = run_step(s, token=rng.randrange(90))
        assert out.num_batched_tokens <= 16 and len(s.running) <= 4
        for item in out.scheduled:  # slices are contiguous with what the cache holds
            assert item.start_position + len(item.token_ids) <= len(s.block_manager.block_ids(item.request_id)) * BS \
                or item.request.status.finished
        if made == 40 and not s.requests:
            break
    assert not s.requests and s.block_manager.num_free_blocks == 11


def test_async_scheduling_plans_a_step_while_tokens_are_in_flight():
    """launched(): the step's tokens count as computed and one token per request is in flight; the next
    schedule gives it its position and a PLACEHOLDER id, allocates its block, hashes only known tokens, and
    leaves out a request its in-flight token ends by length; update(launched=True) appends and finishes (a
    request ended by a stop token has its row in the step planned meanwhile: that row's token is dropped)."""
    from kiln.llm.scheduler import PLACEHOLDER

    s = make(max_model_len=64)
    a, b = req("a", range(10, 17), max_tokens=2), req("b", range(30, 33), max_tokens=10, stop_token_ids=[55])
    c = req("c", range(60, 63), max_tokens=10)
    for r in (a, b, c):
        s.add(r)
    run_step(s, tokens={"a": 20, "b": 40, "c": 70})  # prefill: a holds 8 tokens, b and c 4
    first = s.schedule()
    assert plan(first) == {"a": ([20], 7, [1, 2], True), "b": ([40], 3, [3], True), "c": ([70], 3, [4], True)}
    s.launched(first)
    assert (a.num_computed_tokens, a.num_inflight, b.num_computed_tokens, b.num_inflight) == (8, 1, 4, 1)
    second = s.schedule()  # a's in-flight token is its last: no row; position 4 opens a block for b and c
    assert plan(second) == {"b": ([PLACEHOLDER], 4, [3, 5], True), "c": ([PLACEHOLDER], 4, [4, 6], True)}
    assert s.block_manager.num_hashed["b"] == 1  # block 3: b's 4 known tokens; the in-flight one is not hashed
    s.launched(second)
    assert b.num_inflight == 2 and b.token_ids == [30, 31, 32, 40] and PLACEHOLDER not in b.token_ids
    finished = s.update(first, {"a": [21], "b": [55], "c": [71]}, launched=True)  # while `second` runs
    assert finished == [a, b] and a.status == RequestStatus.FINISHED_LENGTH and a.token_ids[-2:] == [20, 21]
    assert b.status == RequestStatus.FINISHED_STOPPED and b.token_ids == [30, 31, 32, 40, 55]
    assert s.update(second, {"b": [77], "c": [72]}, launched=True) == [] and b.token_ids[-1] == 55  # wasted row
    assert set(s.block_manager.request_blocks) == {"c"} and c.token_ids[-2:] == [71, 72] and c.num_inflight == 0
    assert plan(s.schedule()) == {"c": ([72], 5, [4, 6], True)}  # out of flight: a plain decode row


def test_launched_refuses_prefill_chunks_and_drafts():
    s = make(max_tokens_per_step=4)
    a = req("a", range(10, 17))
    s.add(a)
    out = s.schedule()  # a 4-token chunk of a 7-token prompt: nothing to sample
    with pytest.raises(LLMError, match="only decode steps"):
        s.launched(out)
