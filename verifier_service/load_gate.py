"""Speculation under load (DESIGN §9): whether the server lets rounds wait for chains at all.

The per-request governor compares a request's rounds with drafts against its plain rounds.
In a batch that comparison is blind to what speculation costs the batch: a request's plain
round waits for the batch's forward like any other, and sessions that wait for their chains
split the batch (H200, 30B shapes, α = 0.8: at 32 sessions the mean batch fell from 31.3 to
22.9 and speculation delivered 0.68× of plain decoding, while every request judged its own
rounds fine). So the gate measures what the server as a whole delivers: committed tokens per
second of all requests, in stretches ("epochs") during which speculation is allowed (each
request's governor decides) or not (every round plain), per load bucket (the number of
sessions decoding), and keeps the regime that delivers more:

- a bucket alternates regimes until it has `min_epochs` pairs of neighbouring epochs of the
  two regimes, then takes speculation if the median of its last `window` paired ratios
  (speculative / plain tokens/s) exceeds 1 + `margin`, else plain decoding, and runs one
  epoch of the other every `probe_every` epochs (loads change; a probe makes two pairs).
  Pairs, as in our benchmarks: an epoch's rate moves a lot with what else happens (prompts
  prefilling, requests ending; H200, 32 sessions: plain epochs measured 2,477 and 981
  tokens/s in one run), and its neighbour sees most of the same;
- an epoch lasts `epoch_s` and at least `epoch_rounds` rounds per session (a CPU's rounds
  can be longer than a GPU's epoch); its start is left out of its rate until `settle_s` and
  `settle_rounds` rounds per session have passed (rounds of the other regime still in
  flight); an epoch during which the load moved to another bucket is dropped, and so is one
  in which no request with a drafter started a round for `idle_s` (the load was not the
  gate's to judge: e.g. only requests without speculation ran);
- with fewer than `min_sessions` sessions decoding the gate stays open: a request alone is
  its own batch, and its governor sees everything.

What the gate changes is only whether a round has drafts: in exact mode the committed tokens
are the same either way, in probabilistic mode the law is (as for any round without a chain).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# Bucket edges (sessions decoding): 2, 3-5, 6-11, 12-23, 24-47, ... — edges between, not at,
# the round concurrencies people run (8, 16, 32, 64), so a steady load stays in one bucket.
BUCKET_EDGES = (2, 3, 6, 12, 24, 48, 96, 192, 384, 768)


def bucket(sessions: int) -> int:
    """0 for one session (never gated), then 1, 2, ... by BUCKET_EDGES."""
    return bisect.bisect_right(BUCKET_EDGES, sessions)


def bucket_range(b: int) -> tuple[int, int]:
    """The sessions of bucket b >= 1, first and last."""
    return BUCKET_EDGES[b - 1], BUCKET_EDGES[b] - 1 if b < len(BUCKET_EDGES) else 10**9


@dataclass(frozen=True)
class LoadGateSettings:
    epoch_s: float = 0.25  # one regime's stretch, at least
    epoch_rounds: int = 4  # ... and at least this many rounds per session decoding
    settle_s: float = 0.05  # of each epoch, kept out of its rate, at least
    settle_rounds: int = 1  # ... and at least this many rounds per session
    idle_s: float = 2.0  # no round of a request with a drafter for this long: the epoch is dropped
    min_epochs: int = 3  # pairs of neighbouring epochs (speculative, plain) a bucket needs to choose
    window: int = 8  # a bucket's verdict: the median of its last paired ratios
    probe_every: int = 12  # choosing: one epoch of the other regime after this many
    margin: float = 0.03  # speculation must deliver this much more than plain decoding
    min_sessions: int = 2  # fewer sessions decoding: the gate stays open

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epoch_s) and self.epoch_s > 0):
            raise ValueError(f"load gate epoch_s {self.epoch_s!r} must be finite and > 0")
        if not (math.isfinite(self.settle_s) and 0 <= self.settle_s < self.epoch_s):
            raise ValueError(f"load gate settle_s {self.settle_s!r} must lie in [0, epoch_s = {self.epoch_s})")
        if not (math.isfinite(self.idle_s) and self.idle_s > 0):
            raise ValueError(f"load gate idle_s {self.idle_s!r} must be finite and > 0")
        if self.epoch_rounds < 1 or self.settle_rounds < 0 or self.settle_rounds >= self.epoch_rounds:
            raise ValueError(f"load gate epoch_rounds {self.epoch_rounds} must be >= 1 and settle_rounds "
                             f"{self.settle_rounds} in [0, epoch_rounds)")
        for name in ("min_epochs", "window", "probe_every", "min_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"load gate {name} {getattr(self, name)} must be >= 1")
        if self.window < self.min_epochs:
            raise ValueError(f"load gate window {self.window} must be >= min_epochs {self.min_epochs}")
        if not (math.isfinite(self.margin) and 0 <= self.margin < 1):
            raise ValueError(f"load gate margin {self.margin!r} must lie in [0, 1)")


class _Bucket:
    """A bucket's measured epochs: (epoch number, regime, tokens/s), the latest `2 * window`."""

    def __init__(self, window: int) -> None:
        self.epochs: deque[tuple[int, bool, float]] = deque(maxlen=2 * window)
        self.window = window
        self.since_probe = 0

    def ratios(self) -> list[float]:
        """speculative / plain of every two consecutive epochs (in the gate's numbering) of
        different regimes, the latest `window`: neighbours share the load's slow drifts (prompts
        arriving, requests ending), which unpaired epochs do not."""
        out = [(b[2] / a[2] if b[1] else a[2] / b[2])
               for a, b in zip(self.epochs, list(self.epochs)[1:])
               if b[0] == a[0] + 1 and a[1] != b[1] and min(a[2], b[2]) > 0]
        return out[-self.window:]

    @property
    def last_regime(self) -> bool | None:
        return self.epochs[-1][1] if self.epochs else None


