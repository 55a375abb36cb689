"""Step-aware draft retention (DESIGN §4): which leading drafts of a chain are kept.

Given per-step confidences c_0..c_{k-1} (q of the drawn token in exact mode, max q in
probabilistic `top` mode), a step j is kept iff

- its per-step floor passes: c_j >= schedule[min(j, len-1)] when a schedule is set,
  otherwise c_j >= the caller's min_p; and
- the cumulative floor passes: prod(c_0..c_j) (float64, reset each round) >= min_cum
  (min_cum = 0 disables it);

both by AND, equality passing. The first failure ends the chain, so nothing of a rejected
step is written. Observed confidences that are not finite or lie outside [0, 1] fail closed.

The cumulative product is a heuristic, not a calibrated acceptance probability; the
economics are DESIGN §7: keep step k iff A_k / Δverify cost > R_k / C_k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_SCHEDULE_STEPS = 8


QUOTE_LIMIT = 40  # characters of a bad value quoted back in an error message


def quote(text: str, limit: int = QUOTE_LIMIT) -> str:
    """repr(text), cut to `limit` characters: error messages never echo unbounded input."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _parse_probability(text: str, what: str) -> float:
    stripped = text.strip()
    try:
        if not stripped.isascii():  # float() would take other scripts' digits ("١")
            raise ValueError
        value = float(stripped)
    except ValueError:
        raise ValueError(f"{what}: {quote(stripped)} is not a number (ASCII digits)") from None
    if not math.isfinite(value):
        raise ValueError(f"{what}: {quote(stripped)} is not finite")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{what}: {quote(stripped)} is outside [0, 1]")
    return value


@dataclass(frozen=True)
class RetentionPolicy:
    """A validated retention configuration; build it with `parse` or directly."""

    schedule: tuple[float, ...] | None = None  # per-step floors; None = caller min_p each step
    min_cum: float = 0.0  # cumulative floor; 0 disables
    min_p: float = 0.0  # the caller's per-step floor when no schedule is set

    def __post_init__(self) -> None:
        if self.schedule is not None:
            if not 1 <= len(self.schedule) <= MAX_SCHEDULE_STEPS:
                raise ValueError(
                    f"retention schedule has {len(self.schedule)} thresholds; 1 to {MAX_SCHEDULE_STEPS} are allowed"
                )
            for value in self.schedule:
                _parse_probability(repr(value), "retention schedule")
        _parse_probability(repr(self.min_cum), "retention min_cum")
        _parse_probability(repr(self.min_p), "min_p")

    @classmethod
    def parse(cls, schedule: str | None, min_cum: str | float | None, *, min_p: float) -> RetentionPolicy:
        """Parse user settings; raises ValueError naming the bad value.

        schedule: None = unset; otherwise 1..8 comma-separated finite thresholds in [0, 1]
        (whitespace allowed). An empty string or an empty item is malformed, not "unset".
        min_cum: None or a number / numeric string in [0, 1]; 0 disables the floor.
        """
        thresholds: tuple[float, ...] | None = None
        if schedule is not None:
            if not isinstance(schedule, str):
                raise ValueError(f"retention schedule {schedule!r:.40} must be a string such as '0.1,0.35,0.55'")
            items = schedule.split(",")
            if not schedule.strip():
                raise ValueError("retention schedule '' is empty; give 1 to 8 thresholds such as '0.1,0.35,0.55'")
            if len(items) > MAX_SCHEDULE_STEPS:
                raise ValueError(
                    f"retention schedule {quote(schedule)} has {len(items)} thresholds; at most {MAX_SCHEDULE_STEPS} are allowed"
                )
            for position, item in enumerate(items):
                if not item.strip():
                    raise ValueError(f"retention schedule {quote(schedule)}: threshold {position + 1} is empty")
            where = "retention schedule" if len(schedule) > QUOTE_LIMIT else f"retention schedule {quote(schedule)}"
            thresholds = tuple(_parse_probability(item, where) for item in items)
        if min_cum is None:
            cumulative = 0.0
        elif isinstance(min_cum, str):
            if not min_cum.strip():
                raise ValueError("retention min_cum '' is empty; give a number in [0, 1] (0 disables it)")
            cumulative = _parse_probability(min_cum, "retention min_cum")
        elif isinstance(min_cum, bool) or not isinstance(min_cum, int | float):
            raise ValueError(f"retention min_cum {min_cum!r} must be a number in [0, 1]")
        else:
            cumulative = _parse_probability(repr(float(min_cum)), "retention min_cum")
        if isinstance(min_p, bool) or not isinstance(min_p, int | float):
            raise ValueError(f"min_p {min_p!r} must be a number in [0, 1]")
        return cls(schedule=thresholds, min_cum=cumulative, min_p=_parse_probability(repr(float(min_p)), "min_p"))

    def threshold(self, step: int) -> float:
        """The per-step floor of draft step `step` (the last schedule entry repeats)."""
        if self.schedule is None:
            return self.min_p
        return self.schedule[min(step, len(self.schedule) - 1)]

    def keep(self, confidences: Sequence[float]) -> int:
        """How many leading drafts are retained."""
        cumulative = 1.0
        for step, confidence in enumerate(confidences):
            c = float(confidence)
            if not (math.isfinite(c) and 0.0 <= c <= 1.0):
                return step  # fail closed on a broken observation
            if c < self.threshold(step):
                return step
            cumulative *= c  # Python floats are IEEE float64
            if self.min_cum > 0 and cumulative < self.min_cum:
                return step
        return len(confidences)
