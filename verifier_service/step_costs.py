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

A step's cost is not a line in its rows everywhere: on a GPU a mixture-of-experts step's rows
route to more distinct experts as they grow, until every expert is read — from one row to a
lane's worth the step's time rises steeply, from a batch's plain rows to its windows far less.
So a step's draft rows are priced at the slope of the steps whose rows lie between the step's
plain rows (a row a lane) and its rows (`StepCosts.charges`; the range widened upward until
`min_steps` steps of two row counts give a slope, never below the plain rows; else unknown): the
chord over the rows its drafts added. A line through the whole window, the steps of lanes joining one prefill
at a time among them, priced the draft rows of a batch's explorers at the steep part's slope
(docs/PERFORMANCE.md, session 43). On a CPU the rows cost a line, and any range reads its slope.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass


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

    def merge(self, other: _Sums) -> None:
        self.n += other.n
        self.rows += other.rows
        self.seconds += other.seconds
        self.rows2 += other.rows2
        self.rows_seconds += other.rows_seconds

    def spread(self) -> float:
        """Σ(rows − mean)² over these steps."""
        return self.rows2 - self.rows**2 / self.n if self.n else 0.0

    def covariance(self) -> float:
        """Σ(rows − mean)(seconds − mean) over these steps."""
        return self.rows_seconds - self.rows * self.seconds / self.n if self.n else 0.0


@dataclass(frozen=True)
class StepCharges:
    """What one step's lanes cost each other (`StepCosts.charges`): a draft row's seconds over
    the step's rows, what the working drafter added, and the step's draft rows and lanes."""

    per_row_s: float  # a draft row's seconds in this step (0 while unknown)
    drafting_s: float  # what a drafter at work added to a lane without drafts (0 while unknown)
    num_lanes: int
    step_drafts: int  # the step's draft rows, all lanes
    num_drafting_lanes: int  # lanes with drafts

    def to_others_s(self, num_drafts: int) -> float:
        """What a lane's `num_drafts` draft rows added to the other lanes' rounds: its rows'
        share, and its share of what the working drafter added to the lanes without drafts."""
        if num_drafts <= 0 or self.num_lanes <= 1:
            return 0.0
        drafting_lanes = max(self.num_drafting_lanes, 1)
        idle_lanes = self.num_lanes - drafting_lanes
        return self.per_row_s * num_drafts * (self.num_lanes - 1) + self.drafting_s * idle_lanes / drafting_lanes

    def from_others_s(self, num_drafts: int) -> float:
        """What the other lanes added to the round of a lane with `num_drafts` drafts: their draft
        rows, and, for a lane without drafts, the working drafter's addition (what to_others_s
        charges them for this lane)."""
        others = self.step_drafts - num_drafts
        if self.num_lanes <= 1 or others <= 0:
            return 0.0
        drafting = self.drafting_s if num_drafts == 0 and self.num_drafting_lanes > 0 else 0.0
        return self.per_row_s * others + drafting


