"""Text <-> token ids for one model: the `tokenizer.json` and chat template shipped in the model directory.

Read with the `tokenizers` library and rendered with jinja2 exactly as `transformers` does (a sandboxed environment
with its options, globals and `tojson`; the rendered chat tokenized without special tokens added), but without
`transformers`, which loads torch: the gateway only tokenizes and routes. The suite checks both agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(token: object) -> str | None:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken's dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's (the one named `default` when
    it holds several)."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        self._tok = _Backend.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {name: t for name in SPECIAL_TOKENS if (t := _content(config.get(name))) is not None}
        self.eos_token_id: int | None = self._id(self.special_tokens.get("eos_token"))
        self.bos_token_id: int | None = self._id(self.special_tokens.get("bos_token"))
        self._add_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None
        self._add_eos = bool(config.get("add_eos_token")) and self.eos_token_id is not None
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(model_dir, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raw prompt: tokens exactly as the text reads, plus what the tokenizer adds (a BOS, where it does)."""
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:  # flags the tokenizer.json's post-processor may not carry (older Llama configs)
            if self._add_bos and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self._add_eos and (not ids or ids[-1] != self.eos_token_id):
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None) -> str:
        """Chat messages (and the tools on offer, as transformers passes them) as the template writes them,
        ending with the assistant turn's opening."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a raw prompt")
        return self._template.render(
            messages=list(messages), tools=tools, add_generation_prompt=True, **self.special_tokens
        )

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """Chat messages -> prompt ids (the template writes the special tokens; none are added)."""
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given (else the gateway offers them in a system
        message: `gateway.tool_calls`)."""
        return "tools" in (self.chat_template or "")

    @cached_property
    def _template(self) -> Any:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template or "")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return _clean_up(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_CLEAN_UP: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: spaces before punctuation and English contractions removed."""
    for old, new in _CLEAN_UP:
        text = text.replace(old, new)
    return text
