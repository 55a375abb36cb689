"""Speculation that never costs (DESIGN §9): whether a request's next round waits for the drafter.

A round with drafts costs the wait for the chain (drafter compute and the hop) and a wider
verify window; it pays only if it commits enough more tokens. What each kind of round
realises is measured from the request's side: the time from one round's start to the next
round's start (wait, verify, streaming: everything) per committed token. Speculative rounds
are compared with plain ones:

- a request starts speculating, unless the server's recent rounds say speculation does not
  pay, or say it pays too little a token for the tokens the request may still commit to repay
  the drafter's opening (the first speculative round's loss: the stream's open and the
  drafter's catch-up) — then it starts plain, detached; while they do not say either way yet (a fresh
  server, a new drafter), at most `max_explorers` requests at a time speculate to find out and
  the others start plain, looking again every few rounds: a drafter that does not pay is then
  learned by a few requests, not paid for by every request that arrives together (their plain
  rounds also give the explorers the plain cost they judge against);
- after `judge_rounds` speculative rounds it judges; if the plain cost is unknown (no plain
  round here or on the server yet), `judge_rounds` plain rounds calibrate it first;
- speculation slower than plain (by more than `margin`, and beyond `confidence_z` standard
  errors of the per-round loss: a round's tokens vary from 1 to k + 1): the request
  detaches (plain rounds; the drafter hears nothing) and later probes `judge_rounds`
  speculative rounds again;
- probes are paid from a server-wide budget (`Ledger`): every plain round of a request that
  may speculate earns `probe_share` of its time, a probe may start (after at least
  `min_hold` plain rounds of the request, a quarter of that when the server's rounds say
  speculation pays, i.e. the detach was likely bad luck) once the budget holds its expected
  loss (priced on the server's rounds), and is charged what it really lost
  against plain decoding (its first round, which pays the drafter's (re)open or catch-up,
  included). So a drafter that never pays costs at most `probe_share` of the plain decoding
  time (plus one probe), however long it fails;
- a plain cost can go stale: measured under another load (other work on the machine, another
  batch), it may make a drafter look worth it long after it is not, and a request that keeps
  speculating never measures plain again. So after `recheck_rounds` speculative rounds on the
  server without a plain one, the next request to judge measures plain again (a short
  calibration, one request at a time; the server's window stands until its first measured
  round replaces it, so requests beside it keep a plain cost and a verdict), and a request's
  own plain rounds that old give way to the server's;
- the first round of each phase stays out of the estimates (a probe's first chain pays the
  drafter's catch-up of the rounds it missed; a first plain round may lose a compute-ahead);
- in a batch, a round also costs what it cost the other lanes: its draft rows' share of their
  step, its share of what its drafter at work added to the step of the lanes without drafts,
  and the time they waited for it before the step (the engine loop's estimates,
  verifier_service.step_costs / loop): counted with its own time, so speculation goes on where
  it pays the batch, not only the request; and what the others cost it (their draft rows, the
  drafter they set to work, its wait for them) comes off its time, so a plain round beside
  drafting lanes measures a plain step, not theirs;
- costs compare only under the same load (`Load`: the request alone, or beside other requests
  holding a session): the server keeps a ledger per load (`Ledgers`), a round counts under the
  load it began with (one during which lanes came or went too), and a request whose load
  changed — `judge_rounds` rounds in a row began under the other one — starts over as a new
  request under it: at once while it speculates, at the end of its phase while its rounds are
  promised plain. A load that flips every round or two is no load to decide for: the request
  keeps deciding for its own, and judges (without the streak, each flip restarted it, its
  phases never ended and its explorers speculated on for ever: caught by a test). A verdict
  learnt by 8 requests together (where a batch's extra rows cost every lane) does not keep a
  request alone from speculating, nor the reverse;
- acceptance compares only between requests that decode alike: greedy and sampled requests
  keep ledgers apart (`Ledgers[load, sampled]`), so sampled requests whose drafts are rarely
  accepted do not start greedy ones plain (nor the reverse).

Estimates: seconds per committed token over the last `window` rounds of a kind, the
request's own, else the server's (fed by every request, the plain rounds of requests
without drafting included). The decision changes only whether a round has drafts: in exact
mode the committed tokens are the same either way; in probabilistic mode the law is the
same (as for any round whose chain came late).
"""

from __future__ import annotations

import logging
from collections import Counter
from enum import Enum

import structlog

from verifier_service.governor.ledger import CostWindow, Ledgers, Load
from verifier_service.governor.settings import GovernorSettings

log = structlog.get_logger("governor")


