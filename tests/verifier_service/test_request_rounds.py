"""A request's rounds as its coroutine runs them: events of plain rounds ready together."""

from shared.protocol import verifier_pb2
from verifier_service.request_rounds import merge_events


def plain_event(round_id, token, text, verify_ms, logprob=None):
    event = verifier_pb2.GenerateEvent(token_ids=[token], round=verifier_pb2.RoundInfo(round_id=round_id, verify_ms=verify_ms))
    if text is not None:
        event.text_delta = text
    if logprob is not None:
        event.logprobs.add(logprob=logprob, rank=1)
    return event


def test_merged_events_carry_every_rounds_tokens_text_and_logprobs():
    event = plain_event(4, 11, "a", 1.5, -0.5)
    merge_events(event, plain_event(5, 12, "", 2.0, -1.0))  # (text held back: "")
    merge_events(event, plain_event(6, 13, "bc", 0.5, -2.0))
    assert list(event.token_ids) == [11, 12, 13] and event.text_delta == "abc"
    assert [lp.logprob for lp in event.logprobs] == [-0.5, -1.0, -2.0]
    assert (event.round.round_id, event.round.num_rounds, event.round.verify_ms) == (4, 3, 4.0)
    assert not event.round.speculative


def test_without_a_tokenizer_a_merged_event_has_no_text():
    event = plain_event(0, 1, None, 1.0)
    merge_events(event, plain_event(1, 2, None, 1.0))
    assert not event.HasField("text_delta") and event.round.num_rounds == 2
