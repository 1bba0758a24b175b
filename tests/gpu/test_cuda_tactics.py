"""CUDA tactics on the H200 (`pytest tests/gpu/test_cuda_tactics.py -s`): every tactic of kiln/tactics/cuda/library.py
and memory_bound.py against the op's registered implementation at real layer sizes in fp16 (and bf16 where it matters),
captured into a CUDA graph and replayed (no host synchronisation inside a launch), with a printed
timing table (never asserted: tests do not assert on time); then small CNN and transformer engines built
with device="cuda", precision="fp16", autotuned, their chosen tactics printed, against onnxruntime fp32.

Run it on its own, not in one pytest session with tests/kernels or tests/unit/test_tactics_cuda.py: those
set TRITON_INTERPRET=1, which would run the Triton tactics in the CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.builder.accuracy import mismatch
from kiln.builder.measure import measure
from kiln.tactics.tactic import InputMeta
from tests.gpu.common import graph_replay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (an interpreter test ran in this session): run tests/gpu alone"),
]

DEVICE = torch.device("cuda")


@pytest.fixture(autouse=True)
def _compiled_triton():
    """Checked again at run time: a tests/kernels conftest collected later in the session sets TRITON_INTERPRET."""
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        pytest.skip("TRITON_INTERPRET is set in this session: run tests/gpu/test_cuda_tactics.py alone")
FP16, BF16 = torch.float16, torch.bfloat16


@dataclasses.dataclass
class Case:
    """One layer at a real size: the step, its inputs (made on the GPU in the test) and which are weights."""

    label: str
    step: StepSpec
    make: Callable[[], list]
    constant: frozenset = frozenset()


def step(op_type: str, domain: str, n_inputs: int, n_outputs: int = 1, opset: int = 21, **attributes) -> StepSpec:
    return StepSpec(op_type=op_type, name=f"{op_type.lower()}_0", inputs=[f"in{i}" for i in range(n_inputs)],
                    outputs=[f"out{i}" for i in range(n_outputs)], attributes=attributes, domain=domain, opset=opset)


def randn(*shape, dtype=FP16, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def cases() -> list[Case]:
    bert = (64 * 384, 768)  # BERT-base batch 64 seq 384: rows x hidden
    return [
        Case("Elementwise bias+GELU 24576x3072", step("Elementwise", "kiln", 2, code=["Add i0 i1", "Gelu t0"]),
             lambda: [randn(bert[0], 3072), randn(3072)], frozenset({1})),
        Case("Elementwise x*sigmoid(x)*y 4096x11008 bf16",
             step("Elementwise", "kiln", 2, code=["Sigmoid i0", "Mul i0 t0", "Mul t1 i1"]),
             lambda: [randn(4096, 11008, dtype=BF16), randn(4096, 11008, dtype=BF16)]),
        Case("skip-LayerNorm 24576x768 (2 outputs)", step("LayerNorm", "kiln", 4, n_outputs=2, epsilon=1e-12),
             lambda: [randn(*bert), randn(768), randn(768), randn(*bert)], frozenset({1, 2})),
        Case("LayerNormalization 24576x768", step("LayerNormalization", "", 3, opset=17, epsilon=1e-5),
             lambda: [randn(*bert), randn(768), randn(768)], frozenset({1, 2})),
        Case("RMSNorm 8192x4096 bf16", step("RMSNorm", "kiln", 2, epsilon=1e-6),
             lambda: [randn(8192, 4096, dtype=BF16), randn(4096, dtype=BF16)], frozenset({1})),
        Case("Softmax scores 8x12x384x384", step("Softmax", "kiln", 1, axis=-1),
             lambda: [randn(8, 12, 384, 384, scale=3)]),
        Case("Softmax vocab 512x50257 (onnx)", step("Softmax", "", 1, opset=13),
             lambda: [randn(512, 50257, scale=3)]),
        Case("FusedGemm FFN1 24576x768->3072 +GELU",
             step("FusedGemm", "kiln", 3, activation="Gelu"),
             lambda: [randn(*bert), randn(3072, 768, scale=0.03), randn(3072)], frozenset({1, 2})),
        Case("FusedGemm FFN2 24576x3072->768 +residual",
             step("FusedGemm", "kiln", 4, residual_after_activation=1),
             lambda: [randn(bert[0], 3072), randn(768, 3072, scale=0.02), randn(768), randn(*bert)],
             frozenset({1, 2})),
        Case("FusedGemm GPT-2 FFN1 4096x768->3072 no bias +GeluTanh",  # the epilogue on a zero bias
             step("FusedGemm", "kiln", 2, activation="GeluTanh"),
             lambda: [randn(4096, 768), randn(3072, 768, scale=0.03)], frozenset({1})),
        Case("FusedGemm batch-1 1x768->3072 +GeluTanh", step("FusedGemm", "kiln", 3, activation="GeluTanh"),
             lambda: [randn(1, 768), randn(3072, 768, scale=0.03), randn(3072)], frozenset({1, 2})),
        Case("FusedGemm QKV 8x128x768->2304 bf16", step("FusedGemm", "kiln", 3),
             lambda: [randn(8, 128, 768, dtype=BF16), randn(2304, 768, dtype=BF16, scale=0.03),
                      randn(2304, dtype=BF16)],
             frozenset({1, 2})),
        Case("FusedConv ViT patch embedding 64x3x224x224 16x16/16",
             step("FusedConv", "kiln", 3, kernel_shape=[16, 16], strides=[16, 16]),
             lambda: [randn(64, 3, 224, 224), randn(768, 3, 16, 16, scale=0.02), randn(768)], frozenset({1, 2})),
        Case("FusedConv ResNet 256x64x56x56 3x3 +res +ReLU",
             step("FusedConv", "kiln", 4, kernel_shape=[3, 3], pads=[1, 1, 1, 1], activation="Relu"),
             lambda: [randn(256, 64, 56, 56), randn(64, 64, 3, 3, scale=0.05), randn(64), randn(256, 64, 56, 56)],
             frozenset({1, 2})),
        Case("FusedConv batch-1 1x256x14x14 3x3 +ReLU",
             step("FusedConv", "kiln", 3, kernel_shape=[3, 3], pads=[1, 1, 1, 1], activation="Relu"),
             lambda: [randn(1, 256, 14, 14), randn(256, 256, 3, 3, scale=0.02), randn(256)], frozenset({1, 2})),
        Case("FusedConv depthwise 32x96x112x112 stride 2 +Clip",
             step("FusedConv", "kiln", 3, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], group=96,
                  activation="Clip", alpha=0.0, beta=6.0),
             lambda: [randn(32, 96, 112, 112), randn(96, 1, 3, 3, scale=0.3), randn(96)], frozenset({1, 2})),
        Case("FusedConv1d Wav2Vec2 positional 1x768x49 128 taps 16 groups +GELU",
             step("FusedConv", "kiln", 3, kernel_shape=[128], pads=[64, 64], group=16, activation="Gelu"),
             lambda: [randn(1, 768, 49), randn(768, 48, 128, scale=0.01), randn(768)], frozenset({1, 2})),
        Case("FusedConv1d Wav2Vec2 positional batch 16x768x249", step("FusedConv", "kiln", 3, kernel_shape=[128],
             pads=[64, 64], group=16), lambda: [randn(16, 768, 249), randn(768, 48, 128, scale=0.01), randn(768)],
             frozenset({1, 2})),
        Case("InstanceNormalization Wav2Vec2 1x512x3199", step("InstanceNormalization", "", 3, epsilon=1e-5),
             lambda: [randn(1, 512, 3199, scale=4), randn(512), randn(512)], frozenset({1, 2})),
        Case("Rotary Phi-3 q of a packed qkv 8x512x(32x96) fp16", step("Rotary", "kiln", 3, num_heads=32),
             lambda: [randn(8, 512, 3 * 3072)[..., :3072], randn(8, 512, 1, 96).clamp(-1, 1),
                      randn(8, 512, 1, 96).clamp(-1, 1)]),
        Case("Rotary Llama k 4x1024x8x128 bf16", step("Rotary", "kiln", 3),
             lambda: [randn(4, 1024, 8, 128, dtype=BF16), randn(1024, 1, 128, dtype=BF16).clamp(-1, 1),
                      randn(1024, 1, 128, dtype=BF16).clamp(-1, 1)]),
        Case("Rotary Phi-3 small packed qkv 8x512x(24x64), q and k heads rotated fp16",
             step("Rotary", "kiln", 3, num_heads=24, rotate_heads=16),
             lambda: [randn(8, 512, 1536), randn(1, 512, 1, 64).clamp(-1, 1), randn(1, 512, 1, 64).clamp(-1, 1)]),
        Case("FusedGemm SwiGLU Phi-3 small gate|up 8x512x512->2x1376",  # kiln/tactics/cuda/swiglu.py
             step("FusedGemm", "kiln", 2, activation="SwiGLU", residual_after_activation=1),
             lambda: [randn(8, 512, 512), randn(2752, 512, scale=0.04)], frozenset({1})),
        Case("FusedGemm SwiGLU Llama-7B gate|up 1x128x4096->2x11008 bf16 +bias",
             step("FusedGemm", "kiln", 3, activation="SwiGLU", residual_after_activation=1),
             lambda: [randn(1, 128, 4096, dtype=BF16), randn(22016, 4096, dtype=BF16, scale=0.015),
                      randn(22016, dtype=BF16)], frozenset({1, 2})),
        Case("FusedGemm LM head 8x512x512->32064 storing the fp32 output (output_float32)",  # kiln/builder/precision.py
             step("FusedGemm", "kiln", 2, output_float32=1),
             lambda: [randn(8, 512, 512), randn(32064, 512, scale=0.04)], frozenset({1})),
        Case("FusedGemm DCN cross layer 256x845->845 (K, N not multiples of 8)",  # kiln/tactics/cuda/gemm_padded.py
             step("FusedGemm", "kiln", 3), lambda: [randn(256, 845), randn(845, 845, scale=0.03), randn(845)],
             frozenset({1, 2})),
        Case("FusedGemm DCN deep layer 256x845->1024 +ReLU", step("FusedGemm", "kiln", 3, activation="Relu"),
             lambda: [randn(256, 845), randn(1024, 845, scale=0.03), randn(1024)], frozenset({1, 2})),
        Case("EmbeddingConcat DCN 256 rows, dense 13 + 26 fields x 100000 x 32",
             step("EmbeddingConcat", "kiln", 28, fields=[-1, *range(26)]),
             lambda: [torch.randint(-100000, 100000, (256, 26), device=DEVICE), randn(256, 13),
                      *(randn(100000, 32) for _ in range(26))], frozenset(range(2, 28))),
        Case("Attention BERT 64x12x384x64", step("Attention", "kiln", 3, scale=0.125),
             lambda: [randn(64, 12, 384, 64) for _ in range(3)]),
        Case("Attention BERT + padding mask [64,1,1,384]", step("Attention", "kiln", 4, scale=0.125),
             lambda: [*(randn(64, 12, 384, 64) for _ in range(3)),
              torch.where(torch.rand(64, 1, 1, 384, device=DEVICE) < 0.1, -10000.0, 0.0).to(FP16)]),
        Case("Attention GPT-2 causal [B,S,H*D] layout 8x512x768",
             step("Attention", "kiln", 3, scale=0.125, is_causal=1, q_num_heads=12, kv_num_heads=12,
                  q_perm=[0, 2, 1, 3], k_perm=[0, 2, 1, 3], v_perm=[0, 2, 1, 3], out_perm=[0, 2, 1, 3],
                  out_merge_heads=1),
             lambda: [randn(8, 512, 768) for _ in range(3)]),
        Case("Attention Llama GQA causal 4x32/8x1024x128 bf16",
             step("Attention", "kiln", 3, scale=128 ** -0.5, is_causal=1, gqa=1),
             lambda: [randn(4, 32, 1024, 128, dtype=BF16), randn(4, 8, 1024, 128, dtype=BF16),
              randn(4, 8, 1024, 128, dtype=BF16)]),
    ]


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.label)
def test_every_tactic_matches_the_default_and_replays_in_a_cuda_graph(case):
    torch.manual_seed(0)
    s, args = case.step, case.make()
    metas = [InputMeta.of(a, i in case.constant) for i, a in enumerate(args)]
    ctx = OpContext(name=s.name, op_type=s.op_type, domain=s.domain, opset=s.opset, num_inputs=len(args),
                    num_outputs=len(s.outputs))
    default = lookup(s.op_type, s.domain).fn
    with torch.inference_mode():
        expected = default(ctx, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **s.attributes)
    constants = [a if i in case.constant else None for i, a in enumerate(args)]
    timed = {"default": lambda: default(ctx, *args, **s.attributes)}
    problems, lines = [], []
    for tactic in registry.candidates(s.op_type, s.domain, "cuda", opt_level=5):
        ok = tactic.check(s, metas)
        if ok is not True:
            lines.append(f"  {tactic.name:44s} unsupported: {ok}")
            continue
        try:
            launch = tactic.prepare(dataclasses.replace(s, tactic=tactic.name), constants, DEVICE)
            laid_out = [tactic.to_layout(a) for a in args]
            with torch.inference_mode():
                problem = mismatch(launch(ctx, *laid_out, **s.attributes), expected)
                problem = problem or mismatch(graph_replay(lambda: launch(ctx, *laid_out, **s.attributes)), expected)
        except Exception as e:  # noqa: BLE001  collected, every tactic reported before the assert
            problem = f"{type(e).__name__}: {str(e)[:300]}"
        if problem:
            problems.append(f"{tactic.name}: {problem}")
            lines.append(f"  {tactic.name:44s} FAILED: {problem}")
            continue
        timed[tactic.name] = (lambda launch=launch, laid_out=laid_out: launch(ctx, *laid_out, **s.attributes))
    with torch.inference_mode():
        times = measure(timed, DEVICE, runs=20, budget_s=2.0)
    print(f"\n[tactics] {case.label}")
    for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"  {name:44s} {ms:9.4f} ms  {times['default'] / ms:5.2f}x vs default")
    print("\n".join(lines))
    assert len(timed) > 1 or not [t for t in registry.candidates(s.op_type, s.domain, "cuda", 5)
                                  if t.check(s, metas) is True], "no tactic ran"
    assert not problems, problems


# ---- whole engines -----------------------------------------------------------------------------

class CNN(torch.nn.Module):
    """ResNet-ish: conv-BN-ReLU stem, a residual block, a depthwise conv, pooled into a classifier."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU())
        self.c1 = torch.nn.Conv2d(64, 64, 3, padding=1)
        self.c2 = torch.nn.Conv2d(64, 64, 3, padding=1)
        self.dw = torch.nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.pw = torch.nn.Conv2d(64, 128, 1)
        self.fc = torch.nn.Linear(128, 100)

    def forward(self, x):
        y = self.stem(x)
        y = torch.relu(self.c2(torch.relu(self.c1(y))) + y)
        y = torch.nn.functional.relu6(self.pw(torch.nn.functional.relu6(self.dw(y))))
        return self.fc(y.mean(dim=(2, 3)))


