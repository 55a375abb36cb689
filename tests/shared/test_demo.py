"""`tandem demo` (the README's main job) as a user runs it: two service processes, one
streamed completion, a summary; plain text when stdout is not a terminal."""

import re
import signal
import socket
import subprocess
import sys

import pytest

PROMPT = "import os\n\n\ndef read_lines(path):"


def run_demo(*extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "shared.cli", "demo", "--max-new-tokens", "32", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_demo_streams_plain_text_into_a_pipe_and_marks_drafts_on_request():
    plain = run_demo()
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith(PROMPT) and len(plain.stdout) > len(PROMPT) + 20
    assert "[MTP" not in plain.stdout and "[SUFFIX" not in plain.stdout and "\033[" not in plain.stdout
    summary = plain.stderr.strip().splitlines()[-1]
    assert summary.startswith("--- 32 tokens in ") and "finish: length" in summary, plain.stderr
    assert " rounds" in summary.split("drafted in ", 1)[1]  # how many rounds asked the drafter
    assert "Traceback" not in plain.stderr
    marked = run_demo("--markers", "brackets")
    assert marked.returncode == 0, marked.stderr
    assert "[MTP: " in marked.stdout or "[SUFFIX: " in marked.stdout


def test_bad_options_stop_the_demo_before_anything_starts_and_a_refusal_is_one_line():
    for option, value, says in (("--max-new-tokens", "0", "must be >= 1"), ("--temperature", "-1", "must be >= 0"),
                                ("--model", "/nonexistent/model", "model = /nonexistent/model")):
        result = subprocess.run([sys.executable, "-m", "shared.cli", "demo", option, value], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "starting drafter" not in result.stderr
    refused = run_demo("--max-new-tokens", "100000")  # (beyond the verifier's limit: known once it runs)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "error: the verifier refused the request: max_new_tokens" in refused.stderr


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_demo_stops_its_services(signum, status):
    """SIGTERM (or Ctrl-C) while the completion streams: both services stop with the demo, no
    traceback (they were left running, still listening, on SIGTERM)."""
    # (SIGINT as a terminal delivers it: a suite run in the background, as `cmd &` in a script,
    # would hand the child SIGINT ignored)
    demo = subprocess.Popen([sys.executable, "-m", "shared.cli", "demo", "--max-new-tokens", "2000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = demo.stderr.readline()  # "starting drafter on :P and verifier on :Q (...) ..."
        ports = [int(p) for p in re.findall(r":(\d+)", first)]
        assert len(ports) == 2, first
        demo.stderr.readline()  # the legend: both services serve, the completion streams
        demo.stdout.read(64)
        demo.send_signal(signum)
        _, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == status and "Traceback" not in err, err
    for port in ports:  # (the demo waits for both to exit before it does)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_service_that_cannot_start_is_one_error_naming_it_and_why(tmp_path):
    """A checkpoint the services cannot load (here: a model type tandem does not serve): the demo
    says which service stopped and its last words, no traceback, status 1."""
    import json
    import shutil

    from shared.model.registry import resolve_model

    model = shutil.copytree(resolve_model(None), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    result = subprocess.run([sys.executable, "-m", "shared.cli", "demo", "--model", str(model)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: the drafter exited with status 2" in result.stderr and "llama" in result.stderr, result.stderr
