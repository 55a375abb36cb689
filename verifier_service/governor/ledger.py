"""The server's side of the governor (verifier_service.governor, DESIGN §9): what rounds of
each kind realised lately over all requests (the prior of a request that has not measured a
kind, and the server's verdict), the explorers' places, the plain cost's rechecks and the probe
budget — one ledger per load (a request alone, or beside others holding a session) and way of
decoding (greedy or sampled): costs compare only under the same load, and acceptance only
between requests that decode alike."""

from __future__ import annotations

import math
import threading
from collections import deque
from enum import Enum

from verifier_service.governor.settings import GovernorSettings

OPENING_EMA = 0.25


class CostWindow:
    """Seconds per committed token over the last rounds of one kind (running sums: every round
    of every request reads these, so a read costs O(1))."""

    def __init__(self, size: int) -> None:
        self.rounds: deque[tuple[float, int]] = deque(maxlen=size)
        self.seconds = 0.0
        self.tokens = 0

    def add(self, seconds: float, tokens: int) -> None:
        if len(self.rounds) == self.rounds.maxlen:
            old_seconds, old_tokens = self.rounds[0]
            self.seconds -= old_seconds
            self.tokens -= old_tokens
        self.rounds.append((seconds, tokens))
        self.seconds += seconds
        self.tokens += tokens

    def clear(self) -> None:
        self.rounds.clear()
        self.seconds, self.tokens = 0.0, 0

    def __len__(self) -> int:
        return len(self.rounds)

    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None

    def excess(self, plain_per_token: float) -> float | None:
        """Mean seconds a round of this window lost against plain decoding of its tokens."""
        if not self.rounds:
            return None
        return (self.seconds - self.tokens * plain_per_token) / len(self.rounds)

    def slower(self, plain_per_token: float, z: float) -> bool:
        """Whether these rounds lost against plain decoding at `plain_per_token` beyond noise: the
        mean loss per round exceeds z standard errors (a round's tokens vary a lot: 1 to k + 1)."""
        n = len(self.rounds)
        if n == 0:
            return False
        losses = [s - t * plain_per_token for s, t in self.rounds]
        mean = sum(losses) / n
        if n == 1:
            return mean > 0 and z == 0
        variance = sum((x - mean) ** 2 for x in losses) / (n - 1)
        return mean > z * math.sqrt(variance / n)


class Ledger:
    """The server's view over all requests (the prior of a request that has not measured a
    kind) and the probe budget. Requests run on one event loop; the lock keeps it right
    should they not."""

    def __init__(self, settings: GovernorSettings) -> None:
        self.settings = settings
        self.speculative = CostWindow(settings.server_window)
        self.plain = CostWindow(settings.server_window)
        self.credit_s = 0.0  # what probes may still lose
        self.explorers = 0  # requests speculating to give the server its first verdict
        # what the first round of a speculative phase loses against plain: the drafter's (re)open
        # or catch-up on the rounds it missed, kept out of the estimates but not out of a probe's cost
        self.opening_excess_s = 0.0
        # speculative rounds since the last plain one, all requests: past recheck_rounds the
        # plain cost may be stale (measured under another load), so one request measures it again
        self.since_plain = 0
        self.rechecking = False  # a request is measuring plain again
        # the plain window is stale: the recheck's first measured round replaces it (until then
        # it stands: an empty window would leave every request without a plain cost to judge by)
        self.plain_stale = False
        self._lock = threading.Lock()

    def pays(self) -> bool | None:
        """Whether speculation has paid lately (None: too few rounds of either kind to say). As
        many rounds as one request judges on suffice: the server's verdict is its requests' —
        of plain ones, as many as a recheck measures (the window it leaves must give a verdict:
        with fewer, every request arriving after a recheck explored or waited again)."""
        s = self.settings
        if len(self.speculative) < min(s.judge_rounds - 1, s.server_window) \
                or len(self.plain) < min(s.recheck_measured, s.server_window):
            return None
        # the same rule as a request's detach: slower by the margin, beyond noise
        return not self.speculative.slower(self.plain.per_token() * (1 + s.margin), s.confidence_z)

    def counted(self, speculative: bool, seconds: float, tokens: int, recheck: bool = False) -> None:
        """A measured round of either kind (plain ones make the plain cost fresh; a recheck's
        first one replaces the stale window)."""
        with self._lock:
            self.since_plain = self.since_plain + 1 if speculative else 0
            if speculative:
                self.speculative.add(seconds, tokens)
                return
            if recheck and self.plain_stale:
                self.plain.clear()
                self.plain_stale = False
            self.plain.add(seconds, tokens)

    def take_recheck(self) -> bool:
        """Whether the caller should measure plain again (then it holds the place until recheck_done)."""
        with self._lock:
            if self.rechecking or self.since_plain < self.settings.recheck_rounds:
                return False
            self.rechecking = True
            self.plain_stale = True  # (the recheck's rounds replace it as they come)
            return True

    def recheck_done(self) -> None:
        with self._lock:
            self.rechecking = False
            self.plain_stale = False  # (a recheck that measured nothing leaves the window as it was)
            self.since_plain = 0

    def explore(self) -> bool:
        """Take one of the `max_explorers` places (False: all taken)."""
        with self._lock:
            if self.explorers >= self.settings.max_explorers:
                return False
            self.explorers += 1
            return True

    def explored(self) -> None:
        with self._lock:
            self.explorers -= 1

    def earn(self, plain_seconds: float) -> None:
        with self._lock:
            self.credit_s += self.settings.probe_share * plain_seconds

    def charge(self, seconds: float) -> None:
        with self._lock:
            self.credit_s -= seconds

    def note_opening(self, excess_s: float) -> None:
        with self._lock:
            self.opening_excess_s += OPENING_EMA * (excess_s - self.opening_excess_s)

    def reserve(self, expected_loss_s: float) -> bool:
        """Take a probe's expected loss from the budget if it holds it."""
        with self._lock:
            if self.credit_s < expected_loss_s:
                return False
            self.credit_s -= expected_loss_s
            return True


class Load(Enum):
    """What a round's cost is measured under: its request alone, or beside other requests
    holding a session (VerifierService.round_load), whose rounds share the engine loop's steps
    (a step's extra rows then cost every lane)."""

    ALONE = "alone"
    SHARED = "shared"

    @staticmethod
    def of(other_lanes: int) -> Load:
        return Load.SHARED if other_lanes > 0 else Load.ALONE


class Ledgers:
    """The server's ledgers, one per load and way of decoding: costs measured under one load say
    nothing of another, and a sampled request's drafts are accepted far less often than a greedy
    one's (where speculation paid greedy requests and cost sampled ones, one verdict for both
    kept the greedy ones plain: docs/PERFORMANCE.md, session 29)."""

    def __init__(self, settings: GovernorSettings) -> None:
        self._by_kind = {(load, sampled): Ledger(settings) for load in Load for sampled in (False, True)}

    def __getitem__(self, key: tuple[Load, bool]) -> Ledger:
        """The ledger of (load, sampled)."""
        return self._by_kind[key]
