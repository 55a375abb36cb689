"""Evaluation of the saved checkpoint through our inference code (shared.model.load_model): next-token and
MTP loss / top-1 on held-out chunks, the suffix-match baseline, expert usage entropy, and logit parity
between the training twin and the loaded checkpoint."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.model import FULL_ROUTING, load_model
from shared.model.moe import MoeBlock

from .common import log
from .twin import Twin


def eval_chunks(docs: list[np.ndarray], max_tokens: int, chunk_len: int) -> list[np.ndarray]:
    """Each doc as [eos] + tokens, cut into chunks of <= chunk_len, until max_tokens in all."""
    chunks, total = [], 0
    for doc in docs:
        seq = np.concatenate([[0], doc]).astype(np.int64)
        for s in range(0, len(seq), chunk_len):
            piece = seq[s : s + chunk_len][: max_tokens - total]
            if len(piece) >= 4:
                chunks.append(piece)
                total += len(piece)
            if total >= max_tokens - 4:
                return chunks
    return chunks


def suffix_match(ids: np.ndarray, min_len: int = 3, max_len: int = 32) -> tuple[int, int]:
    """(predicted, correct) over positions 0..n-2: longest earlier suffix match (newest) → next token."""
    n, hashes, base = len(ids), np.zeros(len(ids), dtype=np.uint64), np.uint64(0x9E3779B97F4A7C15)
    best = np.full(n, -1, dtype=np.int64)  # end of the newest earlier occurrence of the longest suffix
    for length in range(1, min(max_len, n) + 1):
        nxt = np.zeros(n, dtype=np.uint64)
        nxt[length - 1 :] = hashes[length - 2 : n - 1] * base if length > 1 else 0
        nxt[length - 1 :] += ids[length - 1 :].astype(np.uint64) + np.uint64(1)
        hashes = nxt
        if length < min_len:
            continue
        ends = np.arange(length - 1, n)
        order = np.argsort(hashes[ends], kind="stable")
        same = hashes[ends][order[1:]] == hashes[ends][order[:-1]]
        best[ends[order[1:]][same]] = ends[order[:-1]][same]  # ascending ends: predecessor = newest earlier
    pos = np.nonzero(best[: n - 1] >= 0)[0]
    return len(pos), int((ids[best[pos] + 1] == ids[pos + 1]).sum())


@torch.no_grad()
def evaluate(model, chunks: list[np.ndarray], device: torch.device, count_routes: bool) -> dict:
    counts: dict[str, Tensor] = {}
    hooks = []
    for name, module in model.named_modules() if count_routes else []:
        if isinstance(module, MoeBlock):
            def hook(block, args, name=name):
                ids, _ = block.route(args[0], FULL_ROUTING)
                counts[name] = counts.get(name, 0) + torch.bincount(ids.reshape(-1), minlength=model.config.num_experts)
            hooks.append(module.register_forward_pre_hook(hook))
    s = dict.fromkeys(["ce", "ok", "n", "mce", "mok", "mn", "sp", "sok"], 0.0)
    for piece in chunks:
        ids = torch.from_numpy(piece).to(device)
        logits, hidden = model.score(ids)
        s["ce"] += F.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
        s["ok"] += (logits[:-1].argmax(-1) == ids[1:]).sum().item()
        s["n"] += len(piece) - 1
        mtp = model.score_mtp(hidden, ids)[:-1]  # row i predicts ids[i+2]
        s["mce"] += F.cross_entropy(mtp, ids[2:], reduction="sum").item()
        s["mok"] += (mtp.argmax(-1) == ids[2:]).sum().item()
        s["mn"] += len(piece) - 2
        predicted, correct = suffix_match(piece)
        s["sp"], s["sok"] = s["sp"] + predicted, s["sok"] + correct
    for h in hooks:
        h.remove()
    entropy = {}
    for name, c in counts.items():
        p = c.double() / c.sum()
        entropy[name] = {"entropy_bits": round(-(p[p > 0] * p[p > 0].log2()).sum().item(), 4),
                         "max_bits": round(math.log2(len(c)), 4), "counts": c.tolist()}
    return {"chunks": len(chunks), "tokens": int(sum(len(p) for p in chunks)), "loss": s["ce"] / s["n"],
            "top1_accuracy": s["ok"] / s["n"], "mtp_loss": s["mce"] / s["mn"], "mtp_top1_agreement": s["mok"] / s["mn"],
            "suffix3_precision_all_positions": s["sok"] / s["n"], "suffix3_coverage": s["sp"] / s["n"],
            "suffix3_precision_when_predicted": s["sok"] / max(s["sp"], 1), "expert_usage": entropy}


@torch.no_grad()
def parity(twin: Twin, model, piece: np.ndarray, device: torch.device) -> dict:
    """Max |logit difference| between the twin (bf16-rounded weights, fp32) and the loaded checkpoint."""
    ids = torch.from_numpy(piece[:256]).to(device)
    hidden, _ = twin.trunk(ids[None])
    mtp_hidden, _ = twin.mtp_forward(hidden[:, :-1], ids[None, 1:])
    logits, ref_hidden = model.score(ids)
    ref_mtp = model.score_mtp(ref_hidden, ids)
    return {"tokens": len(ids), "max_abs_diff_logits": (twin.logits(hidden)[0] - logits).abs().max().item(),
            "max_abs_diff_mtp_logits": (twin.logits(mtp_hidden)[0] - ref_mtp).abs().max().item()}


def run_evaluation(out: Path, twin: Twin, held_docs: list[np.ndarray], train_docs: list[np.ndarray],
                   args: argparse.Namespace, device: torch.device) -> dict:
    model = load_model(out, device=device, dtype=torch.float32)  # our inference code
    held_chunks = eval_chunks(held_docs, args.eval_tokens, args.eval_chunk)
    with torch.no_grad():  # training is over: round the twin to the saved bf16 weights for the parity check
        for p in twin.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    twin.eval()
    train_chunks = eval_chunks(train_docs, args.eval_train_tokens, args.eval_chunk)
    evaluation = {"parity": parity(twin, model, held_chunks[0], device),
                  "heldout": evaluate(model, held_chunks, device, count_routes=True),
                  "train_sample": evaluate(model, train_chunks, device, count_routes=False)}
    h = evaluation["heldout"]
    log(f"held-out: loss {h['loss']:.4f} top1 {h['top1_accuracy']:.4f} mtp_loss {h['mtp_loss']:.4f} "
        f"mtp_top1 {h['mtp_top1_agreement']:.4f} suffix3 {h['suffix3_precision_all_positions']:.4f} "
        f"(coverage {h['suffix3_coverage']:.4f}); train sample loss {evaluation['train_sample']['loss']:.4f}; "
        f"parity {evaluation['parity']}")
    for name, v in h["expert_usage"].items():
        log(f"  expert entropy {name}: {v['entropy_bits']} / {v['max_bits']} bits")
    return evaluation
