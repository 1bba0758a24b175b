"""Async scheduling on the CPU (kiln/llm/engine.py, scheduler.launched/update, DecodeGraphs.launch): the engine
plans step n+1 while step n's tokens are still "on the device". The decode graphs are stood in for by an eager
replay of the model over the graph's static buffers (torch attention over the paged cache: the tokens each row
reads are the ones the launch gathered from the previous launch's output, never the host's), so every part of
the overlap runs as on the GPU but the kernels. Greedy tokens must equal the plain engine's and transformers'
whatever finishes, arrives, is cancelled or preempted meanwhile; the scheduler's bookkeeping must end clean."""

import random

import pytest
import torch

from kiln.llm import LLM, SamplingParams
from kiln.llm.attention import AttentionMetadata
from kiln.llm.cuda_graphs import DecodeGraphs
from kiln.llm.scheduler import PLACEHOLDER
from kiln.runtime.heap import INTERPRETER_FROZEN  # CPython 3.12 freezes a few hundred objects by itself
from tests.llm.conftest import hf_greedy

PROMPTS = ["Hello world, hello", "The quick brown fox jumps over the lazy dog. The quick brown",
           "Paged attention", "In-flight batching admits new requests every step; prefix caching", "Ü 日本語", "a"]


class EagerGraph:
    """A captured decode graph stand-in: the bucket's forward over the static buffers, greedy ids in place."""

    def __init__(self, graphs: DecodeGraphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket
        graphs.greedy_ids[bucket] = torch.zeros(bucket, dtype=torch.int64)

    @torch.inference_mode()
    def replay(self):
        g, b = self.graphs, self.bucket
        ids = g.ints[0, :b]
        assert (ids >= 0).all(), "a row's input token is still a placeholder"
        seq_lens = g.ints[3, :b].tolist()
        meta = AttentionMetadata(slot_mapping=g.ints[2, :b], query_start=list(range(b)), query_lens=[1] * b,
                                 seq_lens=seq_lens, block_tables=g.tables[:b], seq_lens_tensor=g.seq_lens[:b],
                                 num_decodes=b, backend="torch")
        hidden = g.model(ids, g.ints[1, :b], g.kv_caches, meta)
        g.logits[b] = g.model.compute_logits(hidden)
        g.greedy_ids[b].copy_(g.logits[b].argmax(dim=-1))  # in place, as a graph's output


class EagerSampling:
    def __init__(self, graphs: DecodeGraphs, bucket: int):
        self.graphs, self.bucket = graphs, bucket

    @torch.inference_mode()
    def replay(self):
        self.graphs.sampled_ids[self.bucket] = self.graphs._sample(self.bucket)


def async_llm(folder, **options):
    llm = LLM(folder, **{"block_size": 4, "max_model_len": 64, **options})
    engine = llm.engine
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.sampler, engine.config.block_size,
                          engine.max_model_len, engine.config.max_num_seqs, torch.device("cpu"))
    for bucket in graphs.buckets:
        graphs.forward_graphs[bucket] = EagerGraph(graphs, bucket)
        graphs.sample_graphs[bucket] = EagerSampling(graphs, bucket)
    runner.graphs = graphs
    engine.async_scheduling = True
    return llm


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_clean(engine):
    """Nothing left running or in flight, every block back (the null block aside)."""
    while engine.has_unfinished() or engine._launched is not None:
        engine.step()
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks - 1 and not blocks.request_blocks
    assert not engine.states


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models("llama")


@pytest.fixture(scope="module")
def plain(llama):
    """The plain engine, each prompt alone: the reference."""
    llm = LLM(llama[0], block_size=4, max_model_len=64)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return [tokens(llm.generate([p], params))[0] for p in PROMPTS]


def test_greedy_tokens_equal_transformers_and_the_plain_engine(llama, plain):
    folder, model = llama
    llm = async_llm(folder, max_num_seqs=8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params)) == plain
    graphs = llm.engine.runner.graphs
    assert graphs.num_launches >= 20  # the decode steps ran ahead
    for prompt, expected in zip(PROMPTS[:3], plain):
        ids = llm.engine.encode(prompt)
        assert hf_greedy(model, ids, 24)[0] == expected
    assert_clean(llm.engine)


