"""The Generate client (async and sync) and `tandem generate`, against a real in-process
grpc.aio server running a fake verifier."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import grpc
import pytest

from shared import cli
from shared.client import (
    MAX_MESSAGE_BYTES,
    AsyncVerifierClient,
    Generation,
    GenerationConfig,
    VerifierClient,
    VerifierError,
)
from shared.protocol import (
    PROTOCOL_VERSION,
    common_pb2,
    verifier_pb2,
    verifier_pb2_grpc,
)

BAD_LENGTH = "max_new_tokens must be > 0; got 0"


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Echoes the prompt reversed (text prompts as code points, with text deltas) in two
    rounds, MTP then SUFFIX, then a final event. request_id "hold" holds the first round's
    text back (an empty delta) and sends it with the second."""

    def __init__(self) -> None:
        self.requests: list[verifier_pb2.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.max_new_tokens <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_new_tokens must be > 0; got {request.max_new_tokens}")
        with_text = request.WhichOneof("prompt") == "prompt_text"
        prompt = [ord(c) for c in request.prompt_text] if with_text else list(request.prompt_ids.ids)
        out = prompt[::-1][: request.max_new_tokens]
        half = (len(out) + 1) // 2
        chunks = [out[:half], out[half:]]
        held = ""
        for round_id, (chunk, source) in enumerate(zip(chunks, (common_pb2.DRAFT_SOURCE_MTP, common_pb2.DRAFT_SOURCE_SUFFIX))):
            text = "".join(map(chr, chunk)) if with_text else ""
            if request.request_id == "hold" and round_id == 0:
                held, text = text, ""
            else:
                text, held = held + text, ""
            yield verifier_pb2.GenerateEvent(
                token_ids=chunk,
                text_delta=text if with_text else None,  # set only where there is text (a tokenizer)
                round=verifier_pb2.RoundInfo(
                    round_id=round_id,
                    source=source,
                    proposed=3,
                    retained=2,
                    accepted=max(len(chunk) - 1, 0),
                    verify_ms=1.5,
                    draft_wait_ms=0.25,
                    speculative=True,
                ),
            )
        yield verifier_pb2.GenerateEvent(
            final=verifier_pb2.FinalEvent(
                finish_reason="length",
                stats=verifier_pb2.RequestStats(
                    prompt_tokens=len(prompt),
                    completion_tokens=len(out),
                    rounds=2,
                    proposed=6,
                    retained=4,
                    accepted=max(len(out) - 2, 0),
                    mean_accepted_length=len(out) / 2,
                    ttft_ms=2.5,
                    queue_ms=1.5,
                    tokens_per_s=100.0,
                    acceptance_by_source={"MTP": 0.5, "SUFFIX": 0.25},
                    drafter_faults=1,
                    speculative_rounds=1,
                    drafter_detaches=1,
                    ahead_hits=1,
                ),
            )
        )


async def _start(servicer: FakeVerifier) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture
async def aio_verifier():
    """A fake verifier in the test's own event loop (for the async client)."""
    servicer = FakeVerifier()
    server, port = await _start(servicer)
    yield f"127.0.0.1:{port}", servicer
    await server.stop(None)


@pytest.fixture(scope="module")
def thread_verifier():
    """A fake verifier on its own event loop in a background thread (for the blocking client
    and the CLI, which would otherwise block the loop serving them)."""
    servicer = FakeVerifier()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(_start(servicer), loop).result(timeout=10)
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


EXPECTED_STATS = {
    "rounds": 2,
    "proposed": 6,
    "retained": 4,
    "accepted": 2,
    "mean_accepted_length": 2.0,
    "ttft_ms": 2.5,
    "queue_ms": 1.5,
    "tokens_per_s": 100.0,
    "acceptance_by_source": {"MTP": 0.5, "SUFFIX": 0.25},
    "drafter_faults": 1,
    "prompt_tokens": 4,
    "completion_tokens": 4,
    "speculative_rounds": 1,
    "drafter_detaches": 1,
    "ahead_hits": 1,
    "ahead_misses": 0,
}


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
    with pytest.raises(ValueError, match=r"max_new_tokens must lie in \[0, 2\*\*32\); got 5000000000"):
        GenerationConfig(max_new_tokens=5_000_000_000)
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
         "speculative": True},
        {"round_id": 1, "source": "SUFFIX", "proposed": 3, "retained": 2, "accepted": 1, "verify_ms": 1.5, "draft_wait_ms": 0.25,
         "speculative": True},
    ]
    assert servicer.requests[-1].sampling.seed == 9


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


# --- tandem generate ------------------------------------------------------------------------


