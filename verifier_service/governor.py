"""Speculation that never costs (DESIGN §9): whether a request's next round waits for the drafter.

A round with drafts costs the wait for the chain (drafter compute and the hop) and a wider
verify window; it pays only if it commits enough more tokens. What each kind of round
realises is measured from the request's side: the time from one round's start to the next
round's start (wait, verify, streaming: everything) per committed token. Speculative rounds
are compared with plain ones:

- a request starts speculating, unless the server's recent rounds say speculation does not
  pay (then it starts plain and probes after a hold);
- after `judge_rounds` speculative rounds it judges; if the plain cost is unknown (no plain
  round here or on the server yet), `judge_rounds` plain rounds calibrate it first;
- speculation slower than plain: the request detaches (plain rounds, the drafter hears
  nothing) for `hold` rounds, then probes `judge_rounds` speculative rounds again; the hold
  doubles per failed probe up to `max_hold` and falls back to `min_hold` when a probe pays;
- the first round of each phase stays out of the estimates (a probe's first chain pays the
  drafter's catch-up of the rounds it missed; a first plain round may lose a compute-ahead).

Estimates: seconds per committed token over the last `window` rounds of a kind, the
request's own, else the server's (`Ledger`, fed by every request, the plain rounds of
requests without drafting included). The decision changes only whether a round has drafts:
in exact mode the committed tokens are the same either way; in probabilistic mode the law
is the same (as for any round whose chain came late).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GovernorSettings:
    judge_rounds: int = 5  # rounds of a phase before judging (the first one is not measured)
    min_hold: int = 16  # plain rounds after a detach
    max_hold: int = 512  # the hold doubles per failed probe up to this
    window: int = 8  # a request's estimate: its last rounds of a kind
    server_window: int = 64  # the server's estimate: the last rounds of a kind, all requests

    def __post_init__(self) -> None:
        for name in ("judge_rounds", "min_hold", "window", "server_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"governor {name} {getattr(self, name)} must be >= 1")
        if self.judge_rounds < 2:
            raise ValueError(f"governor judge_rounds {self.judge_rounds} must be >= 2 (the first round is not measured)")
        if self.max_hold < self.min_hold:
            raise ValueError(f"governor max_hold {self.max_hold} must be >= min_hold {self.min_hold}")


class CostWindow:
    """Seconds per committed token over the last rounds of one kind."""

    def __init__(self, size: int) -> None:
        self.rounds: deque[tuple[float, int]] = deque(maxlen=size)

    def add(self, seconds: float, tokens: int) -> None:
        self.rounds.append((seconds, tokens))

    def clear(self) -> None:
        self.rounds.clear()

    def __len__(self) -> int:
        return len(self.rounds)

    def per_token(self) -> float | None:
        tokens = sum(t for _, t in self.rounds)
        return sum(s for s, _ in self.rounds) / tokens if tokens else None


class Ledger:
    """The server's view over all requests: the prior of a request that has not measured a kind."""

    def __init__(self, settings: GovernorSettings) -> None:
        self.settings = settings
        self.speculative = CostWindow(settings.server_window)
        self.plain = CostWindow(settings.server_window)

    def pays(self) -> bool | None:
        """Whether speculation has paid lately (None: too few rounds of either kind to say)."""
        enough = max(1, self.settings.server_window // 4)
        if len(self.speculative) < enough or len(self.plain) < enough:
            return None
        return self.speculative.per_token() <= self.plain.per_token()


class Governor:
    """One request's decisions. Per round, `begin(now)`: whether this round waits for a chain
    (then `next_speculates` says already whether the next one will, so a commit can be held
    back from a drafter that will not be asked and a plain step computed ahead); `end(tokens)`:
    the tokens it committed (its cost is closed by the next `begin`)."""

    def __init__(self, settings: GovernorSettings, ledger: Ledger, drafting: bool = True) -> None:
        self.settings = settings
        self.ledger = ledger
        self.drafting = drafting  # False: the request never drafts; its plain rounds still teach the ledger
        self.speculative = CostWindow(settings.window)
        self.plain = CostWindow(settings.window)
        self.hold = settings.min_hold
        self.speculating = drafting and ledger.pays() is not False  # the kind of the next round
        self.phase_length = settings.judge_rounds if self.speculating else self.hold
        self.calibrating = False  # this plain phase measures the plain cost, then judges at once
        self.phase_rounds = 0  # rounds since the phase began (or since the last judgement)
        self.new_phase = True  # the next round is the first of its phase
        self.started: float | None = None
        self.round_speculated = self.round_first = False  # the current round's kind, and whether it opened a phase
        self.tokens = 0
        self.rounds = self.speculative_rounds = self.detaches = self.probes = 0

    @property
    def next_speculates(self) -> bool:
        return self.speculating

    def begin(self, now: float) -> bool:
        """Close the last round (measured up to now); whether this round waits for a chain."""
        if self.started is not None:
            self._record(now - self.started, self.tokens)
        self.started, self.tokens = now, 0
        self.round_speculated = self.speculating
        self.round_first, self.new_phase = self.new_phase, False
        self.rounds += 1
        self.speculative_rounds += self.round_speculated
        self.phase_rounds += 1
        if self.drafting and self.phase_rounds >= self.phase_length:
            self._decide()  # the next round's kind, from the rounds closed so far
        return self.round_speculated

    def end(self, tokens: int) -> None:
        """The current round committed `tokens`."""
        self.tokens = tokens

    def _record(self, seconds: float, tokens: int) -> None:
        if self.round_first or tokens <= 0:
            return
        own, server = (self.speculative, self.ledger.speculative) if self.round_speculated else (self.plain, self.ledger.plain)
        own.add(seconds, tokens)
        server.add(seconds, tokens)

    def estimate(self, speculative: bool) -> float | None:
        """Seconds per committed token: the request's own recent rounds, else the server's."""
        own, server = (self.speculative, self.ledger.speculative) if speculative else (self.plain, self.ledger.plain)
        return own.per_token() if len(own) else server.per_token()

    def _decide(self) -> None:
        speculative, plain = self.estimate(True), self.estimate(False)
        if self.speculating:
            if plain is None:
                self._switch(False, self.settings.judge_rounds, calibrating=True)
            elif speculative is not None and speculative > plain:
                self._detach()
            else:  # it pays (or nothing measured yet): judge again after another stretch
                self.hold = self.settings.min_hold
                self.phase_rounds = 0
        elif self.calibrating and speculative is not None and plain is not None and speculative > plain:
            self._detach()
        else:  # a calibration that says it pays, or a hold that ran out (a probe)
            self.probes += not self.calibrating
            self._switch(True, self.settings.judge_rounds)

    def _detach(self) -> None:
        self.detaches += 1
        self._switch(False, self.hold)
        self.hold = min(2 * self.hold, self.settings.max_hold)

    def _switch(self, speculating: bool, length: int, calibrating: bool = False) -> None:
        self.speculating = speculating
        self.calibrating = calibrating
        self.phase_length = length
        self.phase_rounds = 0
        # a phase measures its kind afresh: conditions (context, load) may have changed since
        (self.speculative if speculating else self.plain).clear()
        self.new_phase = True
