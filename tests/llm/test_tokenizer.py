"""kiln's tokenizer against transformers' on the same folder: encode, decode, the chat template
(transformers' apply_chat_template is the oracle), and incremental detokenization of random token
streams (multi-byte characters split across tokens) adding up to decode()."""

import random

import pytest
import transformers

from kiln.llm import LLMError
from kiln.llm.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.llm import checkpoints

TEXTS = ["Hello world", "Ünïcödé ✓ 日本語のテキスト 🔥", "  leading spaces\nand lines\n", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello kiln!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "日本語?"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    checkpoints.write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def both(folder):
    return Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)


def test_encode_decode_match_transformers(both):
    kiln_tok, hf = both
    for text in TEXTS:
        ids = kiln_tok.encode(text)
        assert ids == hf(text)["input_ids"]
        assert kiln_tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert kiln_tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert kiln_tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert kiln_tok.eos_token_id == hf.eos_token_id == checkpoints.EOS


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(both, generation_prompt):
    kiln_tok, hf = both
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        assert kiln_tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
        ids = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert kiln_tok.encode_chat(messages, add_generation_prompt=generation_prompt) == list(ids)


def test_template_errors_and_missing_template(folder, tmp_path):
    kiln_tok = Tokenizer(folder)
    kiln_tok.chat_template = "{{ raise_exception('no system messages') }}"
    kiln_tok._compiled = None
    with pytest.raises(LLMError, match="refused these messages: no system messages"):
        kiln_tok.apply_chat_template(CONVERSATIONS[0])
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(LLMError, match="no chat template"):
        Tokenizer(bare).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(LLMError, match="no tokenizer.json"):
        Tokenizer(tmp_path)


def test_incremental_detokenization_adds_up_to_decode(folder):
    kiln_tok = Tokenizer(folder)
    rng = random.Random(0)
    prompt = kiln_tok.encode("Ünïcödé ✓ 日本語")
    for trial in range(50):
        tokens = [rng.randrange(kiln_tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        if trial % 2:  # real text too, fed in random slices
            tokens = kiln_tok.encode(rng.choice(TEXTS[:3]) * 2, add_special_tokens=False)
        detok = IncrementalDetokenizer(kiln_tok, prompt)
        text, i = "", 0
        while i < len(tokens):
            step = rng.randrange(1, 4)
            piece = detok.add(tokens[i:i + step])
            assert "\ufffd" not in piece[-1:]  # never ends mid-character while more may come
            text += piece
            i += step
        text += detok.flush()
        assert text == kiln_tok.decode(tokens), tokens