def test_cli_json(thread_verifier, capsys):
    target, servicer = thread_verifier
    argv = ["generate", "--verifier", target, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "8", "--json"]
    argv += ["--temperature", "0.5", "--top-p", "0.9", "--seed", "11", "--mode", "probabilistic", "--gate", "pick"]
    argv += ["--no-speculation", "--stop", "A", "--stop", "B", "--eos-ids", "0,2", "--retention-schedule", "0.1,0.2"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "token_ids": [4, 3, 2, 1],
        "text": None,
        "finish_reason": "length",
        "stats": EXPECTED_STATS,
    }
    assert captured.out.count("\n") == 1  # exactly one JSON object
    request = servicer.requests[-1]
    assert request.sampling.temperature == 0.5 and request.sampling.seed == 11
    assert request.sampling.HasField("top_p") and request.sampling.top_p == pytest.approx(0.9)
    assert request.speculation.mode == common_pb2.MODE_PROBABILISTIC and request.speculation.gate == common_pb2.GATE_PICK
    assert request.speculation.disable and not request.speculation.coupled
    assert request.speculation.retention.schedule == "0.1,0.2"
    assert list(request.stop.stop_sequences) == ["A", "B"] and list(request.stop.eos_token_ids) == [0, 2]


def test_cli_json_text(thread_verifier, capsys):
    target, servicer = thread_verifier
    assert cli.main(["generate", "--verifier", target, "--prompt", "abc", "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "cba" and out["token_ids"] == [99, 98, 97]
    assert not servicer.requests[-1].sampling.HasField("top_p")  # unset stays unset


def test_cli_streams_text(thread_verifier, capsys):
    target, _ = thread_verifier
    assert cli.main(["generate", "--verifier", target, "--prompt", "hello", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "olle\n"
    assert "4 tokens" in captured.err and "length" in captured.err and "100.0 tokens/s" in captured.err
    assert "2.00" in captured.err and "MTP 0.50" in captured.err and "SUFFIX 0.25" in captured.err


def test_cli_streams_held_back_text_without_ids(thread_verifier, capsys):
    target, _ = thread_verifier
    argv = ["generate", "--verifier", target, "--prompt", "hello", "--max-new-tokens", "4", "--request-id", "hold"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "olle\n"


def test_cli_streams_ids_when_there_is_no_text(thread_verifier, capsys):
    target, _ = thread_verifier
    assert cli.main(["generate", "--verifier", target, "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "3 2 1\n"
    assert "3 tokens" in captured.err


def test_cli_server_error_exits_1(thread_verifier, capsys):
    target, _ = thread_verifier
    code = cli.main(["generate", "--verifier", target, "--prompt-ids", "1", "--max-new-tokens", "0", "--json"])
    assert code == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == f"error: INVALID_ARGUMENT: {BAD_LENGTH}"
    assert captured.out == ""


@pytest.mark.parametrize("value", ["1,x,3", "", "1,,2", "4294967296"])
def test_cli_bad_prompt_ids_exit_2(value, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "--verifier", "127.0.0.1:1", f"--prompt-ids={value}", "--max-new-tokens", "4"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "--prompt-ids" in err and repr(value) in err


@pytest.mark.parametrize("extra, fragment", [
    (["--seed", "-1"], "seed"),
    (["--max-new-tokens", "5000000000"], "max_new_tokens must lie in [0, 2**32); got 5000000000"),
    (["--timeout", "-1"], "--timeout -1.0 must be a positive number of seconds"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--stop", ""], "stop[0] = ''"),
    (["--gate", "pick"], "mode = exact"),
    (["--mode", "probabilistic", "--coupled"], "mode = probabilistic"),
])
def test_cli_bad_values_exit_2_before_connecting(capsys, extra, fragment):
    argv = ["generate", "--verifier", "127.0.0.1:1", "--prompt", "a", "--max-new-tokens", "4", *extra]
    assert cli.main(argv) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and fragment in errors[0], errors


def test_cli_prompt_is_required_and_exclusive(capsys):
    base = ["generate", "--verifier", "127.0.0.1:1", "--max-new-tokens", "4"]
    for extra in ([], ["--prompt", "a", "--prompt-ids", "1"]):
        with pytest.raises(SystemExit) as caught:
            cli.main(base + extra)
        assert caught.value.code == 2
    capsys.readouterr()


def test_cli_generate_help_lists_defaults(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for option in [
        "--verifier", "--prompt", "--prompt-ids", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
        "--min-p", "--seed", "--max-support", "--mode", "--gate", "--max-draft-tokens", "--retention-schedule",
        "--retention-min-cum", "--no-speculation", "--coupled", "--stop", "--eos-ids", "--json", "--timeout",
    ]:  # fmt: skip
        assert option in out
    assert "(default: exact)" in out and "(default: 0.0)" in out


def test_cli_without_a_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    assert "generate" in capsys.readouterr().err