class Transformer(torch.nn.Module):
    """Two BERT-style encoder layers (GELU FFN) on embeddings."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 256)
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0, activation="gelu")
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, ids):
        return self.encoder(self.emb(ids))


MODELS = {
    "cnn": (CNN, lambda: torch.randn(32, 3, 64, 64)),
    "transformer": (Transformer, lambda: torch.randint(0, 1000, (8, 128))),
}


def _print_tactics(name: str, header: dict) -> list[str]:
    """The chosen tactic of every tuned layer, its runner-up and every candidate; returns the rejections."""
    record = header["tactics"]
    print(f"\n[engine] {name}: {record.get('skipped') or record.get('reverted') or ''}")
    rejected = []
    for layer, found in record.get("layers", {}).items():
        ms = f"{found['time_ms']:.4f} ms" if found["time_ms"] is not None else ""
        runner = f"runner-up {found['runner_up']} {found['runner_up_ms']:.4f} ms" if found["runner_up"] else ""
        print(f"  {layer:40s} {found['tactic']:44s} {ms:>12s}  {runner}")
        for candidate, note in found["candidates"].items():
            if isinstance(note, str):
                print(f"      {candidate}: {note}")
                if note.startswith("rejected"):
                    rejected.append(f"{layer} {candidate}: {note}")
    return rejected


@pytest.mark.parametrize("name", list(MODELS))
def test_engine_autotunes_cuda_tactics_and_matches_onnxruntime(name, tmp_path):
    import onnxruntime as ort

    import kiln

    cls, make_input = MODELS[name]
    torch.manual_seed(0)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(cls().eval(), (make_input(),), str(path), dynamo=True, input_names=["x"],
                      output_names=["y"])
    cache = tmp_path / "timing_cache.json"
    engine = kiln.build(str(path), device="cuda", precision="fp16", timing_cache=str(cache))
    rejected = _print_tactics(name, engine.plan.header)
    chosen = {s.name: s.tactic for s in engine.plan.program.steps if s.tactic}
    print(f"  cuda tactics chosen: {json.dumps(chosen, indent=1)}")

    x = make_input().numpy()
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.run({"x": x})["y"]
    # fp16 storage, fp32 accumulation: a few half ulps per layer, relative to the output's scale
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * max(1.0, scale))
    assert "reverted" not in engine.plan.header["tactics"], engine.plan.header["tactics"]["reverted"]
    assert not rejected, rejected  # a candidate that passed supports() gave a wrong result or failed

    # A rebuild with the warm timing cache times nothing and picks the same tactics.
    again = kiln.build(str(path), device="cuda", precision="fp16", timing_cache=str(cache))
    assert {s.name: s.tactic for s in again.plan.program.steps if s.tactic} == chosen
    assert again.plan.header["tactics"]["cache"]["misses"] == 0

    # The engine's CUDA graph replays the tuned steps correctly.
    context = again.create_execution_context()
    for _ in range(2):
        y = context.run({"x": torch.from_numpy(x).to(DEVICE)})["y"]
        np.testing.assert_allclose(y.float().cpu().numpy(), expected, rtol=2e-2, atol=2e-2 * max(1.0, scale))


def test_measure_times_candidates_as_cuda_graph_replays_and_one_that_syncs_eagerly():
    """The autotuner times candidates as the engine runs them: inside a CUDA graph, without host launch cost; a
    candidate that syncs with the host (a quantized layer's reference default) eagerly, and only that one."""
    from kiln.builder import measure as measure_module

    x = torch.randn(64, device=DEVICE)
    chain = lambda: [x.mul(1.0001) for _ in range(50)]  # noqa: E731  50 tiny kernels: launch-bound when eager
    one = lambda: x.mul(1.0001)  # noqa: E731
    replays = measure_module._graph_replays({"chain": chain, "one": one})
    assert replays is not None and set(replays) == {"chain", "one"}
    graphed = measure({"chain": chain, "one": one}, DEVICE)
    eager = {"chain": statistics.median(measure_module._time_once(chain, DEVICE) for _ in range(10))}
    print(f"\n50 tiny kernels: {graphed['chain'] * 1e3:.1f} us in a graph, {eager['chain'] * 1e3:.1f} us eager")
    assert graphed["chain"] > 0 and graphed["one"] > 0  # printed, not asserted: tests do not assert on time
    syncs = lambda: x.sum().item()  # noqa: E731
    assert set(measure_module._graph_replays({"one": one, "syncs": syncs, "chain": chain})) == {"one", "chain"}
    timed = measure({"one": one, "syncs": syncs, "chain": chain}, DEVICE)  # "syncs" eagerly, no exception
    assert set(timed) == {"one", "syncs", "chain"} and all(t > 0 for t in timed.values())
    print(f"beside a syncing candidate: 50 tiny kernels {timed['chain'] * 1e3:.1f} us (a graph's time)")
