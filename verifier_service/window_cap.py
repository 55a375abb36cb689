"""How many drafts a round may verify at the current batch size (issue 11).

Alone, a verify window of k + 1 rows costs little more than one row (decode is bound by
weight reads). In a batch of B sessions the step is B·(k + 1) rows, and past a few dozen
rows the step grows with every row (more experts read, then compute): long chains that pay
alone slow every stream down in a large batch. So before a round the verifier caps its
chain at the k that maximises the committed tokens per unit of step time,

    k* = argmax_k  R_k(a) / T(B · (k + 1)),    R_k(a) = 1 + a + a² + … + a^k,

with a the session's measured per-draft acceptance and T the step cost by total rows: the
engine's forwards as measured (an exponential average per row count; a forward holds at most
`max_rows`, larger batches split). Every session applies the same rule, which is what the
B·(k + 1) assumes. Until T is known at two row counts there is no cap.

Verifying a prefix of a chain is lossless. The cap applies to exact mode only: there the
tokens do not depend on the drafts at all, while in probabilistic mode a seed's tokens are
reproducible given the drafts verified, which must not depend on the load.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass


class StepCosts:
    """Milliseconds of one forward by its total rows (exponential average per row count)."""

    def __init__(self, max_rows: int, smoothing: float = 0.2) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows {max_rows} must be >= 1")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing {smoothing} must lie in (0, 1]")
        self.max_rows = max_rows
        self.smoothing = smoothing
        self._ms: dict[int, float] = {}
        self._lock = threading.Lock()  # observed on the model worker, read on the event loop

    def observe(self, rows: int, ms: float) -> None:
        if not 1 <= rows <= self.max_rows or not ms > 0:
            return
        with self._lock:
            old = self._ms.get(rows)
            self._ms[rows] = ms if old is None else old + self.smoothing * (ms - old)

    def known(self) -> dict[int, float]:
        with self._lock:
            return dict(self._ms)

    def cost(self, rows: int) -> float | None:
        """Estimated ms of a step of `rows` rows (split into forwards of at most max_rows), or
        None where the measurements cannot say."""
        table = self.known()
        if len(table) < 2 or rows < 1:
            return None
        full, rest = divmod(rows, self.max_rows)
        parts = [self.max_rows] * full + ([rest] if rest else [])
        total = 0.0
        for part in parts:
            ms = _interpolate(table, part)
            if ms is None:
                return None
            total += ms
        return total


def _interpolate(table: dict[int, float], rows: int) -> float | None:
    """Piecewise linear through the measured points; flat below the first (a forward costs no
    less for fewer rows), linear beyond the last from the last two points."""
    xs = sorted(table)
    if rows <= xs[0]:
        return table[xs[0]]
    i = bisect.bisect_left(xs, rows)
    if i < len(xs) and xs[i] == rows:
        return table[rows]
    lo, hi = (xs[i - 1], xs[i]) if i < len(xs) else (xs[-2], xs[-1])
    slope = (table[hi] - table[lo]) / (hi - lo)
    return max(table[lo] + slope * (rows - lo), table[xs[0]])


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """R_k: tokens a round commits with k drafts at per-draft acceptance a (geometric)."""
    return sum(acceptance**i for i in range(num_drafts + 1))


@dataclass(frozen=True)
class Acceptance:
    """A session's per-draft acceptance: accepted drafts over drafts tried up to the first
    rejection, with one prior success and one prior failure."""

    accepted: int = 0
    rejected: int = 0  # rounds whose chain was cut by a rejected draft

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)


def best_drafts(acceptance: float, batch_sessions: int, max_drafts: int, costs: StepCosts) -> int | None:
    """k* in 0..max_drafts for a batch of `batch_sessions` sessions, or None without costs."""
    if max_drafts < 1 or batch_sessions < 1:
        return None
    best, best_rate = None, 0.0
    for k in range(max_drafts + 1):
        ms = costs.cost(batch_sessions * (k + 1))
        if ms is None:
            return None
        rate = expected_tokens(acceptance, k) / ms
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


def chain_cap(acceptance: float, batch_sessions: int, max_drafts: int, costs: StepCosts | None) -> int:
    """The most drafts a round verifies: k* in batches of two or more sessions, else (alone, or
    before costs are known) max_drafts. Alone, the drafter's planner already weighs its chain
    against the window's measured cost."""
    if costs is None or batch_sessions < 2:
        return max_drafts
    best = best_drafts(acceptance, batch_sessions, max_drafts, costs)
    return max_drafts if best is None else best
