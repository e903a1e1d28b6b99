"""Text <-> token ids for one model: the tokenizer and chat template shipped in the model directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Raw prompt: tokens exactly as the text reads (no BOS unless the tokenizer adds one)."""
        return list(self._tok.encode(text))

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Chat messages -> prompt ids, ending with the assistant turn's opening."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model has no chat template; send a raw prompt")
        out: Any = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self._tok.convert_ids_to_tokens(list(ids)))

    @property
    def hf(self):
        """The underlying `transformers` tokenizer (for detokenization helpers)."""
        return self._tok
