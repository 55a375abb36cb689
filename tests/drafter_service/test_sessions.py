"""SessionStore (bounded LRU by id) and session_params (DraftOpen → settings)."""

import copy
import re
from types import SimpleNamespace

import pytest

from drafter_service.planner import Estimates
from drafter_service.proposers.suffix import SuffixIndex
from drafter_service.drafter import Drafter
from drafter_service.session import DraftSession, SessionStore, session_params
from drafter_service.settings import DrafterSettings
from kernels.retention import RetentionPolicy
from kernels.sampling import DEFAULT_MAX_SUPPORT, SamplingParams
from kernels.speculative import Gate, Mode
from shared.protocol import common_pb2, drafter_pb2


def make_session(session_id):
    return DraftSession(
        session_id=session_id,
        sampling=SamplingParams(),
        seed=0,
        mode=Mode.EXACT,
        gate=Gate.TOP,
        coupled=False,
        policy=RetentionPolicy(),
        max_drafts=4,
        snapshot=Estimates(),
        suffix=SuffixIndex(),
        mtp=None,
        round_id=0,
    )


def held(store, sessions):
    return [s.session_id for s in sessions if store.holds(s)]


# --- SessionStore ------------------------------------------------------------------------


def test_lru_eviction_order():
    store = SessionStore(capacity=3)
    a, b, c, d, e = (make_session(x) for x in "abcde")
    for s in (a, b, c):
        store.put(s)
    assert len(store) == 3 and store.evictions == 0
    store.put(d)  # evicts a
    assert held(store, [a, b, c, d]) == ["b", "c", "d"]
    store.put(e)  # evicts b
    assert held(store, [a, b, c, d, e]) == ["c", "d", "e"]
    assert len(store) == 3 and store.evictions == 2
    assert [s.session_id for s in store._sessions.values()] == ["c", "d", "e"]  # LRU order


def test_touch_refreshes_recency():
    store = SessionStore(capacity=2)
    a, b, c = (make_session(x) for x in "abc")
    store.put(a)
    store.put(b)
    assert store.touch(a) is True  # now b is least recently used
    store.put(c)
    assert store.touch(b) is False
    assert store.touch(a) is True and store.touch(c) is True
    assert store.evictions == 1


def test_evicted_session_touch_returns_false():
    store = SessionStore(capacity=1)
    a, b = make_session("a"), make_session("b")
    store.put(a)
    assert store.touch(a)
    store.put(b)
    assert store.touch(a) is False
    assert store.touch(b) is True
    # A touch of an evicted session does not bring it back or disturb the others.
    assert len(store) == 1 and store.touch(b)


def test_a_second_session_under_the_same_id_cannot_displace_the_first():
    store = SessionStore(capacity=2)
    victim, intruder = make_session("x"), make_session("x")
    store.put(victim)
    store.put(intruder)  # another stream opening the victim's id gets its own session
    assert len(store) == 2 and store.evictions == 0
    assert store.touch(victim) is True and store.touch(intruder) is True
    store.remove(intruder)
    assert store.touch(victim) is True and len(store) == 1


def test_re_put_moves_to_most_recent():
    store = SessionStore(capacity=2)
    a, b, c = (make_session(x) for x in "abc")
    store.put(a)
    store.put(b)
    store.put(a)
    store.put(c)  # evicts b
    assert held(store, [a, b, c]) == ["a", "c"]
    assert store.evictions == 1


def test_remove():
    store = SessionStore(capacity=3)
    a, b = make_session("a"), make_session("b")
    store.put(a)
    store.put(b)
    store.remove(a)
    assert len(store) == 1
    assert store.touch(a) is False and store.touch(b) is True
    store.remove(a)  # removing twice is harmless
    store.remove(make_session("never"))
    assert len(store) == 1
    assert store.evictions == 0  # removals are not evictions


