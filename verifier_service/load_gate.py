"""Speculation under load (DESIGN §9): how many drafts a round may verify at this load.

The per-request governor compares a request's rounds with drafts against its plain rounds.
In a batch that comparison is blind to what speculation costs the batch: a request's plain
round waits for the batch's forward like any other, sessions that wait for their chains split
the batch, and every row a chain adds to the forward can pull in experts (H200, 30B shapes,
α = 0.8: at 32 sessions speculation delivered 0.68× of plain decoding, while every request
judged its own rounds fine; at 8 sessions chains of 3 delivered 1.34× and chains of 4 1.05×).
So the gate measures what the server as a whole delivers: committed tokens per second of all
requests, in stretches ("epochs") each run under one cap on a round's drafts — a rung of the
ladder `caps` (0 = every round plain), or no cap (each request's own limit) — per load bucket
(the number of sessions decoding), and climbs to the cap that delivers most:

- a bucket starts uncapped and compares its cap (the incumbent) with a neighbouring rung (the
  challenger) in alternating epochs; with `min_epochs` pairs of neighbouring epochs, a longer
  cap must deliver more than `margin` over the shorter one (the median of the last `window`
  paired ratios) to win, a shorter one wins unless it is that much worse (shorter chains cost
  the drafter less). The winner becomes the incumbent and the climb goes on in the same
  direction; when both neighbours lost, the bucket keeps its cap and runs one epoch of a
  neighbour (alternately) every `probe_every` epochs (loads change; a probe makes two pairs).
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

What the gate changes is only how many of a chain's drafts a round verifies (a shorter chain
is verified as any chain is): in exact mode the committed tokens are the same either way, in
probabilistic mode the law is.
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
    min_epochs: int = 3  # pairs of neighbouring epochs (incumbent, challenger) a bucket needs to choose
    window: int = 8  # a comparison: the median of its last paired ratios
    probe_every: int = 12  # settled: one epoch of a neighbouring cap after this many
    margin: float = 0.03  # a longer cap must deliver this much more than a shorter one
    min_sessions: int = 2  # fewer sessions decoding: the gate stays open
    caps: tuple[int, ...] = (0, 1, 2, 3, 4)  # the ladder's rungs below "no cap" (0: every round plain)

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
        if not self.caps or self.caps[0] != 0 or any(b <= a for a, b in zip(self.caps, self.caps[1:])):
            raise ValueError(f"load gate caps {self.caps!r} must start at 0 and increase")


UNCAPPED = None  # a round verifies as many drafts as its request allows


class _Bucket:
    """A bucket's climb: its incumbent rung, the challenger under test, and the paired ratios
    (challenger / incumbent, latest `window`) of each neighbour since the incumbent took over."""

    def __init__(self, top: int, window: int) -> None:
        self.top = top  # the rung without a cap
        self.incumbent = top
        self.challenger: int | None = top - 1  # (a bucket starts by trying one rung shorter)
        self.rejected: set[int] = set()  # neighbours that lost against the incumbent
        self.ratios: dict[int, deque[float]] = {}
        self.window = window
        self.last: tuple[int, int, float] | None = None  # the latest measured epoch: (number, rung, tokens/s)
        self.since_probe = 0
        self.probe_up = False  # the side of the next probe

    def neighbours(self) -> list[int]:
        return [r for r in (self.incumbent - 1, self.incumbent + 1) if 0 <= r <= self.top]

    def add(self, number: int, rung: int, rate: float) -> int | None:
        """A measured epoch; returns the challenger it paired with (None: no pair)."""
        last, self.last = self.last, (number, rung, rate)
        if last is None or last[0] != number - 1 or min(last[2], rate) <= 0:
            return None
        pair = {last[1]: last[2], rung: rate}
        others = [r for r in pair if r != self.incumbent]
        if self.incumbent not in pair or len(others) != 1:
            return None
        other = others[0]
        self.ratios.setdefault(other, deque(maxlen=self.window)).append(pair[other] / pair[self.incumbent])
        return other

    def move_to(self, rung: int) -> None:
        came_from = self.incumbent
        self.incumbent, self.ratios, self.last = rung, {}, None
        self.rejected = {came_from}  # just compared: it lost
        onward = rung + (rung - came_from)
        self.challenger = onward if 0 <= onward <= self.top else None
        self.since_probe = 0


class LoadGate:
    """The server's cap on a round's drafts. `open(now, sessions)` before a round: the most
    drafts it may verify (0: plain; None: its request's own limit); `record(now, tokens)` after
    it: what it committed. Requests run on one event loop, so no lock; the clock is the
    caller's (time.perf_counter in the service)."""

    def __init__(self, settings: LoadGateSettings,
                 on_epoch: Callable[[int | None, str], None] | None = None,
                 on_verdict: Callable[[int, int | None, int | None, float], None] | None = None) -> None:
        self.settings = settings
        self.on_epoch = on_epoch  # (cap, "measured" | "moved" | "idle" | "short") of every epoch closed
        self.on_verdict = on_verdict  # (bucket, new cap, old cap, median paired ratio new / old) when a bucket moves
        self.buckets: dict[int, _Bucket] = {}
        self.rung = len(settings.caps)  # the current epoch's rung (uncapped before any)
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

    def cap_of(self, rung: int) -> int | None:
        caps = self.settings.caps
        return caps[rung] if rung < len(caps) else UNCAPPED

    @property
    def cap(self) -> int | None:
        """The current epoch's cap."""
        return self.cap_of(self.rung)

    def open(self, now: float, sessions: int) -> int | None:
        """The most drafts a round starting now may verify, with `sessions` decoding (0: none;
        None: as many as its request allows)."""
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
            return UNCAPPED
        if self.epoch_bucket is None:
            self._start(now, b, sessions)
        elif b != self.epoch_bucket:
            self.moved = True
        return self.cap

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
            self._judge(self.epoch_bucket, self._bucket(self.epoch_bucket).add(
                self.epoch_number, self.rung, self.tokens / measured_s))
        if self.on_epoch is not None:
            self.on_epoch(self.cap, outcome)
        self.epoch_bucket = None

    def _judge(self, b: int, challenger: int | None) -> None:
        """After a pair with `challenger`: the bucket moves to it, rejects it, or measures on."""
        state = self.buckets[b]
        ratios = state.ratios.get(challenger) if challenger is not None else None
        if ratios is None or len(ratios) < self.settings.min_epochs:
            return
        ratio = statistics.median(ratios)  # challenger / incumbent
        longer_over_shorter = ratio if challenger > state.incumbent else 1 / ratio
        if (longer_over_shorter > 1 + self.settings.margin) == (challenger > state.incumbent):
            old = state.incumbent
            state.move_to(challenger)
            if self.on_verdict is not None:
                self.on_verdict(b, self.cap_of(challenger), self.cap_of(old), ratio)
            return
        state.rejected.add(challenger)
        if state.challenger == challenger:
            untried = [r for r in state.neighbours() if r not in state.rejected]
            state.challenger = untried[0] if untried else None

    def _start(self, now: float, b: int, sessions: int) -> None:
        self.rung = self.choose(b)
        self.epoch_number += 1
        self.epoch_bucket, self.started, self.sessions = b, now, sessions
        self.rounds, self.settled_at, self.tokens, self.moved, self.idle = 0, None, 0, False, False

    def _bucket(self, b: int) -> _Bucket:
        if b not in self.buckets:
            self.buckets[b] = _Bucket(len(self.settings.caps), self.settings.window)
        return self.buckets[b]

    def choose(self, b: int) -> int:
        """The rung of the next epoch in bucket b."""
        state = self._bucket(b)
        if state.challenger is not None:  # climbing: the incumbent and the challenger in turn
            last = state.last[1] if state.last is not None and state.last[0] == self.epoch_number else None
            return state.challenger if last == state.incumbent else state.incumbent
        state.since_probe += 1
        if state.since_probe > self.settings.probe_every:
            state.since_probe = 0
            sides = state.neighbours()  # (one or two: the ladder has two rungs at least)
            state.probe_up = not state.probe_up
            return sides[-1] if state.probe_up else sides[0]
        return state.incumbent

    def verdict(self, b: int) -> int | None:
        """Bucket b's cap now (the ladder's top, None, before it measured anything)."""
        state = self.buckets.get(b)
        return self.cap_of(state.incumbent if state is not None else len(self.settings.caps))


def cap_label(cap: int | None) -> str:
    """A cap as a metric label: plain, cap_N, uncapped."""
    return "uncapped" if cap is None else "plain" if cap == 0 else f"cap_{cap}"


def service_gate(epoch_ms: float, max_draft_tokens: int, epochs_counter, log) -> LoadGate:
    """The verifier's gate: rungs 0..max_draft_tokens (the server's default chain) below no cap;
    epochs counted in `epochs_counter` (a Prometheus counter labelled regime, outcome), each
    bucket's move logged."""
    epoch_s = epoch_ms / 1e3

    def on_epoch(cap: int | None, outcome: str) -> None:
        epochs_counter.labels(cap_label(cap), outcome).inc()

    def on_verdict(b: int, cap: int | None, old: int | None, ratio: float) -> None:
        low, high = bucket_range(b)
        log.info("load gate: cap moved", sessions=f"{low}-{high}", cap=cap_label(cap), was=cap_label(old),
                 ratio_to_was=round(ratio, 3))

    caps = tuple(range(max_draft_tokens + 1))
    return LoadGate(LoadGateSettings(epoch_s=epoch_s, settle_s=epoch_s / 5, caps=caps), on_epoch, on_verdict)
