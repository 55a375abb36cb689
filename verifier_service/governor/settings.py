"""The governor's settings (verifier_service.governor)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GovernorSettings:
    judge_rounds: int = 8  # rounds of a phase before judging (the first one is not measured)
    margin: float = 0.05  # detach only when rounds with drafts cost this much more per token (noise)
    min_hold: int = 16  # plain rounds of a request between a detach and its next probe, at least
    probe_share: float = 0.03  # of the plain decoding time, what probes of a drafter that does not pay may cost
    window: int = 16  # a request's estimate: its last rounds of a kind
    confidence_z: float = 0.5  # detach only when slower by this many standard errors (one round's luck is not a trend)
    server_window: int = 64  # the server's estimate: the last rounds of a kind, all requests
    max_explorers: int = 2  # requests speculating at once while the server's rounds give no verdict
    verdict_rounds: int = 4  # plain rounds between looks at the server's verdict (a request waiting for it)
    recheck_rounds: int = 256  # speculative rounds (the server's, all requests) before plain is measured again

    def __post_init__(self) -> None:
        for name in ("min_hold", "window", "server_window", "max_explorers", "verdict_rounds", "recheck_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"governor {name} {getattr(self, name)} must be >= 1")
        if self.judge_rounds < 2:
            raise ValueError(f"governor judge_rounds {self.judge_rounds} must be >= 2 (the first round is not measured)")
        if not (math.isfinite(self.confidence_z) and self.confidence_z >= 0):
            raise ValueError(f"governor confidence_z {self.confidence_z!r} must be finite and >= 0")
        if not (math.isfinite(self.margin) and 0 <= self.margin < 1):
            raise ValueError(f"governor margin {self.margin!r} must lie in [0, 1)")
        if not (math.isfinite(self.probe_share) and 0 < self.probe_share <= 1):
            raise ValueError(f"governor probe_share {self.probe_share!r} must lie in (0, 1]")

    @property
    def recheck_measured(self) -> int:
        """Plain rounds a recheck measures: its phase is half a judgement's rounds, at least 4 (a
        plain round's cost varies little, one token each), of which two are not measured (its
        first, and its last, which begins as it judges) — and what a verdict needs of plain
        rounds, so the window a recheck leaves gives one."""
        return max(4, self.judge_rounds // 2) - 2
