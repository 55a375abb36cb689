"""What the drafter accepts from a verifier: every field checked against the model and the
session before any work is done (issue 12, item 4). The drafter is reachable by anyone who
can reach its port (unless it requires a token or client certificates), so one malformed
or oversized message must cost a refusal (INVALID_ARGUMENT), never minutes of worker time
or memory that every later request pays for.
"""

from __future__ import annotations

from shared.model import ModelConfig
from shared.protocol import MAX_ID_LENGTH, RECORD_PROMPT_END, drafter_pb2


def check_open(message: drafter_pb2.DraftOpen, config: ModelConfig) -> None:
    """Raise ValueError naming the bad field of an open."""
    if len(message.session_id) > MAX_ID_LENGTH:
        raise ValueError(f"open.session_id has {len(message.session_id)} characters; at most {MAX_ID_LENGTH}")
    count = len(message.token_ids)
    if not 1 <= count <= config.max_position_embeddings:
        raise ValueError(f"open.token_ids has {count} tokens; 1 to {config.max_position_embeddings} are allowed")
    _check_ids(message.token_ids, config.vocab_size, "open.token_ids")
    _check_hidden(message.hidden, count - 1, config.hidden_size, "open.hidden")


def check_commit(message: drafter_pb2.DraftCommit, *, max_drafts: int, committed: int, round_id: int,
                 config: ModelConfig) -> None:
    """Raise ValueError naming the bad field of a commit for a session with `committed` tokens
    that expects round `round_id` next."""
    emitted = len(message.emitted_token_ids)
    rounds = max(message.num_rounds, 1)
    if message.round_id - (rounds - 1) != round_id:
        first = message.round_id - rounds + 1
        span = f"rounds {first}..{message.round_id}" if rounds > 1 else f"round_id {message.round_id}"
        raise ValueError(f"commit.{span} does not start at the session's round {round_id}")
    if not 0 <= message.num_verified <= max_drafts:
        raise ValueError(f"commit.num_verified {message.num_verified} must lie in [0, {max_drafts}]")
    if not 0 <= message.num_accepted <= message.num_verified:
        raise ValueError(f"commit.num_accepted {message.num_accepted} must lie in [0, num_verified = {message.num_verified}]")
    if rounds > 1:  # a resume: every token since the last commit, nothing verified
        if message.num_verified or not rounds <= emitted:
            raise ValueError(f"commit.num_rounds {rounds}: num_verified must be 0 and emitted_token_ids hold at least "
                             f"one token a round; got {message.num_verified} and {emitted}")
    elif emitted != message.num_accepted + 1:
        raise ValueError(f"commit.emitted_token_ids has {emitted} tokens; num_accepted + 1 = {message.num_accepted + 1}")
    if committed + emitted > config.max_position_embeddings:
        raise ValueError(f"the session would hold {committed + emitted} tokens; the model takes {config.max_position_embeddings}")
    _check_ids(message.emitted_token_ids, config.vocab_size, "commit.emitted_token_ids")
    for name in ("verify_ms", "wait_ms"):  # (the planner learns from one, load shedding reads the other)
        value = getattr(message, name)
        if not 0 <= value < 3.6e6:  # also refuses NaN
            raise ValueError(f"commit.{name} {value!r} must be a duration in [0, 3600000) ms")
    if message.HasField("hidden"):
        _check_hidden(message.hidden, emitted, config.hidden_size, "commit.hidden")


def check_record(message: drafter_pb2.RecordRequest, config: ModelConfig) -> None:
    """Raise ValueError naming the bad field of a record (a finished request's output)."""
    if len(message.session_id) > MAX_ID_LENGTH:
        raise ValueError(f"record.session_id has {len(message.session_id)} characters; at most {MAX_ID_LENGTH}")
    if len(message.prompt_end_ids) > RECORD_PROMPT_END:
        raise ValueError(f"record.prompt_end_ids has {len(message.prompt_end_ids)} tokens; at most {RECORD_PROMPT_END}")
    if len(message.output_ids) > config.max_position_embeddings:
        raise ValueError(f"record.output_ids has {len(message.output_ids)} tokens; at most "
                         f"{config.max_position_embeddings}")
    _check_ids(message.prompt_end_ids, config.vocab_size, "record.prompt_end_ids")
    _check_ids(message.output_ids, config.vocab_size, "record.output_ids")


def _check_ids(ids, vocab_size: int, field: str) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{field}[{index}] = {token} is out of range [0, {vocab_size})")


def _check_hidden(hidden: drafter_pb2.HiddenRows, rows: int, size: int, field: str) -> None:
    if hidden.num_rows == 0 and not hidden.bf16:
        return  # no rows sent (a drafter without MTP needs none; with MTP the catch-up checks the count)
    if hidden.num_rows != rows or hidden.hidden_size != size or len(hidden.bf16) != 2 * rows * size:
        raise ValueError(f"{field} is {hidden.num_rows} x {hidden.hidden_size} ({len(hidden.bf16)} bytes); "
                         f"expected {rows} x {size} bf16 rows")
