"""The decode GEMV (kiln/llm/kernels/gemv.py) against torch in fp64 on the dequantized weights, under
TRITON_INTERPRET=1 at small shapes: every variant, weight dtype (bf16, FP8 E4M3, INT8 per channel), split-K
on and off, decode rows 1..16, ragged N and K; and batch invariance (row 0 the same bits at M = 1 and 8)."""

import os
import zlib

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm.kernels.gemv import GemvConfig, candidate_configs, gemv, split_length  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter fixes tests/kernels applies (bf16 tl.dot)
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
WEIGHTS = ("bf16", "fp8", "int8")


def weight(n: int, k: int, kind: str, act: torch.dtype, g: torch.Generator):
    """(stored weight, per-channel scale or None, its fp64 value) for a random [n, k] weight."""
    w = torch.randn((n, k), generator=g) * 0.1
    if kind == "bf16":
        q = w.to(act)
        return q.to(DEVICE), None, q.double()
    if kind == "int8":
        scale = w.abs().amax(dim=1) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    else:
        scale = w.abs().amax(dim=1) / 448.0
        q = (w / scale[:, None]).to(torch.float8_e4m3fn)
    return q.to(DEVICE), scale.to(DEVICE), q.double() * scale.double()[:, None]


def check(got: torch.Tensor, ref: torch.Tensor, act: torch.dtype) -> None:
    if act == torch.float32:  # fp32 products and sums in another order over K <= 200
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    else:  # one bf16 step (2^-7 relative): GPU rounds to nearest, the interpreter's cast truncates
        torch.testing.assert_close(got.double(), ref, atol=1e-3, rtol=2**-7)


CONFIGS = [GemvConfig("dot", 16, 32, 1, 4, 1), GemvConfig("dot", 32, 64, 3, 4, 2),
           GemvConfig("dot_swap", 16, 32, 1, 4, 1), GemvConfig("dot_swap", 32, 32, 2, 4, 1, "last"),
           GemvConfig("fma", 8, 32, 1, 4, 1), GemvConfig("fma", 4, 64, 3, 4, 1, "last"),
           GemvConfig("fma_rows", 8, 32, 1, 4, 1, rows=4), GemvConfig("fma_rows", 4, 64, 2, 4, 1, "last", rows=2)]
# the knobs (prefetch, the weight stream's cache hint, programmatic dependent launch: on a GPU only)
KNOBS = [GemvConfig("fma", 8, 32, 1, 4, 1, prefetch=True), GemvConfig("fma", 4, 64, 3, 4, 1, "last", prefetch=True,
                                                                       w_cache="evict_first", pdl=True),
         GemvConfig("fma_rows", 4, 32, 1, 4, 1, rows=4, prefetch=True, w_cache="cg", pdl=True),
         GemvConfig("dot_swap", 32, 32, 2, 4, 1, "last", w_cache="evict_first", pdl=True),
         # a persistent grid (4 programs on the interpreter's 4 "SMs"), split-K's counters indexed by tile
         GemvConfig("fma", 4, 32, 2, 4, 1, "last", prefetch=True, pdl=True, persistent=1),
         GemvConfig("dot_swap", 16, 32, 1, 4, 1, persistent=2)]
CONFIGS += KNOBS


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (5, 37, 200), (16, 64, 64)])
def test_gemv_matches_torch(config, kind, m, n, k):
    g = torch.Generator().manual_seed(zlib.crc32(repr((config.name, kind, m, n, k)).encode()))
    act = torch.bfloat16
    q, scale, ref_w = weight(n, k, kind, act, g)
    x = torch.randn((m, k), generator=g).to(act)
    bias = torch.randn(n, generator=g).to(act) if m == 5 else None
    got = gemv(x.to(DEVICE), q, scale, None if bias is None else bias.to(DEVICE), config)
    assert got.shape == (m, n) and got.dtype == act
    ref = x.double() @ ref_w.T + (0 if bias is None else bias.double())
    check(got.cpu(), ref, act)


