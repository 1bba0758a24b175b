"""Choosing between the layers' own GEMM and kiln's decode GEMV (kiln/llm/decode_gemv.py) on the CPU with
fake timings: the choice per rows bucket, the forced modes, the caches, a candidate that fails its check; and
a model whose layers carry the plans (the GEMV under Triton's interpreter) generating the same tokens."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.builder.timing_cache import TimingCache  # noqa: E402
from kiln.llm import LLM, EngineConfig, LLMError, SamplingParams  # noqa: E402
from kiln.llm import decode_gemv  # noqa: E402
from kiln.llm.decode_gemv import LIBRARY, GemvTuner, decide  # noqa: E402
from kiln.llm.kernels import gemv as gemv_kernels  # noqa: E402
from kiln.llm.kernels.gemv import DecodeGemv, GemvConfig  # noqa: E402
from kiln.llm.quantization import quantize_model  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

A, B = GemvConfig("dot", 16, 32, 1, 4, 1), GemvConfig("fma", 8, 32, 2, 4, 1)
C = GemvConfig("dot_swap", 16, 32, 1, 4, 1)
# the model tests run a CPU engine whose layers launch the GEMV: under the interpreter only
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a CPU model's GEMV launches need TRITON_INTERPRET=1")
CONFIGS = {A.name: A, B.name: B}


@pytest.fixture(autouse=True)
def fresh_process_cache(monkeypatch):
    monkeypatch.setattr(decode_gemv, "_PROCESS_CACHE", {})


def test_auto_takes_the_fastest_per_bucket_and_the_library_on_a_tie():
    timings = {1: {LIBRARY: 10.0, A.name: 7.0, B.name: 8.0},
               2: {LIBRARY: 10.0, A.name: 9.6, B.name: 11.0},  # 4% faster: within the margin, the library stays
               4: {LIBRARY: 10.0, A.name: 12.0, B.name: 6.0},
               8: {LIBRARY: None, A.name: 12.0, B.name: None},  # the library did not run; B failed its check
               16: {LIBRARY: 5.0, A.name: None, B.name: None}}
    assert decide(timings, CONFIGS, "auto") == {1: A, 2: None, 4: B, 8: A, 16: None}
    assert decide(timings, CONFIGS, "auto", margin=0.0) == {1: A, 2: A, 4: B, 8: A, 16: None}
    assert decide(timings, CONFIGS, "cublas") == dict.fromkeys(timings)
    assert decide(timings, {}, "auto") == dict.fromkeys(timings)


def test_triton_mode_runs_one_config_at_every_bucket():
    """Batch invariance: one config for all buckets, the one with the smallest summed time."""
    timings = {1: {LIBRARY: 1.0, A.name: 7.0, B.name: 5.0}, 8: {LIBRARY: 1.0, A.name: 7.0, B.name: 10.0}}
    assert decide(timings, CONFIGS, "triton") == {1: A, 8: A}  # 14 us against 15
    timings[8][A.name] = None  # A failed its check at 8 rows: B everywhere
    assert decide(timings, CONFIGS, "triton") == {1: B, 8: B}
    timings[1][B.name] = None
    with pytest.raises(LLMError, match="no GEMV config passed"):
        decide(timings, CONFIGS, "triton")


@interpreted
def test_a_plan_maps_rows_to_buckets():
    plan = DecodeGemv(torch.zeros(4, 4), None, {8: B, 1: A, 2: None})
    assert [plan.config_for(m) for m in (1, 2, 3, 8, 9, 64)] == [A, None, B, B, None, None]
    assert plan(torch.zeros(3, 4)) is not None and plan(torch.zeros(2, 4)) is None


def test_config_switch(monkeypatch):
    monkeypatch.setenv("KILN_LLM_GEMV", "triton")
    assert EngineConfig().gemv == "triton"
    assert EngineConfig(gemv="cublas").gemv == "cublas"  # the engine argument wins over the environment
    monkeypatch.delenv("KILN_LLM_GEMV")
    assert EngineConfig().gemv == "auto"
    monkeypatch.setenv("KILN_LLM_GEMV_CACHE", "/tmp/kiln-gemv.json")
    assert EngineConfig().gemv_timing_cache == "/tmp/kiln-gemv.json"
    monkeypatch.delenv("KILN_LLM_GEMV_CACHE")
    assert EngineConfig().gemv_timing_cache is None
    with pytest.raises(LLMError, match="expected auto, cublas or triton"):
        EngineConfig(gemv="cutlass").check()
    with pytest.raises(LLMError, match="gemv 'fast'"):
        GemvTuner("fast")


class FakeTimer:
    """Timings by (bucket, name): the GEMV configs beat the library at 1 row and lose at 2; counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, shape, bucket, name, calls):
        self.calls += 1
        assert calls and all(callable(c) for c in calls)
        table = {1: {LIBRARY: 10.0, A.name: 6.0, B.name: 7.0}, 2: {LIBRARY: 10.0, A.name: 12.0, B.name: 11.0}}
        return table[bucket][name]


@pytest.fixture(scope="module")
def llama_llm(hf_models):
    folder, _ = hf_models("llama")
    return LLM(folder, kv_cache_memory="4MiB", max_num_seqs=2)


def greedy(llm, prompts):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, detokenize=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def counting(monkeypatch):
    """Counts the GEMV's launches from the layers (DecodeGemv calls gemv through the module)."""
    seen = []
    real = gemv_kernels.gemv

    def wrapped(x, weight, scale=None, bias=None, config=A):
        seen.append((x.shape[0], weight.dtype, config))
        return real(x, weight, scale, bias, config)

    monkeypatch.setattr(gemv_kernels, "gemv", wrapped)
    return seen