class LoadGate:
    """The server's regime. `open(now, sessions)` before a round: whether its request may
    speculate; `record(now, tokens)` after it: what it committed. Requests run on one event
    loop, so no lock; the clock is the caller's (time.perf_counter in the service)."""

    def __init__(self, settings: LoadGateSettings,
                 on_epoch: Callable[[bool, str], None] | None = None,
                 on_verdict: Callable[[int, bool, float], None] | None = None) -> None:
        self.settings = settings
        self.on_epoch = on_epoch  # (regime, "measured" | "moved" | "idle" | "short") of every epoch closed
        self.on_verdict = on_verdict  # (bucket, speculation better, median paired ratio) when a bucket's verdict changes
        self.verdicts: dict[int, bool] = {}
        self.buckets: dict[int, _Bucket] = {}
        self.regime = True  # the current epoch's: speculation allowed
        self.epoch_bucket: int | None = None  # None: no epoch running (too few sessions)
        self.moved = False  # the load left the epoch's bucket
        self.idle = False  # no request with a drafter started a round for idle_s
        self.started = 0.0
        self.sessions = 0  # decoding when the epoch started
        self.rounds = 0  # recorded since it started
        self.settled_at: float | None = None
        self.tokens = 0  # committed after the epoch settled
        self.last_open = 0.0
        self.epoch_number = 0  # epochs started, all buckets

    def open(self, now: float, sessions: int) -> bool:
        """Whether a round starting now may wait for a chain, with `sessions` decoding."""
        s = self.settings
        b = bucket(sessions) if sessions >= s.min_sessions else 0
        if self.epoch_bucket is not None:
            self.idle |= now - self.last_open > s.idle_s
            if now - self.started >= s.epoch_s and (
                    self.moved or self.idle or self.rounds >= s.epoch_rounds * self.sessions):
                self._close(now)
        self.last_open = now
        if b == 0:
            if self.epoch_bucket is not None:
                self.moved = True
            return True
        if self.epoch_bucket is None:
            self._start(now, b, sessions)
        elif b != self.epoch_bucket:
            self.moved = True
        return self.regime

    def record(self, now: float, tokens: int) -> None:
        """A round ended now, committing `tokens` (any request's, with a drafter or not)."""
        if self.epoch_bucket is None:
            return
        self.rounds += 1
        if self.settled_at is not None:
            self.tokens += tokens
        elif now - self.started >= self.settings.settle_s and self.rounds >= self.settings.settle_rounds * self.sessions:
            self.settled_at = now  # (this round ran across the epoch's start: not counted)

    def _close(self, now: float) -> None:
        measured_s = now - self.settled_at if self.settled_at is not None else 0.0
        outcome = "moved" if self.moved else "idle" if self.idle else "short" if measured_s <= 0 else "measured"
        if outcome == "measured":
            self._bucket(self.epoch_bucket).epochs.append((self.epoch_number, self.regime, self.tokens / measured_s))
            self._note_verdict(self.epoch_bucket)
        if self.on_epoch is not None:
            self.on_epoch(self.regime, outcome)
        self.epoch_bucket = None

    def _note_verdict(self, b: int) -> None:
        verdict = self.better(b)
        if verdict is None or self.verdicts.get(b) == verdict:
            return
        self.verdicts[b] = verdict
        if self.on_verdict is not None:
            self.on_verdict(b, verdict, statistics.median(self.buckets[b].ratios()))

    def _start(self, now: float, b: int, sessions: int) -> None:
        self.regime = self.choose(b)
        self.epoch_number += 1
        self.epoch_bucket, self.started, self.sessions = b, now, sessions
        self.rounds, self.settled_at, self.tokens, self.moved, self.idle = 0, None, 0, False, False

    def _bucket(self, b: int) -> _Bucket:
        if b not in self.buckets:
            self.buckets[b] = _Bucket(self.settings.window)
        return self.buckets[b]

    def choose(self, b: int) -> bool:
        """The regime of the next epoch in bucket b."""
        s, state = self.settings, self._bucket(b)
        best = self.better(b)
        if best is None:  # still measuring: the other regime than the bucket's last epoch (speculation first)
            return state.last_regime is not True
        state.since_probe += 1
        if state.since_probe > s.probe_every:
            state.since_probe = 0
            return not best
        return best

    def better(self, b: int) -> bool | None:
        """Whether speculation delivers more in bucket b (None: not measured enough yet)."""
        state = self.buckets.get(b)
        ratios = state.ratios() if state is not None else []
        if len(ratios) < self.settings.min_epochs:
            return None
        return statistics.median(ratios) > 1 + self.settings.margin


def service_gate(epoch_ms: float, epochs_counter, log) -> LoadGate:
    """The verifier's gate: epochs counted in `epochs_counter` (a Prometheus counter labelled
    regime, outcome), each bucket's change of verdict logged."""
    epoch_s = epoch_ms / 1e3

    def on_epoch(regime: bool, outcome: str) -> None:
        epochs_counter.labels("speculative" if regime else "plain", outcome).inc()

    def on_verdict(b: int, speculation: bool, ratio: float) -> None:
        low, high = bucket_range(b)
        log.info("load gate: speculation pays" if speculation else "load gate: rounds held plain",
                 sessions=f"{low}-{high}", speculative_over_plain=round(ratio, 3))

    return LoadGate(LoadGateSettings(epoch_s=epoch_s, settle_s=epoch_s / 5), on_epoch, on_verdict)