@pytest.mark.parametrize("config", CONFIGS[::2], ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("kind", ("fp8", "int8"))
def test_fp32_activations_are_exact_products(config, kind):
    g = torch.Generator().manual_seed(11)
    q, scale, ref_w = weight(40, 136, kind, torch.float32, g)
    x = torch.randn((3, 136), generator=g)
    check(gemv(x.to(DEVICE), q, scale, None, config).cpu(), x.double() @ ref_w.T, torch.float32)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("kind", WEIGHTS)
def test_row_zero_is_the_same_bits_at_every_batch_size(config, kind):
    """Batch invariance: what a request's row computes never depends on the rows beside it."""
    g = torch.Generator().manual_seed(7)
    q, scale, _ = weight(37, 200, kind, torch.bfloat16, g)
    x = torch.randn((8, 200), generator=g).to(torch.bfloat16).to(DEVICE)
    alone = gemv(x[:1], q, scale, None, config)
    for m in (2, 8):
        batch = gemv(x[:m], q, scale, None, config)
        assert torch.equal(batch[:1], alone), f"M={m}: row 0 differs from M=1"
    other = torch.cat([x[:1], torch.randn((7, 200), generator=g).to(torch.bfloat16).to(DEVICE)])
    assert torch.equal(gemv(other, q, scale, None, config)[:1], alone)


@pytest.mark.parametrize("config", KNOBS, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (5, 37, 200)])
def test_knobs_change_no_bits(config, m, n, k):
    """prefetch, w_cache, pdl and a persistent grid move loads and launches, never a sum: the same bits as the
    config without them
    (K ragged at 200: prefetch's load past the split's end masked off)."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(17)
    q, scale, _ = weight(n, k, "fp8", torch.bfloat16, g)
    x = torch.randn((m, k), generator=g).to(torch.bfloat16).to(DEVICE)
    plain = replace(config, prefetch=False, w_cache="", pdl=False, persistent=0)
    assert torch.equal(gemv(x, q, scale, None, config), gemv(x, q, scale, None, plain))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch needs a GPU (sm_90)")
def test_pdl_chain_in_a_cuda_graph_waits_for_each_previous_output():
    """Six GEMVs in a CUDA graph, each reading the one before's output (x and the residual): launched with PDL
    (the next one placed early, reading W ahead) they give the bits of the same chain without PDL. A missing
    gdc_wait would read a half-written x."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    g = torch.Generator().manual_seed(23)
    weights = [weight(2048, 2048, "bf16", torch.bfloat16, g)[0] for _ in range(6)]
    x0 = torch.randn((1, 2048), generator=g).to(torch.bfloat16).to(DEVICE)

    def chain(config):
        h = x0
        for w in weights:
            h = gemv(h, w, None, None, config, residual=h)
        return h

    for config in (GemvConfig("fma", 4, 1024, 1, 4, 1, prefetch=True, pdl=True),
                   GemvConfig("dot_swap", 64, 256, 2, 4, 4, "last", pdl=True)):
        from dataclasses import replace

        expected = chain(replace(config, pdl=False))
        chain(config)  # eager first: compiles, and allocates split-K's counters outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(config)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), config.name


def test_leading_dimensions_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    q, scale, ref_w = weight(24, 64, "int8", torch.bfloat16, g)
    x = torch.randn((2, 3, 128), generator=g).to(torch.bfloat16)[..., :64]  # rows 128 apart
    got = gemv(x.to(DEVICE), q, scale, None, CONFIGS[0])
    assert got.shape == (2, 3, 24)
    check(got.cpu(), x.double() @ ref_w.T, torch.bfloat16)


def test_bad_weights_are_refused():
    x = torch.randn((1, 64), device=DEVICE)
    with pytest.raises(ValueError, match="row-major"):
        gemv(x, torch.randn((64, 24), device=DEVICE).t(), None)
    with pytest.raises(ValueError, match="row-major"):
        gemv(x, torch.randn((24, 32), device=DEVICE), None)
    with pytest.raises(ValueError, match="scale"):
        gemv(x, torch.zeros((24, 64), dtype=torch.int8, device=DEVICE), None)


