"""The model folder's tokenizer: tokenizer.json through `tokenizers`, the chat template from
tokenizer_config.json or chat_template.jinja rendered with jinja2 the way transformers renders it
(sandboxed, trim_blocks, lstrip_blocks, raise_exception, tojson), and incremental detokenization
for streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Tokenizer

from kiln.llm.config import LLMError


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise LLMError(f"{folder} has no tokenizer.json (kiln reads the fast tokenizer format only)")
        self.backend = _Tokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.chat_template = self._chat_template(folder, config)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self.token_to_id(self.special_tokens["eos_token"])
        self._compiled = None

    @staticmethod
    def _chat_template(folder: Path, config: dict) -> str | None:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return template

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.chat_template is None:
            raise LLMError("this model's tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                           "chat_template.jinja): use the completions API with a prompt instead")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special_tokens.items() if v is not None}, **kwargs)
        except jinja2.TemplateError as e:
            raise LLMError(f"the chat template refused these messages: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # the template writes the special tokens itself (as transformers' apply_chat_template(tokenize=True))
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def _compile(template: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise LLMError(f"the model's chat template does not parse: {e}") from None


class IncrementalDetokenizer:
    """Text for tokens as they arrive. Decodes a short window (prefix_offset..) with and without the
    newest tokens and emits the difference, holding it back while it ends in an incomplete UTF-8
    character (U+FFFD) — vLLM's scheme, right for byte-level BPE and SentencePiece alike."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-6:])  # a little context: leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = decode(self.token_ids[self.prefix_offset:], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is held back, incomplete characters included (as decode() would show them)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = decode(self.token_ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
