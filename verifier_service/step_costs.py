"""What a step's rows cost, and what a working drafter costs it (DESIGN §9, "Speculation in a
batch"): the engine loop's running least-squares fit of a step's seconds on its rows and on
whether a drafter was working meanwhile, over its last steps.

A round's drafts widen the step every lane of it waits for: the engine loop charges a round
with drafts what its draft rows added to the other lanes' rounds (per-row seconds × drafts ×
other lanes), and the request's governor counts that with the round's own cost. Without it a
request judges speculation by its own rounds alone, which pay where the batch's do not (on a
CPU a step costs about its rows: a lane's four drafts make seven other lanes' rounds slower
by as much as they make its own faster).

Both sides of the same seconds: the lanes whose rounds those draft rows made slower are refunded
them (`cost_from_others_s`: the other lanes' draft rows, and the working drafter's addition to a
lane without drafts), so each round counts what it cost, not what others cost it. Without the
refund a plain round beside drafting lanes measured their rows too: a request measuring its plain
cost while seven others drafted saw a step of 36 rows as its plain round's (docs/PERFORMANCE.md,
session 33), and speculation under load looked to pay where it did not.

A drafter at work can slow every step beyond its rows: on a CPU the verifier gives the drafter
one of its cores while some lane drafts (shared/threads.py), so every lane's step runs on
fewer threads. That is a step's second term (the engine loop marks such steps only where it
yields the core: elsewhere — a GPU — a step with a drafter at work is a step with draft rows,
and on a GPU's far-from-linear cost the term would read those rows' cost twice), fitted as a
constant added to the steps run while a drafter worked (one slope for both kinds of step, an
intercept each), and the lanes whose drafts made the drafter work share what it added to the
rounds of the lanes that drafted nothing: a lane drafting alone in a step of 8 owes 7 of it,
8 lanes drafting owe nothing (each one's own rounds measure it).
"""

from __future__ import annotations

from collections import deque


class _Sums:
    """Running sums of (rows, seconds) over one kind of step (reads are O(1))."""

    def __init__(self) -> None:
        self.n = 0
        self.rows = self.seconds = self.rows2 = self.rows_seconds = 0.0

    def update(self, rows: int, seconds: float, sign: int) -> None:
        self.n += sign
        self.rows += sign * rows
        self.seconds += sign * seconds
        self.rows2 += sign * rows * rows
        self.rows_seconds += sign * rows * seconds

    def spread(self) -> float:
        """Σ(rows − mean)² over these steps."""
        return self.rows2 - self.rows**2 / self.n if self.n else 0.0

    def covariance(self) -> float:
        """Σ(rows − mean)(seconds − mean) over these steps."""
        return self.rows_seconds - self.rows * self.seconds / self.n if self.n else 0.0


class StepCosts:
    """Seconds per step row: the slope of a least-squares fit through the last `window` steps'
    (rows, seconds), with an intercept for the steps run while a drafter worked and one for the
    others. None until the steps' rows vary (a slope needs two row counts of one kind)."""

    def __init__(self, window: int = 256, min_steps: int = 8) -> None:
        if window < 2 or not 2 <= min_steps <= window:
            raise ValueError(f"step costs window {window} and min_steps {min_steps}: need 2 <= min_steps <= window")
        self.min_steps = min_steps
        self.steps: deque[tuple[int, float, bool]] = deque(maxlen=window)  # (rows, seconds, drafting)
        self._sums = {False: _Sums(), True: _Sums()}  # by whether a drafter worked during the step

    def add(self, rows: int, seconds: float, drafting: bool = False) -> None:
        if rows < 1 or not seconds >= 0:
            raise ValueError(f"a step of {rows} rows in {seconds} s")
        if len(self.steps) == self.steps.maxlen:
            old_rows, old_seconds, old_drafting = self.steps[0]
            self._sums[old_drafting].update(old_rows, old_seconds, sign=-1)
        self.steps.append((rows, seconds, drafting))
        self._sums[drafting].update(rows, seconds, sign=1)

    def _slope(self) -> float | None:
        """The pooled within-kind slope (unclamped), None while unknown."""
        sums = self._sums.values()
        if sum(s.n for s in sums) < self.min_steps:
            return None
        spread = sum(s.spread() for s in sums)
        if spread < 0.5:  # (rows all but constant within each kind: no slope to read; integer rows make this exact)
            return None
        return sum(s.covariance() for s in sums) / spread

    def per_row_s(self) -> float | None:
        """The marginal seconds of one more row in a step (>= 0), None while unknown."""
        slope = self._slope()
        return None if slope is None else max(slope, 0.0)

    def drafting_s(self) -> float | None:
        """What a drafter at work adds to a step of the same rows (>= 0), None while unknown
        (fewer than `min_steps` steps of either kind)."""
        idle, working = self._sums[False], self._sums[True]
        slope = self._slope()
        if slope is None or idle.n < self.min_steps or working.n < self.min_steps:
            return None
        added = (working.seconds - slope * working.rows) / working.n - (idle.seconds - slope * idle.rows) / idle.n
        return max(added, 0.0)

    def cost_to_others_s(self, num_drafts: int, num_lanes: int, num_drafting_lanes: int = 1) -> float:
        """What a round's `num_drafts` draft rows added to the other lanes' rounds of a step of
        `num_lanes` lanes, `num_drafting_lanes` of them with drafts: its rows' share, and its
        share of what the working drafter added to the rounds of the lanes without drafts (each
        part 0 while unknown)."""
        if num_drafts <= 0 or num_lanes <= 1:
            return 0.0
        per_row = self.per_row_s() or 0.0
        drafting = self.drafting_s() or 0.0
        idle_lanes = num_lanes - max(num_drafting_lanes, 1)
        return per_row * num_drafts * (num_lanes - 1) + drafting * idle_lanes / max(num_drafting_lanes, 1)

    def cost_from_others_s(self, num_drafts: int, num_lanes: int, step_drafts: int, num_drafting_lanes: int) -> float:
        """What the other lanes of a step (`num_lanes` lanes, `step_drafts` draft rows in all,
        `num_drafting_lanes` lanes with drafts) added to the round of a lane with `num_drafts`
        drafts: their draft rows, and, for a lane without drafts, what the working drafter
        added to the step (what cost_to_others_s charges them for this lane; 0 while unknown)."""
        others = step_drafts - num_drafts
        if num_lanes <= 1 or others <= 0:
            return 0.0
        per_row = self.per_row_s() or 0.0
        drafting = (self.drafting_s() or 0.0) if num_drafts == 0 and num_drafting_lanes > 0 else 0.0
        return per_row * others + drafting