def test_configs():
    assert split_length(4096, GemvConfig("dot", 32, 256, 3)) == 1536  # ceil(4096 / 3) rounded up to whole tiles
    assert split_length(200, GemvConfig("dot", 16, 32, 1)) == 224
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig("dot", 24)
    with pytest.raises(ValueError, match="variant"):
        GemvConfig("wmma")
    with pytest.raises(ValueError, match="tl.dot"):
        GemvConfig("dot", 8)
    with pytest.raises(ValueError, match="rows > 1"):
        GemvConfig("fma", rows=4)
    with pytest.raises(ValueError, match="rows > 1"):
        GemvConfig("fma_rows", 8, 32)
    with pytest.raises(ValueError, match="split_reduce"):
        GemvConfig("dot", split_k=2, split_reduce="atomic")
    with pytest.raises(ValueError, match="prefetch"):
        GemvConfig("dot", prefetch=True)
    with pytest.raises(ValueError, match="w_cache"):
        GemvConfig("fma", 8, w_cache=".cs")
    assert GemvConfig("fma", 4, 1024, 1, 4, 1, prefetch=True, w_cache="cg", pdl=True).name == \
        "fma n4 k1024 s1 w4 st1 pf cg pdl"
    assert GemvConfig("fma", 4, 1024, 1, 4, 1).name == "fma n4 k1024 s1 w4 st1"  # the engine's cached names
    bf16, int8 = candidate_configs(4096, 4096, torch.bfloat16), candidate_configs(4096, 4096, torch.int8)
    assert len(bf16) == len(set(bf16)) > 20
    assert {c.variant for c in bf16} == {"dot", "dot_swap", "fma", "fma_rows"} and any(c.split_k > 1 for c in bf16)
    # 1-byte weights: twice the K per tile (16-byte loads of 16 values)
    assert {(c.variant, c.block_n, c.block_k) for c in int8} == {(c.variant, c.block_n, 2 * c.block_k) for c in bf16}
    assert {c.split_reduce for c in bf16 if c.split_k > 1} == {"kernel", "last"}
    # many output tiles: no split-K past MAX_PROGRAMS programs
    assert all(c.split_k == 1 or c.split_k * -(-28672 // c.block_n) <= 4096
               for c in candidate_configs(28672, 4096, torch.bfloat16))
    assert {c.split_reduce for c in bf16 if c.split_k > 2} == {"last"}


def test_the_benchmark_runs_on_the_cpu(tmp_path):
    """bench/gemv.py --tiny: every kiln config checked and timed under the interpreter, the table and the JSON
    written under $OUT (what the GPU run writes, at tiny shapes)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(root / "bench" / "gemv.py"), "--tiny", "--dtypes", "bf16", "int8"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "gemv.json").read_text())
    assert {(r["shape"], r["m"], r["dtype"]) for r in doc["rows"]} == {
        (s, m, d) for s in ("a", "b") for m in (1, 3) for d in ("bf16", "int8")}
    assert all(len(r["configs"]) == 6 and r["best"] in r["configs"] for r in doc["rows"])  # all 6 passed
    assert all(r["peers"]["cuBLAS bf16"] is not None for r in doc["rows"])
    # under the interpreter only the old int8 GEMM is off (its int8 -> bf16 cast; right on the GPU)
    assert all("old Triton int8" in f for f in doc["failures"])
    assert set(doc["shortlist"]) == {"2", "1"} and all(GemvConfig(**c) for c in doc["shortlist"]["2"])
    table = (tmp_path / "gemv.md").read_text()
    assert table.count("| a | 96x48 |") == 4 and "best config" in table


@pytest.mark.slow
def test_the_sweep_runs_on_the_cpu(tmp_path):
    """bench/gemv_sweep.py --tiny: every stage before the end to end (ceilings, sweep, tables, shortlist, the
    fused forms) under the interpreter; each variant checked against torch, all passing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(root / "bench" / "gemv_sweep.py"), "--tiny"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "gemv_sweep.json").read_text())
    assert {(r["shape"], r["m"]) for r in doc["rows"]} == {(s, m) for s in ("a", "b") for m in (1, 3)}
    assert not doc["failures"] and all(len(r["configs"]) == 7 for r in doc["rows"])
    assert set(doc["ceiling"]) == {"copy", "read"} and doc["shortlist"]
    assert "compiled the fused forms of" in done.stdout and "0 failed" in done.stdout
    assert "| a | 96x48 | 1 |" in (tmp_path / "gemv_sweep.md").read_text()


def test_the_kernel_compiles_for_sm90_with_vector_loads():
    """The real compiler (no GPU): every variant and weight dtype lowers to 16-byte (8 for 1-byte weights in
    dot_swap) pipelined loads, not scalar ones (tests/llm/gemv_compile_sm90.py)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.llm.gemv_compile_sm90"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("ok  ") == 29


def test_last_arrival_split_leaves_its_counters_zero():
    """split_reduce="last": the same bits as the second-kernel reduction (same order of the partial sums), and
    every tile's arrival counter back at zero for the next launch (a CUDA graph replays the same buffer)."""
    from kiln.llm.kernels import gemv as kernels

    g = torch.Generator().manual_seed(5)
    q, scale, _ = weight(37, 200, "fp8", torch.bfloat16, g)
    x = torch.randn((3, 200), generator=g).to(torch.bfloat16).to(DEVICE)
    for variant, block_n in (("dot", 16), ("fma", 8)):
        two_pass = gemv(x, q, scale, None, GemvConfig(variant, block_n, 32, 3, 4, 1, "kernel"))
        for _ in range(2):
            last = gemv(x, q, scale, None, GemvConfig(variant, block_n, 32, 3, 4, 1, "last"))
            assert torch.equal(last, two_pass)
            assert not kernels._locks(x.device, 1).any()


def test_a_grown_counter_buffer_keeps_the_old_one_alive():
    """A CUDA graph captured with the smaller buffer still writes to it: growing must not free it."""
    from kiln.llm.kernels import gemv as kernels

    device = torch.device(DEVICE)
    before = kernels._locks(device, 1)
    grown = kernels._locks(device, before.numel() + 1)
    assert grown.numel() > before.numel() and not grown.any()
    assert any(t is before for t in kernels._OUTGROWN)
    assert kernels._locks(device, 1) is grown