@interpreted
@pytest.mark.parametrize("method", [None, "int8"])
def test_a_model_with_plans_generates_the_same_tokens(llama_llm, monkeypatch, method):
    model = llama_llm.engine.model
    if method:  # a fresh quantized copy of the projections on the same engine, undone below
        saved = {name: (m.weight, m.quantized) for name, m in model.named_modules() if hasattr(m, "quantized")}
        quantize_model(model, method)
    try:
        prompts = [[5, 9, 14, 3], [7, 7, 21]]
        before = greedy(llama_llm, prompts)
        timer = FakeTimer()
        decisions = GemvTuner("auto", measure=timer, candidates=lambda shape, size: [A, B]).tune(
            model, torch.float32, max_rows=2)
        # llama's 4 projection shapes (q|k|v, o, gate|up, down) and the LM head, each timed at buckets 1 and 2
        assert len(decisions) == 5 and timer.calls == 5 * 2 * 4  # the library before and after the configs
        assert all(d.plan == {1: A, 2: None} for d in decisions)
        head = decisions[-1].shape
        assert (head.n, head.k, head.weight_dtype) == (320, 64, "float32")  # the LM head stays unquantized
        assert all(d.shape.weight_dtype == ("int8" if method else "float32") for d in decisions[:-1])
        seen = counting(monkeypatch)
        assert greedy(llama_llm, [prompts[0]]) == before[:1]  # one row a decode step: the GEMV
        decode_rows = {m for m, _, _ in seen}
        assert seen and decode_rows == {1} and {c for _, _, c in seen} == {A}
        seen.clear()
        assert greedy(llama_llm, prompts) == before  # two rows: the library's step; prefill never the GEMV
        assert not seen
        # a second tuning of the same shapes on this machine times nothing
        GemvTuner("auto", measure=timer, candidates=lambda shape, size: [A, B]).tune(model, torch.float32, 2)
        assert timer.calls == 5 * 2 * 4
    finally:
        for m in model.modules():
            if hasattr(m, "decode_gemv"):
                m.decode_gemv = None
        if method:
            for name, m in model.named_modules():
                if name in saved:
                    m.weight, m.quantized = saved[name]


@interpreted
def test_a_config_that_fails_its_check_or_does_not_run_is_never_timed_nor_chosen(llama_llm, monkeypatch):
    real = gemv_kernels.gemv

    def wrong_b(x, weight, scale=None, bias=None, config=A):
        if config == C:
            raise RuntimeError("out of resources: shared memory")  # as Triton says when a config does not fit
        y = real(x, weight, scale, bias, config)
        return y * 1.01 if config == B else y

    monkeypatch.setattr(gemv_kernels, "gemv", wrong_b)
    timed = []

    def measure(shape, bucket, name, calls):
        timed.append(name)
        return {LIBRARY: 10.0, A.name: 9.0, B.name: 1.0, C.name: 1.0}[name]  # B or C would win if they ran right

    try:
        decisions = GemvTuner("auto", measure=measure, candidates=lambda shape, size: [A, B, C]).tune(
            llama_llm.engine.model, torch.float32, max_rows=1)
        assert B.name not in timed and C.name not in timed and all(d.plan == {1: A} for d in decisions)
        assert all(d.timings[1][B.name] is None and d.timings[1][C.name] is None for d in decisions)
    finally:
        for m in llama_llm.engine.model.modules():
            if hasattr(m, "decode_gemv"):
                m.decode_gemv = None


@interpreted
def test_timings_persist_in_a_timing_cache_file(llama_llm, tmp_path):
    path = tmp_path / "gemv.json"
    model = llama_llm.engine.model
    try:
        first = GemvTuner("auto", TimingCache(path), measure=FakeTimer(),
                          candidates=lambda shape, size: [A, B]).tune(model, torch.float32, max_rows=2)
        decode_gemv._PROCESS_CACHE.clear()  # a new process: only the file remains

        def must_not_time(*args):
            raise AssertionError("timed although the cache file holds the timings")

        again = GemvTuner("triton", TimingCache(path), measure=must_not_time,
                          candidates=lambda shape, size: [A, B]).tune(model, torch.float32, max_rows=2)
        assert [d.timings for d in again] == [d.timings for d in first]
        assert all(d.plan == {1: A, 2: A} for d in again)  # triton: 6 + 12 us against 7 + 11 (a tie goes by name)
    finally:
        for m in model.modules():
            if hasattr(m, "decode_gemv"):
                m.decode_gemv = None


def test_cublas_mode_attaches_nothing(llama_llm):
    assert GemvTuner("cublas").tune(llama_llm.engine.model, torch.float32) == []
    assert all(getattr(m, "decode_gemv", None) is None for m in llama_llm.engine.model.modules())


@interpreted
def test_the_library_is_timed_before_and_after_the_configs(llama_llm):
    """A clock that drifts (the library slow at first, fast later) must not hand the choice to the GEMV."""
    library_times = iter([10.0, 5.0] * 5)

    def measure(shape, bucket, name, calls):
        return next(library_times) if name == LIBRARY else 7.0

    model = llama_llm.engine.model
    try:
        decisions = GemvTuner("auto", measure=measure, candidates=lambda shape, size: [A]).tune(
            model, torch.float32, max_rows=1)
        assert all(d.plan == {1: None} and d.timings[1][LIBRARY] == 5.0 for d in decisions)
    finally:
        for m in model.modules():
            if hasattr(m, "decode_gemv"):
                m.decode_gemv = None