class Phase(Enum):
    """Why a request's phase began (its governor's `phases`; the verifier's metric
    tandem_verifier_governor_phases{why}): the first five start a request (or restart it
    under a new load), the rest follow a judgement."""

    VERDICT = "verdict"  # the server's rounds say speculation pays: speculate
    VERDICT_PLAIN = "verdict_plain"  # they say it does not (or too little to repay the opening): plain
    EXPLORE = "explore"  # no verdict yet, an explorer's place: speculate to give one
    AWAIT = "await"  # no verdict, every explorer's place taken: plain, looking again
    NOT_DRAFTING = "not_drafting"  # the request has no drafter
    CALIBRATE = "calibrate"  # no plain cost known: measure it
    RECHECK = "recheck"  # the server's plain cost is stale: measure it again
    CALIBRATED = "calibrated"  # after a calibration, speculation not slower: speculate
    DETACH = "detach"  # speculation measured slower than plain: plain
    PROBE = "probe"  # detached, the budget holds a probe: speculate


class Governor:
    """One request's decisions. Per round, `begin(now)`: whether this round waits for a chain
    (then `next_speculates` says already whether the next one will, so a commit can be held
    back from a drafter that will not be asked and a plain step computed ahead); `end(tokens)`:
    the tokens it committed (its cost is closed by the next `begin`)."""

    def __init__(self, settings: GovernorSettings, ledgers: Ledgers, drafting: bool = True,
                 load: Load = Load.ALONE, sampled: bool = False, max_tokens: int | None = None) -> None:
        self.settings = settings
        self.ledgers = ledgers
        self.max_tokens = max_tokens  # the most tokens the request may commit (None: no bound known)
        self.committed = 0  # tokens its rounds committed so far
        self.sampled = sampled  # (its ledgers are the sampled requests')
        self.drafting = drafting  # False: the request never drafts; its plain rounds still teach the ledger
        self.speculative = CostWindow(settings.window)
        self.plain = CostWindow(settings.window)
        self.exploring = False  # speculating to give the server a verdict (holds a Ledger.explore place)
        self.awaiting = False  # plain until the server's rounds give a verdict (no explorer place was free)
        self.calibrating = False  # this plain phase measures the plain cost, then judges at once
        self.rechecking = False  # this calibration re-measures a plain cost the server holds stale (Ledger.take_recheck)
        self.own_plain_age = 0  # this request's speculative rounds since its own last plain one
        self.probing = False  # this speculative phase is a probe (charged to the ledger's budget)
        self.reserved_s = 0.0  # per probe round, the share of the probe's reservation
        self.started: float | None = None
        # the current round: its kind, whether it opened its phase, whether it belongs to a probe, its load
        self.round_speculated = self.round_first = self.round_probe = False
        self.round_load = load
        self.tokens = 0
        self.cost_to_others_s = 0.0  # the current round's cost to the other lanes of its step
        self.cost_from_others_s = 0.0  # what the other lanes added to the current round's time
        self.rounds = self.speculative_rounds = self.detaches = self.probes = self.load_changes = 0
        self.load_streak = 0  # rounds in a row begun under a load other than the one it decides for
        self.phases: Counter[Phase] = Counter()  # phases begun, by why
        # what the rounds since the last phase began cost the other lanes and were refunded (the debug log's)
        self.charged_s = self.refunded_s = 0.0
        self._start(load)

    def _start(self, load: Load) -> None:
        """Decide as a new request under `load` does: the server's verdict for that load, else
        explore (or wait for the verdict where every explorer's place is taken)."""
        self.load, self.ledger = load, self.ledgers[load, self.sampled]  # (the ledger its estimates and decisions use)
        self.exploring = self.awaiting = False
        verdict = self._verdict() if self.drafting else False
        if verdict is None:
            self.exploring = self.ledger.explore()
            self.awaiting = not self.exploring
        speculating = self.drafting and (verdict is True or self.exploring)
        s = self.settings
        why = (Phase.NOT_DRAFTING if not self.drafting else Phase.VERDICT if verdict is True
               else Phase.EXPLORE if self.exploring else Phase.AWAIT if self.awaiting else Phase.VERDICT_PLAIN)
        self._switch(speculating, s.judge_rounds if speculating else s.verdict_rounds if self.awaiting else s.min_hold, why)

    @property
    def next_speculates(self) -> bool:
        return self.speculating

    def plain_ahead(self) -> int | None:
        """How many rounds after the current one (its `begin` called) will certainly be plain
        (None: every one): the next round's kind is decided, later ones only when a phase
        ends — at the `begin` where the phase's rounds reach its length. The engine loop runs
        that many plain rounds without waiting for this request's coroutine."""
        if not self.drafting:
            return None
        if self.speculating:
            return 0
        return max(self.phase_length - self.phase_rounds, 1)

    def begin(self, now: float, load: Load = Load.ALONE) -> bool:
        """Close the last round (measured up to now); whether this round, which begins under
        `load`, waits for a chain."""
        if self.started is not None:  # (what it cost: its time, what it cost others, less what others cost it)
            self._record(max(now - self.started + self.cost_to_others_s - self.cost_from_others_s, 0.0), self.tokens)
        self.started, self.tokens, self.cost_to_others_s, self.cost_from_others_s = now, 0, 0.0, 0.0
        self.round_speculated, self.round_probe, self.round_load = self.speculating, self.probing, load
        self.round_first, self.new_phase = self.new_phase, False
        self.rounds += 1
        self.speculative_rounds += self.round_speculated
        self.phase_rounds += 1
        if not self.drafting:
            return self.round_speculated
        # its load changed when `judge_rounds` rounds in a row began under the other one (a load
        # that flips every round or two is no load to decide for: the request keeps its own)
        self.load_streak = self.load_streak + 1 if load != self.load else 0
        if self.load_streak >= self.settings.judge_rounds and (self.speculating or self.phase_rounds >= self.phase_length):
            self._restart(load)  # (rounds promised plain stay plain: a plain phase ends first)
        elif self.phase_rounds >= self.phase_length:
            self._decide()  # the next round's kind, from the rounds closed so far
        return self.round_speculated

    def _restart(self, load: Load) -> None:
        """The request's load changed: what it measured says nothing of the new one, so it
        starts over as a new request under it (from the next round on)."""
        self.close()  # (an explorer's or a recheck's place under the old load)
        self.load_changes += 1
        self.load_streak = 0
        self.round_probe = False  # (a probe ends: its reservation stands for the rounds it ran)
        self.own_plain_age = 0
        self.speculative.clear()
        self.plain.clear()
        self._start(load)

    def end(self, tokens: int, cost_to_others_s: float = 0.0, cost_from_others_s: float = 0.0) -> None:
        """The current round committed `tokens`, cost the other lanes `cost_to_others_s` and was
        made longer by them by `cost_from_others_s` (RoundOutcome's fields of those names)."""
        self.tokens = tokens
        self.committed += tokens
        self.cost_to_others_s = cost_to_others_s
        self.cost_from_others_s = cost_from_others_s
        self.charged_s += cost_to_others_s
        self.refunded_s += cost_from_others_s

    def _record(self, seconds: float, tokens: int) -> None:
        """Close the last round: the budget and the cost estimates of the load it began under
        (the request's own estimates: where that is the load it decides for)."""
        ledger = self.ledgers[self.round_load, self.sampled]
        if not self.round_speculated:
            if self.drafting:  # (the budget is a share of what requests that may speculate decode plainly)
                ledger.earn(seconds)
        else:
            plain = self.estimate(False) if self.round_load == self.load else None
            excess = seconds - tokens * plain if plain is not None else 0.0
            if self.round_first and plain is not None:
                ledger.note_opening(excess)
            if self.round_probe:  # what the round lost against plain decoding, less its share of the reservation
                ledger.charge(excess - self.reserved_s)
        if self.round_first or tokens <= 0:
            return
        ledger.counted(self.round_speculated, seconds, tokens, recheck=self.rechecking)
        if self.round_load != self.load:
            return
        (self.speculative if self.round_speculated else self.plain).add(seconds, tokens)
        self.own_plain_age = self.own_plain_age + 1 if self.round_speculated else 0
        if self.own_plain_age >= self.settings.recheck_rounds:  # (stale: the server's, fresher, is used instead)
            self.plain.clear()

    def estimate(self, speculative: bool) -> float | None:
        """Seconds per committed token: the request's own recent rounds, else the server's."""
        own, server = (self.speculative, self.ledger.speculative) if speculative else (self.plain, self.ledger.plain)
        return own.per_token() if len(own) else server.per_token()

    def _verdict(self) -> bool | None:
        """The server's verdict for this request: whether speculation pays (None: not known yet),
        False also where it pays too little to repay the opening (the request then starts as a
        detached one: a probe may still come, paid from the budget)."""
        verdict = self.ledger.pays()
        return False if verdict is True and not self._repays_opening() else verdict

    def _repays_opening(self) -> bool:
        """Whether the tokens this request may still commit can repay the drafter's opening (what
        a speculative phase's first round loses: the stream's open and the drafter's catch-up) at
        the per-token saving speculation has shown. The verdict that speculation pays is per
        token, and a tie within the margin counts as paying: a short request, or one whose
        drafts only tie, would pay the opening and never get it back (docs/PERFORMANCE.md,
        session 40)."""
        opening = self.ledger.opening_excess_s
        if self.max_tokens is None or opening <= 0:
            return True
        speculative, plain = self.estimate(True), self.estimate(False)
        if speculative is None or plain is None:
            return True
        return (plain - speculative) * max(self.max_tokens - self.committed, 0) >= opening

    def _slower(self, plain: float) -> bool:
        """Whether speculating is slower than plain decoding (by the margin, beyond noise)."""
        window = self.speculative if len(self.speculative) else self.ledger.speculative
        return window.slower(plain * (1 + self.settings.margin), self.settings.confidence_z)

    def _expected_probe_loss(self) -> float:
        plain = self.estimate(False)
        if plain is None:
            return 0.0
        # the server's window: many rounds, so one request's unlucky stretch does not price its probes
        window = self.ledger.speculative if len(self.ledger.speculative) else self.speculative
        excess = window.excess(plain)
        opening = max(self.ledger.opening_excess_s, 0.0)
        return max(excess or 0.0, 0.0) * (self.settings.judge_rounds - 1) + opening

    def close(self) -> None:
        """The request ended (or went away): give back an explorer's (or a recheck's) place."""
        if self.exploring:
            self.exploring = False
            self.ledger.explored()
        self._end_recheck()

    def _end_recheck(self) -> None:
        if self.rechecking:
            self.rechecking = False
            self.ledger.recheck_done()

    def _decide(self) -> None:
        if self.awaiting:
            self._look_for_verdict()
            return
        speculative, plain = self.estimate(True), self.estimate(False)
        if self.speculating:
            self.close()  # an explorer's first judgement is its contribution
            if plain is None:
                self._switch(False, self.settings.judge_rounds, Phase.CALIBRATE, calibrating=True)
            elif speculative is not None and self._slower(plain):
                self._detach()
            elif self.ledger.take_recheck():  # it pays against a plain cost measured long ago: measure it again
                self._switch(False, self.settings.recheck_measured + 2, Phase.RECHECK, calibrating=True)
                self.rechecking = True
            else:  # it pays (or nothing measured yet): judge again after another stretch
                self.probing = False
                self.phase_rounds = 0
        elif self.calibrating:
            self._end_recheck()
            if speculative is not None and plain is not None and self._slower(plain):
                self._detach()
            else:
                self._switch(True, self.settings.judge_rounds, Phase.CALIBRATED)
        else:  # detached: probe when the budget holds what a probe is expected to lose
            expected = self._expected_probe_loss()
            if expected > 0 and self.phase_rounds < self.settings.min_hold:
                return  # (where the server's rounds say speculation pays, a detach was likely bad luck: probe early)
            if self.ledger.credit_s >= expected and self.ledger.reserve(expected):
                self.probes += 1
                self._switch(True, self.settings.judge_rounds, Phase.PROBE)
                self.probing, self.reserved_s = True, expected / self.settings.judge_rounds

    def _look_for_verdict(self) -> None:
        """A request waiting for the server's verdict: speculate where it pays (or where an
        explorer's place is free again), stay plain — as if detached — where it does not."""
        verdict = self._verdict()
        if verdict is None and not self.ledger.explore():
            self.phase_rounds = 0  # look again in verdict_rounds
            return
        self.awaiting = False
        if verdict is False:
            self._switch(False, self.settings.min_hold, Phase.VERDICT_PLAIN)
            return
        self.exploring = verdict is None
        self._switch(True, self.settings.judge_rounds, Phase.EXPLORE if self.exploring else Phase.VERDICT)

    def _detach(self) -> None:
        self.detaches += 1
        self._switch(False, max(1, self.settings.min_hold // 4), Phase.DETACH)

    def _switch(self, speculating: bool, length: int, why: Phase, calibrating: bool = False) -> None:
        self.phases[why] += 1
        if log.is_enabled_for(logging.DEBUG):  # (debug: what the decision saw — a phase begins every few rounds)
            log.debug("governor phase", why=why.value, speculating=speculating, rounds=length, load=self.load.value,
                      sampled=self.sampled, own=(self.estimate(True), self.estimate(False)),
                      server=(self.ledger.speculative.per_token(), self.ledger.plain.per_token()),
                      server_rounds=(len(self.ledger.speculative), len(self.ledger.plain)),
                      credit_s=self.ledger.credit_s, committed=self.committed,
                      charged_s=self.charged_s, refunded_s=self.refunded_s)
        self.charged_s = self.refunded_s = 0.0
        self.speculating = speculating
        self.calibrating = calibrating
        self.probing = False
        self.phase_length = length
        self.phase_rounds = 0
        # a phase measures its kind afresh: conditions (context, load) may have changed since
        (self.speculative if speculating else self.plain).clear()
        self.new_phase = True