class StepCosts:
    """Seconds per step row: the slope of a least-squares fit through the last `window` steps'
    (rows, seconds) — over the steps whose rows lie in a range (`per_row_s(lo, hi)`), or all —
    with an intercept for the steps run while a drafter worked and one for the others. None
    until the steps' rows vary (a slope needs two row counts of one kind)."""

    def __init__(self, window: int = 256, min_steps: int = 8) -> None:
        if window < 2 or not 2 <= min_steps <= window:
            raise ValueError(f"step costs window {window} and min_steps {min_steps}: need 2 <= min_steps <= window")
        self.min_steps = min_steps
        self.steps: deque[tuple[int, float, bool]] = deque(maxlen=window)  # (rows, seconds, drafting)
        # running sums by (whether a drafter worked during the step, rows): a range adds its row counts
        self._by_rows: dict[tuple[bool, int], _Sums] = defaultdict(_Sums)

    def add(self, rows: int, seconds: float, drafting: bool = False) -> None:
        if rows < 1 or not seconds >= 0:
            raise ValueError(f"a step of {rows} rows in {seconds} s")
        if len(self.steps) == self.steps.maxlen:
            old_rows, old_seconds, old_drafting = self.steps[0]
            old = self._by_rows[old_drafting, old_rows]
            old.update(old_rows, old_seconds, sign=-1)
            if old.n == 0:
                del self._by_rows[old_drafting, old_rows]
        self.steps.append((rows, seconds, drafting))
        self._by_rows[drafting, rows].update(rows, seconds, sign=1)

    def _kinds(self, lo: int = 1, hi: int | None = None) -> dict[bool, _Sums]:
        """The sums of the steps of lo..hi rows (hi None: no bound), by kind of step."""
        kinds = {False: _Sums(), True: _Sums()}
        for (drafting, rows), sums in self._by_rows.items():
            if lo <= rows and (hi is None or rows <= hi):
                kinds[drafting].merge(sums)
        return kinds

    def _slope(self, lo: int = 1, hi: int | None = None) -> float | None:
        """The pooled within-kind slope (unclamped) over the steps of lo..hi rows, None without
        `min_steps` steps and two row counts (of one kind) among them."""
        return self._pooled_slope(self._kinds(lo, hi))

    def _pooled_slope(self, kinds: dict[bool, _Sums]) -> float | None:
        """`_slope` of sums by kind already gathered."""
        sums = kinds.values()
        if sum(s.n for s in sums) < self.min_steps:
            return None
        spread = sum(s.spread() for s in sums)
        if spread < 0.5:  # (rows all but constant within each kind: no slope to read; integer rows make this exact)
            return None
        return sum(s.covariance() for s in sums) / spread

    def per_row_s(self, lo: int = 1, hi: int | None = None) -> float | None:
        """The marginal seconds of one more row in a step (>= 0), None while unknown: the slope
        over the steps of `lo`..`hi` rows (`hi` doubled until it has one; never below `lo`: the
        steps of fewer rows — lanes joining one at a time, the steep part of a MoE step's
        cost — say nothing of rows added above them); by default over all of them."""
        if not self._by_rows:
            return None
        widest = max(rows for _, rows in self._by_rows)
        hi = widest if hi is None else hi
        while True:
            slope = self._slope(lo, hi)
            if slope is not None:
                return max(slope, 0.0)
            if hi >= widest:
                return None
            hi *= 2

    def drafting_s(self) -> float | None:
        """What a drafter at work adds to a step of the same rows (>= 0), None while unknown
        (fewer than `min_steps` steps of either kind)."""
        kinds = self._kinds()
        idle, working = kinds[False], kinds[True]
        slope = self._pooled_slope(kinds)  # (the whole window's: one gathering for both)
        if slope is None or idle.n < self.min_steps or working.n < self.min_steps:
            return None
        added = (working.seconds - slope * working.rows) / working.n - (idle.seconds - slope * idle.rows) / idle.n
        return max(added, 0.0)

    def charges(self, num_lanes: int, step_drafts: int, num_drafting_lanes: int) -> StepCharges:
        """What the lanes of a step of `num_lanes` lanes and `step_drafts` draft rows
        (`num_drafting_lanes` lanes with drafts) cost each other: its draft rows priced at the
        slope over the steps between its plain rows and its rows (each part 0 while unknown)."""
        if step_drafts <= 0 or num_lanes <= 1:  # (nobody's rows cost anyone else: no fit read)
            return StepCharges(0.0, 0.0, num_lanes, step_drafts, num_drafting_lanes)
        per_row = self.per_row_s(num_lanes, num_lanes + step_drafts)
        drafting = self.drafting_s()
        return StepCharges(per_row or 0.0, drafting or 0.0, num_lanes, step_drafts, num_drafting_lanes)
