"""The Generate client (async and sync), against a real in-process grpc.aio server running a
fake verifier (tests/shared/fake_verifier.py)."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from shared.client import (
    MAX_MESSAGE_BYTES,
    AsyncVerifierClient,
    Generation,
    GenerationConfig,
    VerifierClient,
    VerifierError,
)
from shared.protocol import PROTOCOL_VERSION, common_pb2
from tests.shared.fake_verifier import BAD_LENGTH, EXPECTED_STATS


# --- GenerationConfig.to_request ---------------------------------------------------------


def test_default_config_maps_to_server_defaults():
    request = GenerationConfig().to_request("hello")
    assert request.protocol_version == PROTOCOL_VERSION
    assert request.WhichOneof("prompt") == "prompt_text" and request.prompt_text == "hello"
    assert request.max_new_tokens == 64
    assert not request.sampling.HasField("top_p")
    assert request.sampling.temperature == 0.0 and request.sampling.top_k == 0 and request.sampling.seed == 0
    assert request.speculation.mode == common_pb2.MODE_EXACT
    assert request.speculation.gate == common_pb2.GATE_TOP
    assert not request.speculation.disable and not request.speculation.coupled
    assert request.speculation.retention.schedule == "" and request.speculation.retention.min_cum == 0.0
    assert list(request.stop.eos_token_ids) == [] and list(request.stop.stop_sequences) == []
    assert request.request_id == ""


def test_every_config_field_maps_to_the_request():
    config = GenerationConfig(
        max_new_tokens=17,
        temperature=0.75,
        top_k=40,
        top_p=0.5,
        min_p=0.125,
        seed=2**63 + 5,
        max_support=32,
        mode="probabilistic",
        gate="pick",
        max_draft_tokens=6,
        retention_schedule="0.10, 0.35",
        retention_min_cum=0.25,
        speculation=False,
        coupled=False,
        eos_token_ids=[2, 3],
        stop=["\n\n", "END"],
        request_id="req-1",
    )
    assert config.eos_token_ids == (2, 3) and config.stop == ("\n\n", "END")  # lists become tuples
    request = config.to_request([5, 6, 7])
    assert request.WhichOneof("prompt") == "prompt_ids" and list(request.prompt_ids.ids) == [5, 6, 7]
    assert request.protocol_version == PROTOCOL_VERSION
    assert request.max_new_tokens == 17
    assert request.request_id == "req-1"
    sampling = request.sampling
    assert sampling.temperature == 0.75 and sampling.top_k == 40
    assert sampling.HasField("top_p") and sampling.top_p == 0.5
    assert sampling.min_p == 0.125 and sampling.seed == 2**63 + 5 and sampling.max_support == 32
    speculation = request.speculation
    assert speculation.mode == common_pb2.MODE_PROBABILISTIC and speculation.gate == common_pb2.GATE_PICK
    assert speculation.max_draft_tokens == 6
    assert speculation.retention.schedule == "0.10, 0.35" and speculation.retention.min_cum == 0.25
    assert speculation.disable and not speculation.coupled
    assert GenerationConfig(coupled=True).to_request([1]).speculation.coupled
    assert list(request.stop.eos_token_ids) == [2, 3] and list(request.stop.stop_sequences) == ["\n\n", "END"]


def test_top_p_one_is_sent_not_dropped():
    assert GenerationConfig(top_p=1.0).to_request([1]).sampling.HasField("top_p")


def test_bad_configs_and_prompts_fail_before_any_call():
    with pytest.raises(ValueError, match="mode"):
        GenerationConfig(mode="fast")
    with pytest.raises(ValueError, match="gate"):
        GenerationConfig(gate="max")
    with pytest.raises(TypeError, match="integers"):
        GenerationConfig().to_request([1, 2.5])
    with pytest.raises(ValueError, match="2\\*\\*32"):
        GenerationConfig().to_request([-1])
    with pytest.raises(ValueError, match="seed"):
        GenerationConfig(seed=-1)
    with pytest.raises(TypeError, match="bytes"):
        GenerationConfig().to_request(b"hi")
    with pytest.raises(ValueError, match=r"max_new_tokens must lie in \[0, 2\*\*31\); got 5000000000"):
        GenerationConfig(max_new_tokens=5_000_000_000)
    for name in ("max_new_tokens", "top_k", "max_support", "max_draft_tokens"):  # int32 on the wire
        with pytest.raises(ValueError, match=name):
            GenerationConfig(**{name: 2**31})
        GenerationConfig(**{name: 2**31 - 1}).to_request([1])
    with pytest.raises(ValueError, match="top_k"):
        GenerationConfig(top_k=-1)
    with pytest.raises(ValueError, match=r"stop\[1\] = ''"):
        GenerationConfig(stop=["END", ""])


@pytest.mark.parametrize("options, fragment", [
    ({"gate": "pick"}, "gate = pick is an admission rule of probabilistic mode; mode = exact"),
    ({"mode": "probabilistic", "coupled": True}, "coupled drafting belongs to exact mode; mode = probabilistic"),
])
def test_options_that_do_nothing_in_the_mode_are_refused(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        GenerationConfig(**options)


# --- async client ---------------------------------------------------------------------------


async def test_async_generate_by_ids(aio_verifier):
    target, servicer = aio_verifier
    async with AsyncVerifierClient(target, timeout=10) as client:
        result = await client.generate([1, 2, 3, 4], GenerationConfig(max_new_tokens=8, seed=9))
    assert isinstance(result, Generation)
    assert result.token_ids == [4, 3, 2, 1]
    assert result.text is None  # the server sent no text
    assert result.finish_reason == "length"
    assert result.stats == EXPECTED_STATS
    assert result.rounds == [
        {"round_id": 0, "source": "MTP", "proposed": 3, "retained": 2, "accepted": 1, "verify_ms": 1.5, "draft_wait_ms": 0.25,
         "speculative": True, "num_rounds": 1},
        {"round_id": 1, "source": "SUFFIX", "proposed": 3, "retained": 2, "accepted": 1, "verify_ms": 1.5, "draft_wait_ms": 0.25,
         "speculative": True, "num_rounds": 1},
    ]
    assert servicer.requests[-1].sampling.seed == 9


@pytest.mark.parametrize("offered", [None, "/nonexistent-tandem/local.sock"])
async def test_async_client_asks_once_and_stays_on_grpc_without_a_socket_here(aio_verifier, offered):
    """An older verifier (GetServerInfo unimplemented), or one whose path is no socket on this
    host (another host's, behind a forwarded port): asked once, Generate stays on gRPC."""
    target, servicer = aio_verifier
    servicer.offered, servicer.info_calls = offered, 0
    async with AsyncVerifierClient(target, timeout=10) as client:
        for _ in range(2):
            assert (await client.generate([1, 2, 3], GenerationConfig(max_new_tokens=8))).token_ids == [3, 2, 1]
        assert client.local_socket is None
    assert servicer.info_calls == 1
    async with AsyncVerifierClient(target, timeout=10, discover_local=False) as quiet:
        await quiet.generate([1, 2, 3], GenerationConfig(max_new_tokens=8))
    assert servicer.info_calls == 1


async def test_async_generate_by_text(aio_verifier):
    target, _ = aio_verifier
    async with AsyncVerifierClient(target) as client:
        result = await client.generate("abcd", GenerationConfig(max_new_tokens=3))
        held = await client.generate("abcd", GenerationConfig(max_new_tokens=3, request_id="hold"))
    assert result.token_ids == [ord("d"), ord("c"), ord("b")]
    assert result.text == "dcb"
    assert held.text == "dcb"  # an empty delta is skipped, not joined as a break


async def test_async_stream_yields_events_in_order(aio_verifier):
    target, _ = aio_verifier
    async with AsyncVerifierClient(target) as client:
        events = [event async for event in client.stream([1, 2, 3], GenerationConfig())]
    assert [list(event.token_ids) for event in events] == [[3, 2], [1], []]
    assert [event.HasField("round") for event in events] == [True, True, False]
    assert events[-1].HasField("final") and events[-1].final.finish_reason == "length"


async def test_async_stream_can_stop_early(aio_verifier):
    target, _ = aio_verifier
    async with AsyncVerifierClient(target) as client:
        async with contextlib.aclosing(client.stream([1, 2, 3], GenerationConfig())) as events:
            async for event in events:
                assert list(event.token_ids) == [3, 2]
                break
        assert (await client.generate([7], GenerationConfig())).token_ids == [7]  # the channel still works


async def test_async_error_carries_code_and_server_message(aio_verifier):
    target, _ = aio_verifier
    async with AsyncVerifierClient(target) as client:
        with pytest.raises(VerifierError) as caught:
            await client.generate([1], GenerationConfig(max_new_tokens=0))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message == BAD_LENGTH
    assert str(caught.value) == f"INVALID_ARGUMENT: {BAD_LENGTH}"


async def test_async_unreachable_verifier_is_a_verifier_error():
    async with AsyncVerifierClient("127.0.0.1:1", timeout=2) as client:
        with pytest.raises(VerifierError) as caught:
            await client.generate([1], GenerationConfig())
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# --- sync client ----------------------------------------------------------------------------


def test_sync_generate_and_stream(thread_verifier):
    target, _ = thread_verifier
    with VerifierClient(target, timeout=10, channel_options=[("grpc.enable_retries", 0)]) as client:
        result = client.generate("wxyz", GenerationConfig(max_new_tokens=4))
        events = list(client.stream([5, 6], GenerationConfig()))
    assert result.token_ids == [ord(c) for c in "zyxw"] and result.text == "zyxw"
    assert result.finish_reason == "length" and result.stats["completion_tokens"] == 4
    assert [r["source"] for r in result.rounds] == ["MTP", "SUFFIX"]
    assert [list(event.token_ids) for event in events] == [[6], [5], []]


def test_sync_stream_can_stop_early(thread_verifier):
    target, _ = thread_verifier
    with VerifierClient(target, timeout=10) as client:
        events = client.stream([1, 2, 3], GenerationConfig())
        assert list(next(events).token_ids) == [3, 2]
        events.close()  # cancels the call
        assert client.generate([8, 9], GenerationConfig()).token_ids == [9, 8]


def test_sync_error_carries_code_and_server_message(thread_verifier):
    target, _ = thread_verifier
    with VerifierClient(target) as client, pytest.raises(VerifierError) as caught:
        client.generate([1], GenerationConfig(max_new_tokens=0))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message == BAD_LENGTH


def test_channels_allow_large_messages():
    assert MAX_MESSAGE_BYTES == 64 * 1024 * 1024
