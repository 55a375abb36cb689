"""`tandem demo` (the README's main job) as a user runs it: two service processes, one
streamed completion, a summary; plain text when stdout is not a terminal."""

import subprocess
import sys

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
