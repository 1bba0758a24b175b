"""kiln's Triton flash attention against torch SDPA at the benchmark's attention layers, on one GPU.

    python bench/attention.py [--configs all|default] [--cases bert_mask,bert,vit,gpt2,bert_b1,llama]

Each case is one kiln::Attention layer as kiln's optimizer hands it over: BERT/ViT/GPT-2 read q, k
and v as column slices of the QKV GEMM's [B, S, 3·H·D] output and write [B, S, H·D]; Llama reads
[B, S, H·D] q/k/v (GQA, causal). Every candidate runs the whole layer, layout included, as the
autotuner times it: each Triton tile config (the tactics cuda.attention.triton.*), kiln's default
(the op: SDPA, torch's backend choice), each SDPA backend forced (the tactics cuda.attention.flash /
.efficient / .cudnn, and math); plus, for scale, the SDPA kernel alone on contiguous [B, H, S, D], and a
padding-free engine's varlen flash attention on the layer's real tokens (no mask). Where the layer has key lengths
(a padding-free engine's plain program on CUDA: the key mask + kiln::KeyLengths), also cuDNN's own SDPA in its
padding mode on those lengths (nvidia-cudnn-frontend's torch.ops.cudnn.sdpa_fwd, seq_len_kv; prefix masks only): a
peer, measured slower than kiln's length path (bench/results/mask-2026-12-03.md), so no tactic.

Correctness first: each output against the op in fp32 (SDPA math) with the autotuner's tolerance for
the storage dtype; any failure prints FAIL and the script exits 1 after the table. Timing: 20 calls
captured in one CUDA graph (the engine replays graphs: no launch overhead counted), median of 10
replays. TFLOP/s counts 4·B·H·S·T·D (half of it when causal). The table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kiln.ops.fused import attention  # noqa: E402
from kiln.ops.tokens import key_lengths  # noqa: E402
from kiln.tactics.cuda.attention import attention_views  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.builder.accuracy import TOLERANCE, mismatch  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402
from gpu import graph_ms  # noqa: E402  bench/gpu.py

HEADS_LAST = [0, 2, 1, 3]
TRITON = "cuda.attention.triton."
SDPA_COLUMNS = {"default": "default (op)", "flash": "cuda.attention.flash", "efficient": "cuda.attention.efficient",
                "cudnn": "cuda.attention.cudnn", "math": "sdpa.math", "cudnn padded (key lengths)": "cudnn frontend "
                "sdpa_fwd, seq_len_kv"}
ALONE = "sdpa kernel alone, contiguous"
VARLEN = "flash varlen on the real tokens"


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    label: str
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    mask: str = ""  # "key": an additive [B, 1, 1, S] padding mask; "query_key": the same as [B, 1, S, S], as
    # transformers' exported BERT builds it (-3.4e38 where hidden: -inf in fp16), nan_to_zero as kiln fuses it;
    # "lengths": the key mask and its key lengths (kiln::KeyLengths), as a padding-free plain program reads it on CUDA;
    # "lengths only": the key lengths without a mask tensor (what the Triton kernel's length path costs alone);
    # "lengths, left": left padding, a padded row's key length -1 (the kernel's mask branch)
    full: bool = False  # a mask with no padding (every row real), as the plain program meets at the profile's max
    causal: bool = False
    packed: bool = True  # q/k/v as slices of one QKV GEMM output; else separate [B, S, H·D] tensors
    dtype: torch.dtype = torch.float16

    @property
    def flops(self) -> float:
        full = 4 * self.batch * self.heads * self.seq * self.seq * self.head_dim
        return full / 2 if self.causal else full


CASES = [
    Case("bert_mask", "BERT b64 h12 s384 d64 +[B,1,1,S] mask", 64, 12, 12, 384, 64, mask="key"),
    # BERT-base in issue 10's stream: the plain program at the largest shape (a full mask) and at the opt shape
    Case("bert512_qk", "BERT b32 h12 s512 d64 +[B,1,S,S] mask", 32, 12, 12, 512, 64, mask="query_key"),
    Case("bert512_key", "BERT b32 h12 s512 d64 +[B,1,1,S] mask", 32, 12, 12, 512, 64, mask="key"),
    Case("bert512", "BERT b32 h12 s512 d64", 32, 12, 12, 512, 64),
    # a full mask, as the padding-free plain program runs it at 32x512: today's key mask, and with key lengths
    Case("bert512_full_key", "BERT b32 h12 s512 d64 +[B,1,1,S] mask, full", 32, 12, 12, 512, 64, mask="key",
         full=True),
    Case("bert512_full_lengths", "BERT b32 h12 s512 d64 +key lengths, full", 32, 12, 12, 512, 64, mask="lengths",
         full=True),
    Case("bert512_lengths", "BERT b32 h12 s512 d64 +key lengths", 32, 12, 12, 512, 64, mask="lengths"),
    Case("bert512_left_lengths", "BERT b32 h12 s512 d64 +key lengths, left-padded", 32, 12, 12, 512, 64,
         mask="lengths, left"),
    Case("bert512_full_lengths_only", "BERT b32 h12 s512 d64 +key lengths, full, no mask tensor", 32, 12, 12, 512,
         64, mask="lengths only", full=True),
    Case("bert128_lengths", "BERT b8 h12 s128 d64 +key lengths", 8, 12, 12, 128, 64, mask="lengths"),
    Case("bert128_qk", "BERT b8 h12 s128 d64 +[B,1,S,S] mask", 8, 12, 12, 128, 64, mask="query_key"),
    Case("bert128_key", "BERT b8 h12 s128 d64 +[B,1,1,S] mask", 8, 12, 12, 128, 64, mask="key"),
    Case("bert", "BERT b64 h12 s384 d64", 64, 12, 12, 384, 64),
    Case("vit", "ViT-B/16 b64 h12 s197 d64", 64, 12, 12, 197, 64),
    Case("gpt2", "GPT-2 b8 h12 s512 d64 causal", 8, 12, 12, 512, 64, causal=True),
    Case("bert_b1", "BERT b1 h12 s128 d64", 1, 12, 12, 128, 64),
    Case("llama", "Llama GQA b4 hq32 hkv8 s1024 d128 causal", 4, 32, 8, 1024, 128, causal=True, packed=False),
]


def make_layer(case: Case, device: torch.device) -> tuple[StepSpec, list]:
    """The Attention step's attributes and its inputs, in the layout kiln's optimizer produces."""
    g = torch.Generator(device=device).manual_seed(0)
    b, s, h, hkv, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    attributes = dict(scale=d ** -0.5, q_num_heads=h, kv_num_heads=hkv, q_perm=HEADS_LAST, k_perm=HEADS_LAST,
                      v_perm=HEADS_LAST, out_perm=HEADS_LAST, out_merge_heads=1, is_causal=int(case.causal),
                      gqa=int(hkv != h))
    if case.packed:
        attributes["qkv_split"] = [h * d, hkv * d, hkv * d]
        inputs = [torch.randn(b, s, (h + 2 * hkv) * d, device=device, generator=g).to(case.dtype), None, None]
    else:
        inputs = [torch.randn(b, s, n * d, device=device, generator=g).to(case.dtype) for n in (h, hkv, hkv)]
    if case.mask:  # each sequence padded from a random length on, its padding keys hidden
        lengths = torch.randint(s if case.full else s // 2, s + 1, (b, 1, 1, 1), device=device, generator=g)
        keys = torch.arange(s, device=device).view(1, 1, 1, s)
        if case.mask == "key":  # -10000 on the padding keys: [B, 1, 1, S]
            inputs.append(torch.where(keys < lengths, 0.0, -10000.0).to(case.dtype))
        elif case.mask.startswith("lengths"):  # as remove_padding.key_padding_mask(key_lengths=True) feeds it
            real = keys >= s - lengths if case.mask == "lengths, left" else keys < lengths
            padding = real.view(b, s)
            inputs.append(None if case.mask == "lengths only" else
                          torch.where(padding, 0.0, torch.finfo(torch.float32).min).to(case.dtype).view(b, 1, 1, s))
            inputs.append(key_lengths(None, padding))
            attributes["nan_to_zero"] = 1  # as the plain program's attentions have it (the exported BERT's guard)
        else:  # every query's row of it: [B, 1, S, S]
            hidden = torch.where(keys < lengths, 0.0, torch.finfo(torch.float32).min).expand(b, 1, s, s)
            inputs.append(hidden.to(case.dtype).contiguous())
            attributes["nan_to_zero"] = 1
    step = StepSpec(op_type="Attention", name=case.key, inputs=[f"in{i}" for i in range(len(inputs))],
                    outputs=["out"], attributes=attributes, domain="kiln", opset=21)
    return step, inputs


def sdpa_backend_call(backend_name: str, step: StepSpec, inputs: list) -> Callable[[], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call():
        with sdpa_kernel([backend]):
            return attention(None, *inputs, **step.attributes)

    return call


def contiguous_sdpa_call(case: Case, device: torch.device) -> Callable[[], torch.Tensor]:
    """The SDPA kernel alone, torch's choice of backend, on contiguous [B, H, S, D] (GQA: k/v repeated first)."""
    shape = (case.batch, case.heads, case.seq, case.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=case.dtype) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)