def test_evictions_counter():
    store = SessionStore(capacity=2)
    sessions = [make_session(str(i)) for i in range(7)]
    for count, session in enumerate(sessions, start=1):
        store.put(session)
        assert store.evictions == max(0, count - 2)
        assert len(store) == min(count, 2)
    assert held(store, sessions) == ["5", "6"]


def test_zero_capacity_holds_nothing():
    store = SessionStore(capacity=0)
    a = make_session("a")
    store.put(a)
    assert len(store) == 0 and store.evictions == 1
    assert store.touch(a) is False


def test_session_tokens_are_the_suffix_history():
    session = make_session("a")
    session.suffix.extend([4, 5, 6])
    assert session.tokens == [4, 5, 6]


# --- session_params ----------------------------------------------------------------------


def open_message(sampling=None, speculation=None):
    message = drafter_pb2.DraftOpen(session_id="s", token_ids=[1, 2, 3])
    if sampling is not None:
        message.sampling.CopyFrom(sampling)
    if speculation is not None:
        message.speculation.CopyFrom(speculation)
    return message


def test_session_params_defaults():
    sampling, mode, gate, policy = session_params(drafter_pb2.DraftOpen(session_id="s"))
    assert sampling == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, max_support=DEFAULT_MAX_SUPPORT)
    assert sampling.greedy
    assert mode == Mode.EXACT
    assert gate == Gate.TOP
    assert policy == RetentionPolicy(schedule=None, min_cum=0.0, min_p=0.0)


def test_session_params_full():
    message = open_message(
        common_pb2.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=123, max_support=16),
        common_pb2.SpeculationParams(
            mode=common_pb2.MODE_PROBABILISTIC,
            gate=common_pb2.GATE_PICK,
            coupled=True,
            retention=common_pb2.RetentionParams(schedule="0.10, 0.35 ,0.55", min_cum=0.25),
        ),
    )
    sampling, mode, gate, policy = session_params(message)
    assert sampling.temperature == pytest.approx(0.7)
    assert sampling.top_k == 40
    assert sampling.top_p == pytest.approx(0.9)
    assert sampling.min_p == pytest.approx(0.05)
    assert sampling.max_support == 16
    assert mode == Mode.PROBABILISTIC
    assert gate == Gate.PICK
    assert policy.schedule == (0.10, 0.35, 0.55)  # parsed from text: exact
    assert policy.min_cum == 0.25
    assert policy.min_p == sampling.min_p  # the caller's floor when no schedule applies


@pytest.mark.parametrize(
    "proto_mode, proto_gate, mode, gate",
    [
        (
            common_pb2.MODE_UNSPECIFIED,
            common_pb2.GATE_UNSPECIFIED,
            Mode.EXACT,
            Gate.TOP,
        ),
        (common_pb2.MODE_EXACT, common_pb2.GATE_TOP, Mode.EXACT, Gate.TOP),
        (common_pb2.MODE_EXACT, common_pb2.GATE_PICK, Mode.EXACT, Gate.PICK),
        (
            common_pb2.MODE_PROBABILISTIC,
            common_pb2.GATE_TOP,
            Mode.PROBABILISTIC,
            Gate.TOP,
        ),
        (
            common_pb2.MODE_PROBABILISTIC,
            common_pb2.GATE_UNSPECIFIED,
            Mode.PROBABILISTIC,
            Gate.TOP,
        ),
    ],
)
def test_session_params_mode_and_gate(proto_mode, proto_gate, mode, gate):
    message = open_message(speculation=common_pb2.SpeculationParams(mode=proto_mode, gate=proto_gate))
    assert session_params(message)[1:3] == (mode, gate)


