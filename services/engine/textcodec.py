"""Text <-> token ids for the reference engine.

Runs trained from a transformers config usually carry no tokenizer files (nothing may
be downloaded here), so the engine falls back to a byte codec: token id = UTF-8 byte
value modulo the vocabulary. When the checkpoint directory holds tokenizer files, the
real tokenizer is used instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...


class ByteCodec:
    """Bytes as tokens: lossless for vocabularies of at least 256 entries."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
        return "\n".join([*lines, "assistant:"])


class HFCodec:
    """A transformers tokenizer found in the checkpoint directory."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return str(
                self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
        return ByteCodec(1 << 30).render_chat(messages)


def load_codec(model_dir: Path, vocab_size: int) -> TextCodec:
    if any((model_dir / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return HFCodec(AutoTokenizer.from_pretrained(model_dir))
    return ByteCodec(vocab_size)
