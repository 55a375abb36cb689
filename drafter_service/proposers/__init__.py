"""Draft proposers: MTP drafting (mtp.py) and suffix lookup (suffix.py)."""

from dataclasses import dataclass

from kernels.sampling import SparseRows


@dataclass(frozen=True)
class Proposal:
    source: str  # "MTP" | "SUFFIX"
    token_ids: list[int]
    q_rows: SparseRows | None  # None: point masses
    confidences: list[float]
    slot_misses: int = 0
