"""What a step's rows cost (DESIGN §9, "Speculation in a batch"): the engine loop's running
straight-line fit of a step's seconds on its rows, over its last steps.

A round's drafts widen the step every lane of it waits for: the engine loop charges a round
with drafts what its draft rows added to the other lanes' rounds (per-row seconds × drafts ×
other lanes), and the request's governor counts that with the round's own cost. Without it a
request judges speculation by its own rounds alone, which pay where the batch's do not (on a
CPU a step costs about its rows: a lane's four drafts make seven other lanes' rounds slower
by as much as they make its own faster).
"""

from __future__ import annotations

from collections import deque


class StepCosts:
    """Seconds per step row: the slope of a least-squares line through the last `window`
    steps' (rows, seconds). None until the steps' rows vary (a slope needs two row counts)."""

    def __init__(self, window: int = 256, min_steps: int = 8) -> None:
        if window < 2 or not 2 <= min_steps <= window:
            raise ValueError(f"step costs window {window} and min_steps {min_steps}: need 2 <= min_steps <= window")
        self.min_steps = min_steps
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)
        # running sums: every step updates them, reads are O(1)
        self.n = 0
        self.sum_rows = self.sum_seconds = self.sum_rows2 = self.sum_rows_seconds = 0.0

    def add(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds >= 0:
            raise ValueError(f"a step of {rows} rows in {seconds} s")
        if len(self.steps) == self.steps.maxlen:
            self._update(*self.steps[0], sign=-1)
        self.steps.append((rows, seconds))
        self._update(rows, seconds, sign=1)

    def _update(self, rows: int, seconds: float, sign: int) -> None:
        self.n += sign
        self.sum_rows += sign * rows
        self.sum_seconds += sign * seconds
        self.sum_rows2 += sign * rows * rows
        self.sum_rows_seconds += sign * rows * seconds

    def per_row_s(self) -> float | None:
        """The marginal seconds of one more row in a step (>= 0), None while unknown."""
        if self.n < self.min_steps:
            return None
        spread = self.n * self.sum_rows2 - self.sum_rows**2  # n² × the variance of the rows
        if spread < 0.5 * self.n:  # (rows all but constant: no slope to read; integer rows make this exact)
            return None
        slope = (self.n * self.sum_rows_seconds - self.sum_rows * self.sum_seconds) / spread
        return max(slope, 0.0)

    def cost_to_others_s(self, num_drafts: int, num_lanes: int) -> float:
        """What a round's `num_drafts` draft rows added to the other lanes' rounds of a step of
        `num_lanes` lanes (0 while the per-row cost is unknown)."""
        per_row = self.per_row_s()
        if per_row is None or num_drafts <= 0 or num_lanes <= 1:
            return 0.0
        return per_row * num_drafts * (num_lanes - 1)
