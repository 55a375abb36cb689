"""Validation of draft chains (DESIGN §1): a drafter can be slow, wrong, malicious or gone.

A chain is used only if every check passes; otherwise it is dropped whole, the fault is
counted, and the round decodes without drafts. The output law never depends on a chain
that fails here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.retention import RetentionPolicy
from kernels.sampling import SparseRows
from kernels.speculative import Gate, Mode, admission_confidences
from shared.protocol import common_pb2, drafter_pb2

Q_SUM_TOLERANCE = 1e-4
SOURCE_NAMES = {
    common_pb2.DRAFT_SOURCE_UNSPECIFIED: "NONE",
    common_pb2.DRAFT_SOURCE_NONE: "NONE",
    common_pb2.DRAFT_SOURCE_MTP: "MTP",
    common_pb2.DRAFT_SOURCE_SUFFIX: "SUFFIX",
}


class ChainFault(ValueError):
    """Why a chain was dropped (the message names the offending field and value)."""


@dataclass(frozen=True)
class ValidChain:
    source: str  # "MTP" | "SUFFIX"
    token_ids: list[int]
    q_rows: SparseRows | None  # None: point masses
    proposed: int  # drafts the drafter sent (before retention)


def max_chain_bytes(max_drafts: int, max_support: int) -> int:
    """An upper bound on a valid DraftDown's serialised size: max_drafts drafts, each with a q row
    of max_support (id, float64) pairs (at most 5 + 8 bytes a pair, 32 bytes of tags and lengths
    a row), a confidence each, up to max_drafts + 1 assumed tokens, and 4 KiB for the rest (costs,
    ids, tags). The drafter link refuses messages past it before parsing them."""
    return 4096 + max_drafts * (32 + 13 * max_support + 4 + 5) + 5 * (max_drafts + 1)


def validate_chain(
    chain: drafter_pb2.DraftChain,
    *,
    round_id: int,
    base_length: int,
    vocab_size: int,
    max_drafts: int,
    max_support: int,
) -> ValidChain | None:
    """The chain as verifiable drafts, None for an empty chain; raises ChainFault if malformed."""
    if chain.round_id != round_id:
        raise ChainFault(f"round_id {chain.round_id} is not the round being verified ({round_id})")
    if chain.base_length != base_length:
        raise ChainFault(f"base_length {chain.base_length} does not match the committed length {base_length}")
    # every repeated field bounded by what a valid chain holds (before any is turned into lists)
    for name, count, limit in (("token_ids", len(chain.token_ids), max_drafts), ("q_rows", len(chain.q_rows), max_drafts),
                               ("confidences", len(chain.confidences), max_drafts),
                               ("assumed_token_ids", len(chain.assumed_token_ids), max_drafts + 1)):
        if count > limit:
            raise ChainFault(f"{name} holds {count} entries; a chain of at most {max_drafts} drafts holds {limit}")
    if chain.confidences and len(chain.confidences) != len(chain.token_ids):
        raise ChainFault(f"{len(chain.confidences)} confidences for {len(chain.token_ids)} drafts")
    tokens = list(chain.token_ids)
    if not tokens:
        return None
    source = SOURCE_NAMES.get(chain.source)
    if source not in ("MTP", "SUFFIX"):
        raise ChainFault(f"source {chain.source} cannot carry drafts")
    for index, token in enumerate(tokens):
        if token >= vocab_size:
            raise ChainFault(f"token_ids[{index}] = {token} is out of range [0, {vocab_size})")
    if not chain.q_rows:
        return ValidChain(source, tokens, None, len(tokens))
    if len(chain.q_rows) != len(tokens):
        raise ChainFault(f"{len(chain.q_rows)} q rows for {len(tokens)} drafts")
    rows: list[dict[int, float]] = []
    for index, (token, row) in enumerate(zip(tokens, chain.q_rows)):
        ids, probs = list(row.token_ids), list(row.probs)
        where = f"q_rows[{index}]"
        if len(ids) != len(probs) or not 1 <= len(ids) <= max_support:
            raise ChainFault(f"{where} has {len(ids)} ids and {len(probs)} probs; 1 to {max_support} pairs are allowed")
        if len(set(ids)) != len(ids) or max(ids) >= vocab_size:
            raise ChainFault(f"{where} token ids are repeated or out of range [0, {vocab_size})")
        if not all(math.isfinite(p) and p >= 0 for p in probs):
            raise ChainFault(f"{where} has a probability that is negative or not finite")
        total = math.fsum(probs)
        if abs(total - 1.0) > Q_SUM_TOLERANCE:
            raise ChainFault(f"{where} sums to {total:.6f}, not 1 within {Q_SUM_TOLERANCE}")
        q = dict(zip(ids, probs))
        if q.get(token, 0.0) <= 0:
            raise ChainFault(f"{where} gives the drafted token {token} probability 0")
        rows.append(q)
    return ValidChain(source, tokens, SparseRows.from_dicts(rows), len(tokens))


def retain(chain: ValidChain, *, mode: Mode, gate: Gate, policy: RetentionPolicy, limit: int) -> ValidChain | None:
    """Apply retention with confidences the verifier computes itself from the q rows (the
    drafter's reported confidences are not trusted: admission must not depend on the draw)."""
    if chain.q_rows is None:  # point masses: every confidence is 1 (admission_confidences), without
        confidences = [1.0] * len(chain.token_ids)  # torch on the event loop (each op may wait for the lock)
    else:
        confidences = admission_confidences(torch.tensor(chain.token_ids), chain.q_rows, mode=mode, gate=gate).tolist()
    keep = min(policy.keep(confidences), limit)
    if keep == 0:
        return None
    q_rows = None if chain.q_rows is None else chain.q_rows[0:keep]
    return ValidChain(chain.source, chain.token_ids[:keep], q_rows, chain.proposed)