def test_placeholders_are_decode_rows_gathered_on_the_device(llama):
    """While a step is launched, the next one is scheduled with a PLACEHOLDER per request; the runner
    gathers those from the launched step's output, and the request's known tokens never hold one."""
    folder, _ = llama
    llm = async_llm(folder, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(prompt, params, request_id=str(i))
    launched_steps = []
    original = engine.runner.launch

    def spy(scheduled, previous):
        launched_steps.append(([s.token_ids[0] for s in scheduled], previous is not None))
        return original(scheduled, previous)

    engine.runner.launch = spy
    while engine.has_unfinished():
        engine.step()
        for request in engine.scheduler.running:
            assert PLACEHOLDER not in request.token_ids and request.num_inflight in (0, 1)
    engine.runner.launch = original
    assert launched_steps[0][1] is False and all(t != PLACEHOLDER for t in launched_steps[0][0])
    assert len(launched_steps) >= 8 and all(chained and set(ids) == {PLACEHOLDER}
                                            for ids, chained in launched_steps[1:])
    assert_clean(engine)


@pytest.mark.parametrize("seed", range(3))
def test_finishes_arrivals_cancellation_and_preemption_change_no_tokens(llama, plain, seed):
    """Requests stop on a token (as on EOS: one wasted row in the step already planned), by length at
    different steps, arrive while others decode, are cancelled in flight; a small cache preempts. Every
    request that runs to its end has the plain engine's tokens (cut where it stopped)."""
    folder, _ = llama
    rng = random.Random(seed)
    # 19 usable blocks of 4 tokens: six requests of up to ~55 tokens preempt
    llm = async_llm(folder, max_num_seqs=rng.choice([3, 4, 6]), num_kv_blocks=20,
                    max_num_batched_tokens=rng.choice([8, 64]))
    engine = llm.engine
    expected, params = {}, {}
    for i, reference in enumerate(plain):
        kind = rng.choice(["stop", "length", "full"])
        if kind == "stop":
            stop = reference[rng.randrange(1, 20)]
            cut = reference.index(stop) + 1
            params[str(i)] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop])
        else:
            cut = rng.randrange(1, 24) if kind == "length" else 24
            params[str(i)] = SamplingParams(max_tokens=cut, temperature=0, ignore_eos=True)
        expected[str(i)] = reference[:cut]
    cancelled = str(rng.randrange(len(PROMPTS)))
    seen = {}
    order = list(range(len(PROMPTS)))
    rng.shuffle(order)
    steps = 0
    while order or engine.has_unfinished():
        if order and rng.random() < 0.4:
            i = order.pop()
            engine.add_request(PROMPTS[i], params[str(i)], request_id=str(i))
        for out in engine.step():
            seen[out.request_id] = out
        steps += 1
        if steps == 12 and cancelled in engine.scheduler.requests:
            engine.abort(cancelled)
    assert_clean(engine)
    for request_id, want in expected.items():
        if request_id == cancelled and request_id not in seen:
            continue
        if request_id == cancelled and not seen[request_id].finished:
            continue
        assert seen[request_id].finished and seen[request_id].outputs[0].token_ids == want, request_id
    assert engine.runner.graphs.num_launches > 10


def test_batch_invariance_with_async_scheduling(llama, plain):
    folder, _ = llama
    llm = async_llm(folder, max_num_seqs=6)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[::-1], params)) == plain[::-1]
    for prompt, expected in zip(PROMPTS[:2], plain):
        assert tokens(llm.generate([prompt], params))[0] == expected
    assert_clean(llm.engine)


def test_sampled_requests_run_ahead_with_the_waiting_engines_tokens(llama):
    """Sampling on the device (seeded, and seeded by the engine) runs ahead too: the same tokens as the plain
    engine's, mixed with greedy rows in one batch."""
    folder, _ = llama
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.2, min_p=0.05, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)]
    want = tokens(LLM(folder, block_size=4, max_model_len=64, seed=5).generate(PROMPTS[:4], params))
    llm = async_llm(folder, seed=5)
    assert tokens(llm.generate(PROMPTS[:4], params)) == want
    assert llm.engine.runner.graphs.num_launches >= 14 and len({tuple(t) for t in want}) == 4


def test_penalized_and_logprob_requests_take_the_waiting_path(llama):
    """Steps that cannot run ahead (penalties read the history, log-probabilities the graph's logits) run as
    before: the plain engine's outputs, no launches."""
    folder, _ = llama
    requests = [SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0.7, seed=2, logprobs=2, ignore_eos=True)]
    reference = LLM(folder, block_size=4, max_model_len=64)
    llm = async_llm(folder)
    for params in requests:
        want = reference.generate(PROMPTS[:2], params)
        got = llm.generate(PROMPTS[:2], params)
        assert tokens(got) == tokens(want)
        if params.logprobs is not None:
            assert [[lp.token_id for lp in o.outputs[0].logprobs] for o in got] == tokens(want)
    assert llm.engine.runner.graphs.num_launches == 0


def test_async_scheduling_refused_without_graphs(llama):
    from kiln.llm import LLMError

    with pytest.raises(LLMError, match="async_scheduling needs cuda_graphs"):
        LLM(llama[0], block_size=4, max_model_len=64, async_scheduling=True)
    assert LLM(llama[0], block_size=4, max_model_len=64).engine.async_scheduling is False


def test_generate_and_stream_leave_the_startup_heap_out_of_gc_scans_and_put_it_back(llama):
    """static_heap (kiln/runtime/heap.py): gc.freeze while LLM.generate / LLM.stream admit their requests and step the
    engine, unfrozen after; a freeze someone else holds is neither doubled nor undone."""
    import gc

    folder, _ = llama
    llm = LLM(folder, block_size=4, max_model_len=64)
    seen = []
    step, add_request = llm.engine.step, llm.engine.add_request

    def watched():
        seen.append(gc.get_freeze_count())
        return step()

    def admitted(*args, **kwargs):  # a full collection here would scan the heap the block before gave back
        seen.append(gc.get_freeze_count())
        return add_request(*args, **kwargs)

    llm.engine.step, llm.engine.add_request = watched, admitted
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)
    assert seen and all(count > INTERPRETER_FROZEN for count in seen) and gc.get_freeze_count() <= INTERPRETER_FROZEN
    seen.clear()
    list(llm.stream(PROMPTS[0], params))
    assert seen and all(count > INTERPRETER_FROZEN for count in seen) and gc.get_freeze_count() <= INTERPRETER_FROZEN
    gc.freeze()
    try:
        llm.generate(PROMPTS[:1], params)
        assert gc.get_freeze_count() > INTERPRETER_FROZEN  # still the caller's
    finally:
        gc.unfreeze()
