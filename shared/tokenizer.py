"""Tokenizer of a checkpoint directory (`tokenizer.json`, Hugging Face `tokenizers` format)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships without one (token-id prompts only)."""
    path = Path(model_dir) / TOKENIZER_FILE
    return Tokenizer.from_file(str(path)) if path.is_file() else None