def test_top_p_unset_means_off_but_explicit_zero_is_rejected():
    assert session_params(open_message(common_pb2.SamplingParams(temperature=1.0)))[0].top_p == 1.0
    with pytest.raises(ValueError, match="top_p"):
        session_params(open_message(common_pb2.SamplingParams(temperature=1.0, top_p=0.0)))


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"top_k": -1}, "top_k"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_support": -3}, "max_support"),
        ({"min_p": 1.5}, "min_p"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_sampling_raises_value_error_naming_it(fields, name):
    with pytest.raises(ValueError, match=name):
        session_params(open_message(common_pb2.SamplingParams(**fields)))


def test_empty_schedule_is_unset():
    message = open_message(speculation=common_pb2.SpeculationParams(retention=common_pb2.RetentionParams(schedule="")))
    assert session_params(message)[3].schedule is None


@pytest.mark.parametrize(
    "schedule, named",
    [
        ("0.1,,0.5", "0.1,,0.5"),
        ("0.1, abc", "abc"),
        ("1.5", "1.5"),
        ("-0.1", "-0.1"),
        ("nan", "nan"),
        ("0.1, inf", "inf"),
        (",".join(["0.1"] * 9), ",".join(["0.1"] * 9)),
        (" ", "retention schedule"),
    ],
)
def test_bad_retention_schedule_raises_value_error_naming_it(schedule, named):
    message = open_message(
        speculation=common_pb2.SpeculationParams(retention=common_pb2.RetentionParams(schedule=schedule))
    )
    with pytest.raises(ValueError, match="retention schedule") as info:
        session_params(message)
    assert re.search(re.escape(named), str(info.value)), str(info.value)


@pytest.mark.parametrize("min_cum", [1.5, -0.25, float("nan"), float("inf")])
def test_bad_retention_min_cum_raises_value_error_naming_it(min_cum):
    message = open_message(
        speculation=common_pb2.SpeculationParams(retention=common_pb2.RetentionParams(min_cum=min_cum))
    )
    with pytest.raises(ValueError, match="min_cum"):
        session_params(message)


# --- snapshots through the Drafter (seed 002), without a model: suffix drafts only --------


def suffix_only_drafter():
    return Drafter(SimpleNamespace(mtp=None), DrafterSettings())


def run_rejected_rounds(drafter, session, rounds):
    """Rounds in which every suffix draft is rejected and verification is slow."""
    chain = drafter.propose(session)
    for _ in range(rounds):
        commit = drafter_pb2.DraftCommit(
            round_id=session.round_id,
            num_accepted=0,
            emitted_token_ids=[900 + session.round_id],
            num_verified=len(chain.token_ids),
            verify_ms=50.0,
        )
        drafter.commit(session, commit)
        chain = drafter.propose(session)


def test_open_session_keeps_its_snapshot_while_its_rounds_are_learned():
    drafter = suffix_only_drafter()
    message = drafter_pb2.DraftOpen(session_id="req", token_ids=[1, 2, 3, 4, 5, 1, 2, 3], max_draft_tokens=4)
    session = drafter.open(message)
    initial = copy.deepcopy(session.snapshot)
    run_rejected_rounds(drafter, session, 10)
    assert drafter.planner.live != initial  # the live policy learned from these rounds
    assert session.snapshot == initial  # the request's own choices still use the initial one
    # A new request starts from the live policy.
    other = drafter.open(drafter_pb2.DraftOpen(session_id="other", token_ids=[1, 2, 3], max_draft_tokens=4))
    assert other.snapshot == drafter.planner.live


def test_resync_of_the_same_request_keeps_the_request_initial_snapshot():
    drafter = suffix_only_drafter()
    message = drafter_pb2.DraftOpen(session_id="req", token_ids=[1, 2, 3, 4, 5, 1, 2, 3], max_draft_tokens=4)
    session = drafter.open(message)
    initial = copy.deepcopy(session.snapshot)
    run_rejected_rounds(drafter, session, 10)
    resync = drafter_pb2.DraftOpen(
        session_id="req",
        token_ids=session.tokens,
        max_draft_tokens=4,
        next_round_id=session.round_id,
    )
    assert drafter.open(resync).snapshot == initial
