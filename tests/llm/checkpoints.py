"""Hugging Face model folders written here, from transformers configs with random weights (no hub):
config.json, *.safetensors, generation_config.json, and a byte-level BPE tokenizer.json trained on a
few sentences with a chat template. Each returns (folder, the transformers model) for use as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 320  # the tokenizer's size; every test config uses it
BOS, EOS = 0, 1
SPECIAL = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, hello kiln! Paged attention reads keys and values from fixed-size blocks.",
    "In-flight batching admits new requests every step; prefix caching computes a shared prompt once.",
    "Ünïcödé ✓ 日本語のテキスト, emoji 🔥 and numbers 12345 67890.",
]

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS)


def write_tokenizer(folder: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                             special_tokens=[("<|bos|>", BOS)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL[BOS],
                                                eos_token=SPECIAL[EOS])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def _finish(model, folder: Path, seed: int, **save) -> tuple[Path, torch.nn.Module]:
    with torch.no_grad():  # transformers' init is small; wider weights make logits (and argmaxes) distinct
        generator = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.15)
            else:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    model.eval()
    model.save_pretrained(folder, **save)
    write_tokenizer(folder)
    return folder, model


def llama(folder: Path, seed: int = 0, shard: bool = False, **overrides) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SMALL, **overrides})
    return _finish(transformers.LlamaForCausalLM(config), folder, seed, **({"max_shard_size": "40KB"} if shard else {}))


def qwen2(folder: Path, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**{**SMALL, **overrides})
    return _finish(transformers.Qwen2ForCausalLM(config), folder, seed)


def mistral(folder: Path, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(seed)
    config = transformers.MistralConfig(**{**SMALL, "sliding_window": 12, **overrides})
    return _finish(transformers.MistralForCausalLM(config), folder, seed)


def gpt2(folder: Path, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                               bos_token_id=BOS, eos_token_id=EOS), **overrides})
    return _finish(transformers.GPT2LMHeadModel(config), folder, seed)
