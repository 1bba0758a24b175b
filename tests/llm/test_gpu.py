"""On a CUDA device (skipped here): bf16 logits within bf16's error of transformers' fp32, the Triton
decode path generating what the torch path does, FP8 weights through torch._scaled_mm. Passed on the
H200 on 2026-12-01 (commits 9d73914, 3717590) through bench/llm_gpu.sh."""

import pytest
import torch

from kiln.llm import LLM, SamplingParams
from kiln.llm.evaluate import perplexity
from kiln.llm.request import Request
from kiln.llm.scheduler import ScheduledRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_bf16_logits_within_bf16_error_of_fp32(hf_models, name):
    folder, hf = hf_models(name)
    prompt = list(range(5, 60))
    with torch.no_grad():
        reference = hf.float()(torch.tensor([prompt])).logits[0]
        hf_bf16 = hf.to("cuda", torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
        hf.to("cpu", torch.float32)
    llm = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", block_size=16)
    runner = llm.engine.runner
    inputs = runner.prepare([ScheduledRequest(Request("r", prompt), prompt, 0, [1, 2, 3, 4])])
    inputs.logit_rows = torch.arange(len(prompt), device="cuda")
    kiln_bf16 = runner.forward(inputs).cpu()
    # kiln's bf16 error is of the size transformers' own bf16 run makes (bf16 rounding, 8-bit mantissa)
    assert (kiln_bf16 - reference).abs().max() <= 2 * (hf_bf16 - reference).abs().max() + 1e-2


def test_triton_decode_generates_what_torch_does_on_cuda(hf_models):
    folder, _ = hf_models("llama")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = ["Hello world", "Paged attention reads keys and values from blocks", "a"]
    common = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", block_size=16)
    torch_path = LLM(folder, attention_backend="torch", **common).generate(prompts, params)
    triton_path = LLM(folder, attention_backend="triton", **common).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in torch_path] == [o.outputs[0].token_ids for o in triton_path]


def test_fp8_scaled_mm_perplexity(hf_models):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    folder, _ = hf_models("llama")
    ids = list(range(5, 200))
    base = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB")
    fp8 = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", quantization="fp8")
    assert fp8.engine.model.layers[0].self_attn.qkv_proj.quantized.use_scaled_mm
    assert abs(perplexity(fp8.engine, ids) / perplexity(base.engine, ids) - 1) < 0.05


def test_fp8_rows_quantized_in_the_norm_and_swiglu_kernels_change_no_bit(hf_models, monkeypatch):
    """FP8 GEMMs read rows the norm and SwiGLU kernels quantized in the same pass (layers.takes_fp8_rows): the
    logits of a prefill and the greedy tokens of graphed decode steps are those of the GEMMs quantizing their
    own bf16 input, bit for bit."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    from kiln.llm.models import layers

    folder, _ = hf_models("llama")
    prompt = list(range(5, 60))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [prompt, list(range(7, 30)), [3, 4]]

    def run():
        # cuBLAS for decode rows too (no GEMV tuning, no decode-layer fusion): every step's GEMMs are FP8 GEMMs
        llm = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", block_size=16,
                  quantization="fp8", gemv="cublas", decode_fusion="off")
        runner = llm.engine.runner
        inputs = runner.prepare([ScheduledRequest(Request("r", prompt), prompt, 0, [1, 2, 3, 4])])
        inputs.logit_rows = torch.arange(len(prompt), device="cuda")
        return llm, runner.forward(inputs), [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    llm, fused_logits, fused_tokens = run()
    assert layers.takes_fp8_rows(llm.engine.model.layers[0].mlp.down_proj, len(prompt))
    monkeypatch.setattr(layers, "takes_fp8_rows", lambda linear, rows: False)
    _, logits, tokens = run()
    assert torch.equal(fused_logits, logits)
    assert fused_tokens == tokens


def test_fp8_rows_change_no_bit_at_llama3_8b_width(tmp_path, monkeypatch):
    """The same at Llama-3-8B's widths (4096 hidden, 14336 intermediate; 2 layers of random weights) over a
    4,096-token prefill, every row's logits: rows this wide are where the order of a norm's sum of squares shows. The
    FP8 norm once summed in another register layout than rms_norm (bench/results/llm-2026-12-03c.md): ~0.05% of
    rows got another E4M3 row (bench/fp8_norm_sum_order.py), ~8 of this prefill's, which the test above (64 wide,
    55 rows) never saw and a 512 x 128/128 run of the 8B model turned into other greedy tokens."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    import transformers

    from kiln.llm.models import layers

    transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=1024, max_position_embeddings=4096,
                             tie_word_embeddings=False).save_pretrained(tmp_path)
    llm = LLM(tmp_path, dtype="bfloat16", device="cuda", load_format="dummy", seed=0, quantization="fp8",
              kv_cache_memory="1GiB", block_size=16, max_num_batched_tokens=4096, max_model_len=4096, gemv="cublas",
              decode_fusion="off", cuda_graphs=False)
    runner = llm.engine.runner
    prompt = torch.randint(3, 1024, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    inputs = runner.prepare([ScheduledRequest(Request("r", prompt), prompt, 0, list(range(1, 257)))])
    inputs.logit_rows = torch.arange(len(prompt), device="cuda")
    assert layers.takes_fp8_rows(llm.engine.model.layers[0].mlp.down_proj, len(prompt))
    fused = runner.forward(inputs)
    monkeypatch.setattr(layers, "takes_fp8_rows", lambda linear, rows: False)
    unfused = runner.forward(inputs)
    differing = (fused != unfused).any(-1).nonzero().flatten().tolist()
    assert not differing, f"rows whose logits differ with the fused FP8 quantization: {differing[:20]}"
