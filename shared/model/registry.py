"""Models by name: the embedded default checkpoint ships in the repository under models/."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "tandem-demo-moe"
MODELS_ENV = "TANDEM_MODELS_DIR"  # where named models live (default: the repository's models/)


def models_dir() -> Path:
    return Path(os.environ.get(MODELS_ENV) or Path(__file__).resolve().parents[2] / "models")


def resolve_model(name_or_path: str | Path | None = None) -> Path:
    """A checkpoint directory from a path, a model name under models/, or None (the default model)."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    path = Path(name_or_path)
    if path.is_dir():
        return path
    named = models_dir() / str(name_or_path)
    if named.is_dir():
        return named
    available = sorted(p.name for p in models_dir().glob("*") if (p / "config.json").is_file())
    raise FileNotFoundError(
        f"model {str(name_or_path)!r} is neither a directory nor a model under {models_dir()} "
        f"(available: {', '.join(available) or 'none'})"
    )
