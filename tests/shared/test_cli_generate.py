"""`tandem generate` against a real in-process grpc.aio server running a fake verifier."""

from __future__ import annotations

import json

import pytest

from shared import cli
from shared.protocol import common_pb2, verifier_pb2
from tests.shared.fake_verifier import BAD_LENGTH, EXPECTED_STATS


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


def test_cli_json_logprobs(thread_verifier, capsys):
    target, servicer = thread_verifier
    argv = ["generate", "--verifier", target, "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json",
            "--logprobs", "1", "--logprobs-mode", "processed"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["logprobs"] == [{"token_id": t, "logprob": pytest.approx(-t / 100), "rank": 2, "top": [[t + 1, pytest.approx(-0.01)]]}
                               for t in (7, 6, 5)]
    request = servicer.requests[-1]
    assert request.logprobs.num_top == 1 and request.logprobs.mode == verifier_pb2.LOGPROB_MODE_PROCESSED


@pytest.mark.parametrize("extra", [["--logprobs", "21", "--json"], ["--logprobs", "2"]])
def test_cli_refuses_bad_logprobs(thread_verifier, capsys, extra):
    target, servicer = thread_verifier
    sent = len(servicer.requests)
    assert cli.main(["generate", "--verifier", target, "--prompt-ids", "5", "--max-new-tokens", "3", *extra]) == 2
    assert "logprobs" in capsys.readouterr().err and len(servicer.requests) == sent


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
    (["--max-new-tokens", "5000000000"], "max_new_tokens must lie in [0, 2**31); got 5000000000"),
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
