"""`tandem demo`: a drafter and a verifier as separate processes on localhost, one streamed
completion with each round's accepted drafts marked, then both stopped."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from shared.client import GenerationConfig, VerifierClient, VerifierError
from shared.health import wait_serving
from shared.model.registry import resolve_model
from shared.tokenizer import load_tokenizer

COLORS = {"MTP": "\033[32m", "SUFFIX": "\033[36m"}
RESET = "\033[0m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(kind: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shared.cli", kind, *args], env=dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_demo(args: argparse.Namespace) -> int:
    """Exit status: 0; 2 for a model that cannot be found; 1 for a request the verifier refused;
    130 on Ctrl-C, 143 on SIGTERM (the two services stopped in every case)."""
    try:
        model_dir = resolve_model(args.model)
    except FileNotFoundError as error:
        print(f"error: model = {args.model}: {error}", file=sys.stderr)
        return 2
    # SIGTERM ends the demo as Ctrl-C does: through the `finally` below that stops both services.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _run(args, model_dir)
    except RuntimeError as error:  # a service that did not start (wait_serving says which, and its last lines)
        print(f"error: {error}", file=sys.stderr)
        return 1
    except VerifierError as error:  # a request the verifier refused (e.g. beyond its limits)
        print(f"\nerror: the verifier refused the request: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except _Terminated:
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is (a BaseException as KeyboardInterrupt is: the
    gRPC client's waits let those through, where an Exception could be taken for the call's)."""


def _terminated(signum, frame) -> None:
    raise _Terminated()


def _run(args: argparse.Namespace, model_dir) -> int:
    tokenizer = load_tokenizer(model_dir)
    prompt = args.prompt.encode().decode("unicode_escape")
    drafter_port, verifier_port = _free_port(), _free_port()
    model_args = ["--model", str(model_dir)]
    # Both on this host: their Draft streams take the drafter's Unix socket, not gRPC.
    socket_dir = tempfile.mkdtemp(prefix="tandem-demo-")
    link = f"{socket_dir}/drafter.sock"
    print(f"starting drafter on :{drafter_port} and verifier on :{verifier_port} ({model_dir.name}) ...", file=sys.stderr)
    drafter = _start("drafter", [*model_args, "--port", str(drafter_port), "--local-socket", link])
    verifier = _start("verifier", [*model_args, "--port", str(verifier_port), "--drafter", f"127.0.0.1:{drafter_port}",
                                   "--drafter-socket", link])
    markers = args.markers if args.markers != "auto" else ("color" if sys.stdout.isatty() else "none")
    try:
        wait_serving(f"127.0.0.1:{drafter_port}", name="drafter", process=drafter)
        wait_serving(f"127.0.0.1:{verifier_port}", name="verifier", process=verifier)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                  mode=args.mode, max_draft_tokens=args.max_draft_tokens,
                                  coupled=args.mode == "exact" and args.temperature > 0)
        legend = {"color": "accepted drafts: green = MTP, cyan = suffix lookup",
                  "brackets": "accepted drafts in [MTP: ...] / [SUFFIX: ...]", "none": "plain text (--markers to mark drafts)"}
        print(f"--- {legend[markers]} ---", file=sys.stderr)
        sys.stdout.write(prompt)
        completion: list[int] = []
        shown = ""
        final = None
        with VerifierClient(f"127.0.0.1:{verifier_port}") as client:
            for event in client.stream(prompt, config):
                if event.HasField("final"):
                    final = event.final
                    continue
                tokens = list(event.token_ids)
                accepted = min(event.round.accepted, len(tokens)) if event.HasField("round") else 0
                source = {2: "MTP", 3: "SUFFIX"}.get(event.round.source, "")
                for part, is_draft in ((tokens[:accepted], True), (tokens[accepted:], False)):
                    if not part:
                        continue
                    completion += part
                    text = tokenizer.decode(completion)
                    piece, shown = text[len(shown):], text
                    if is_draft and markers == "color":
                        piece = f"{COLORS.get(source, '')}{piece}{RESET}"
                    elif is_draft and markers == "brackets":
                        piece = f"[{source}: {piece}]"
                    sys.stdout.write(piece)
                sys.stdout.flush()
        print()
        if final is not None:
            st = final.stats
            by_source = ", ".join(f"{k} {v:.0%}" for k, v in sorted(st.acceptance_by_source.items())) or "none"
            # Say how many rounds asked the drafter: the verifier's governor decodes plainly where
            # drafting does not pay on this machine, which a bare tokens/round figure leaves unexplained.
            governed = f"drafted in {st.speculative_rounds} of {st.rounds} rounds"
            if st.drafter_detaches:
                governed += f" (the governor stopped drafting {st.drafter_detaches}x: it did not pay here)"
            print(f"--- {st.completion_tokens} tokens in {st.rounds} rounds: {st.mean_accepted_length:.2f} tokens/round "
                  f"(bonus included), acceptance by source: {by_source}, {governed}, {st.tokens_per_s:.1f} tokens/s, "
                  f"finish: {final.finish_reason} ---", file=sys.stderr)
        return 0
    finally:
        for process in (verifier, drafter):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (verifier, drafter):
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