def varlen_call(case: Case, step: StepSpec, inputs: list) -> Callable[[], torch.Tensor]:
    """A padding-free engine's attention on the layer's real tokens (cuda.packed_attention.flash_varlen): q/k/v
    gathered to [T, H, D], one sequence per row of the batch of its real length (S without a mask); no mask tensor."""
    from kiln.tactics.cuda.packed_attention import flash_varlen, packed_qkv

    b, s = case.batch, case.seq
    mask = inputs[3] if len(inputs) > 3 else None
    real = mask[:, 0, 0, :] == 0 if mask is not None else torch.ones(b, s, dtype=torch.bool, device=inputs[0].device)
    q, k, v = packed_qkv(inputs[0].flatten(0, 1)[real.reshape(-1)], None, None, step.attributes)  # [T, H, D]
    cu_seqlens = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(real.sum(1, dtype=torch.int32), 0, dtype=torch.int32, out=cu_seqlens[1:])
    return lambda: flash_varlen(q, k, v, cu_seqlens, s, step.attributes["scale"])


def cudnn_padded_call(step: StepSpec, inputs: list) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """cuDNN's SDPA in its padding mode (every query, each batch's first key_lengths[b] keys; no mask read) on the
    layer's strided q/k/v, through nvidia-cudnn-frontend's torch op; its output [B, H, S, D] laid out as q is
    (heads-last memory: the [B, S, H·D] the next GEMM reads). Prefix masks only (key lengths >= 0)."""
    try:
        import cudnn
        cudnn.sdpa_torch  # noqa: B018  registers torch.ops.cudnn.sdpa_fwd
    except Exception as e:  # noqa: BLE001  the frontend is optional: say why it is not in the table
        return None, f"nvidia-cudnn-frontend's torch op: {type(e).__name__}: {str(e)[:100]}"
    q, k, v = attention_views(inputs[0], inputs[1], inputs[2], step.attributes)  # [B, H, S, D] views
    batch, seq = q.shape[0], q.shape[2]
    if len(inputs) > 4:
        if (inputs[4] < 0).any():
            return None, "a key length of -1 (not a prefix mask): the padding mode cannot run it"
        lengths_kv = inputs[4].view(batch, 1, 1, 1)
    else:
        lengths_kv = torch.full((batch, 1, 1, 1), k.shape[2], dtype=torch.int32, device=q.device)
    lengths_q = torch.full((batch, 1, 1, 1), seq, dtype=torch.int32, device=q.device)  # every query row computed

    def call():
        out, _ = torch.ops.cudnn.sdpa_fwd(q, k, v, step.attributes["scale"], seq_len_q=lengths_q,
                                          seq_len_kv=lengths_kv, return_lse=False)
        return out.permute(0, 2, 1, 3).flatten(-2)  # [B, S, H·D], as the layer's output

    return call, ""


