"""Corpus: scan *.py files under the roots, split off the held-out packages, deduplicate, fit the tokenizer,
encode the files and pack the train split into one token stream."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
from pathlib import Path

import numpy as np

HELD_OUT = ("json", "email", "http")  # stdlib packages never trained on (evaluation set)
EOS = "<|endoftext|>"  # id 0: document separator and eos
MAX_FILE_BYTES = 200_000
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def list_candidates(roots: list[Path]) -> list[tuple[Path, Path, int]]:
    """(root, file, size) of every *.py file, sorted by path; nested roots and site-packages pruned."""
    found = []
    for root in roots:
        nested = {o for o in roots if o != root and root in o.parents}
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = [n for n in dirnames if n not in SKIP_DIRS and here / n not in nested]
            for name in filenames:
                if name.endswith(".py"):
                    try:
                        found.append((root, here / name, (here / name).stat().st_size))
                    except OSError:
                        pass
    return sorted(found, key=lambda item: str(item[1]))


def scan_corpus(roots: list[Path], args: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    """(train texts, held-out texts, stats).

    Files are sorted by path and split by top-level package (HELD_OUT); every held-out file is
    read, the train files are read in a fixed-seed shuffled order until --max-files /
    --max-train-mb. Content duplicates are dropped, held-out content first (never trained on).
    """
    roots = list(dict.fromkeys(r.resolve() for r in roots if r.is_dir()))
    candidates = list_candidates(roots)
    skipped = {"too_large": 0, "undecodable": 0, "empty": 0, "duplicate": 0}
    split: dict[str, list[tuple[Path, Path]]] = {"held": [], "train": []}
    train_candidate_bytes = 0
    for root, path, size in candidates:
        if size > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            continue
        held = path.relative_to(root).parts[0].removesuffix(".py") in HELD_OUT
        split["held" if held else "train"].append((root, path))
        train_candidate_bytes += 0 if held else size
    train_candidates = len(split["train"])
    rng = random.Random(args.seed)
    rng.shuffle(split["train"])
    per_root = {str(r): {"train_files": 0, "heldout_files": 0} for r in roots}
    texts: dict[str, list[str]] = {"held": [], "train": []}
    packages: dict[str, int] = {}
    seen: set[str] = set()
    used = {"held": 0, "train": 0}
    for kind in ("held", "train"):
        for root, path in split[kind]:
            if kind == "train" and (used["train"] >= args.max_train_mb * 1e6
                                    or (args.max_files and len(texts["train"]) >= args.max_files)):
                break
            try:
                data = path.read_bytes()
                text = data.decode("utf-8")
            except (UnicodeDecodeError, OSError):
                skipped["undecodable"] += 1
                continue
            digest = hashlib.sha256(data).hexdigest()
            if not text.strip() or digest in seen:
                skipped["empty" if not text.strip() else "duplicate"] += 1
                continue
            seen.add(digest)
            texts[kind].append(text)
            used[kind] += len(data)
            per_root[str(root)]["heldout_files" if kind == "held" else "train_files"] += 1
            if kind == "held":
                top = path.relative_to(root).parts[0].removesuffix(".py")
                packages[top] = packages.get(top, 0) + 1
    rng.shuffle(texts["held"])
    stats = {
        "roots": [str(r) for r in roots], "per_root": per_root, "files_found": len(candidates),
        "skipped": skipped, "train_candidate_files": train_candidates,
        "train_candidate_bytes": train_candidate_bytes, "train_files": len(texts["train"]),
        "train_bytes": used["train"], "heldout_names": list(HELD_OUT),
        "heldout_missing": [n for n in HELD_OUT if n not in packages], "heldout_files": len(texts["held"]),
        "heldout_bytes": used["held"], "heldout_packages": packages,
    }
    return texts["train"], texts["held"], stats


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOS) == 0, "the eos token must be id 0"
    return tok


def encode(tok, texts: list[str], batch: int = 256) -> list[np.ndarray]:
    fn = getattr(tok, "encode_batch_fast", tok.encode_batch)
    out: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        out += [np.asarray(e.ids, dtype=np.int32) for e in fn(texts[i : i + batch], add_special_tokens=False)]
    return out


def tokenizer_subset(train_texts: list[str], megabytes: float) -> tuple[list[str], int]:
    """The first train files (already in fixed-seed shuffled order) up to ~megabytes."""
    subset, nbytes = [], 0
    for text in train_texts:
        if nbytes >= megabytes * 1e6:
            break
        subset.append(text)
        nbytes += len(text.encode())
    return subset, nbytes


def pack_stream(train_docs: list[np.ndarray]) -> np.ndarray:
    """The train docs as one token stream: each preceded by <|endoftext|> (id 0), one more at the end."""
    sep = np.zeros(1, dtype=np.int32)
    return np.concatenate([x for d in train_docs for x in (sep, d)] + [sep])