def candidates(case: Case, step: StepSpec, inputs: list, configs: str, device: torch.device):
    """name -> (call, note): every way to run the layer; a call of None is not supported (note says why)."""
    metas = [InputMeta.of(x, False) for x in inputs]
    found: dict[str, tuple[Callable[[], torch.Tensor] | None, str]] = {
        "default (op)": (lambda: attention(None, *inputs, **step.attributes), "")}
    level = 2 if configs == "default" else 5
    for tactic in registry.candidates("Attention", "kiln", "cuda", opt_level=level):
        ok = tactic.check(step, metas)
        if ok is not True:
            found[tactic.name] = (None, ok)
            continue
        launch = tactic.prepare(dataclasses.replace(step, tactic=tactic.name), [None] * len(inputs), device)
        found[tactic.name] = ((lambda launch=launch: launch(None, *inputs, **step.attributes)), "")
    found["sdpa.math"] = (sdpa_backend_call("MATH", step, inputs), "")
    if case.packed and not case.causal:
        found[VARLEN] = (varlen_call(case, step, inputs), "the real tokens only, not checked here "
                                                          "(tests/gpu/test_remove_padding.py checks it)")
    found[ALONE] = (contiguous_sdpa_call(case, device), "no layout work, not the layer")
    if case.mask.startswith("lengths") or not case.mask:
        found[SDPA_COLUMNS["cudnn padded (key lengths)"]] = cudnn_padded_call(step, inputs)
    return found


def run_case(case: Case, configs: str, device: torch.device) -> tuple[dict[str, tuple[float | None, str]], bool]:
    step, inputs = make_layer(case, device)
    with torch.inference_mode():  # the reference: the op in fp32, SDPA's math backend
        reference = sdpa_backend_call("MATH", step, [x.float() if x is not None and x.is_floating_point() else x
                                                     for x in inputs])()
    tolerance = {torch.float32: TOLERANCE[case.dtype]}  # the autotuner's bound for the storage dtype
    results: dict[str, tuple[float | None, str]] = {}
    ok = True
    for name, (call, note) in candidates(case, step, inputs, configs, device).items():
        ours = name.startswith(TRITON)  # a failing SDPA backend is torch's business, not a kiln failure
        if call is None:
            results[name] = (None, f"unsupported: {note}")
            continue
        try:
            with torch.inference_mode():
                out = call()
                if name not in (ALONE, VARLEN):
                    problem = mismatch(out.float(), reference, tolerance)
                    if problem:
                        ok &= not ours
                        results[name] = (None, f"{'FAIL ' if ours else 'wrong: '}{problem}")
                        continue
                    note = f"max err {(out.float() - reference).abs().max().item():.2e}" + (f"; {note}" if note else "")
                ms = graph_ms(call)
        except Exception as e:  # noqa: BLE001  reported in the table; one broken candidate does not hide the rest
            ok &= not ours
            results[name] = (None, f"{'FAIL ' if ours else ''}{type(e).__name__}: {str(e)[:120]}")
            continue
        results[name] = (ms, note)
    if not any(ms for name, (ms, _) in results.items() if name.startswith(TRITON)):
        ok = False  # the layer is one the kernel is meant for: no config running it is a failure too
        results["FAIL"] = (None, "no Triton config ran this layer")
    return results, ok


def table(rows: list[tuple[Case, dict[str, tuple[float | None, str]]]]) -> list[str]:
    """One markdown row per case: the fastest Triton config against each SDPA way of running the layer."""
    header = ["case", "best Triton config", "ms", "TFLOP/s", *SDPA_COLUMNS, "Triton vs best SDPA",
              "SDPA kernel alone"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def fmt(ms: float | None) -> str:
        return f"{ms:.4f}" if ms else "-"

    for case, results in rows:
        times = {name: ms for name, (ms, _) in results.items() if ms}
        triton = {name: ms for name, ms in times.items() if name.startswith(TRITON)}
        sdpa = {column: times.get(name) for column, name in SDPA_COLUMNS.items()}
        best = min(triton, key=triton.get, default=None)
        best_sdpa = min((ms for ms in sdpa.values() if ms), default=None)
        cells = [case.label, best.removeprefix(TRITON) if best else "none ran", fmt(triton.get(best)),
                 f"{case.flops / triton[best] / 1e9:.0f}" if best else "-", *(fmt(ms) for ms in sdpa.values()),
                 f"{best_sdpa / triton[best]:.2f}x" if best and best_sdpa else "-", fmt(times.get(ALONE))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", choices=("all", "default"), default="all",
                        help="Triton tile configs: all (opt_level 3+) or the default build's (opt_level 2)")
    parser.add_argument("--cases", default=",".join(c.key for c in CASES))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    wanted = args.cases.split(",")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {__import__('triton').__version__}", flush=True)
    rows, all_ok = [], True
    for case in [c for c in CASES if c.key in wanted]:
        start = time.perf_counter()
        results, ok = run_case(case, args.configs, device)
        all_ok &= ok
        print(f"\n[{case.key}] {case.label}  ({time.perf_counter() - start:.1f} s)")
        for name, (ms, note) in sorted(results.items(), key=lambda kv: (kv[1][0] is None, kv[1][0] or 0.0)):
            timing = f"{ms:8.4f} ms {case.flops / ms / 1e9:6.0f} TFLOP/s" if ms else " " * 24
            print(f"  {name:36s} {timing}  {note}", flush=True)
        rows.append((case, results))

    print()
    print("\n".join(table(rows)))
    print("\nPASS: every Triton config matched the fp32 reference" if all_ok else
          "\nFAIL: see the FAIL lines above")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
