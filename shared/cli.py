"""The `tandem` command line: one entry point with a subcommand per job.

Each subcommand is registered by an `_add_<name>(subcommands)` function that builds its
parser and binds a handler with `set_defaults(handler=...)`; a handler takes the parsed
arguments and returns the exit status. Heavy imports (grpc, torch) stay inside handlers so
`tandem --help` and `tandem protocol` start fast.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from importlib import metadata

_FORMATTER = argparse.ArgumentDefaultsHelpFormatter


def _version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Speculative decoding for mixture-of-experts models, served as a drafter and a verifier.",
        formatter_class=_FORMATTER,
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Subcommands, in the order `tandem --help` lists them. Services (verifier, drafter) and
    # the demo register here the same way.
    _add_demo(subcommands)
    _add_service(subcommands, "verifier")
    _add_service(subcommands, "drafter")
    _add_service(subcommands, "gateway")
    _add_generate(subcommands)
    _add_protocol(subcommands)
    return parser


# --- tandem verifier / tandem drafter ---------------------------------------------------

SERVICES = {
    "verifier": "run the verifier service (owns the target model; clients call Generate)",
    "drafter": "run the drafter service (MTP drafting and suffix lookup; the verifier calls Draft)",
    "gateway": "run the OpenAI-compatible HTTP edge in front of verifiers (/v1/completions, /v1/chat/completions)",
}


def _add_service(subcommands, name: str) -> None:
    settings = importlib.import_module(f"{name}_service.settings")
    parser = subcommands.add_parser(
        name,
        help=SERVICES[name],
        description=f"Run the {name} service. Every option also reads an environment variable; flags win.",
    )
    settings.add_arguments(parser)
    parser.set_defaults(handler=functools.partial(_run_service, name))


def _run_service(name: str, args: argparse.Namespace) -> int:
    import asyncio
    import signal

    # Until the service takes SIGINT over (to drain), Ctrl-C ends the start-up at once: imports,
    # loading and binding hold nothing to save, while a KeyboardInterrupt raised inside an import
    # can leave a half-imported module whose next use fails another way (numpy's, say: a
    # RecursionError and its traceback instead of one line).
    signal.signal(signal.SIGINT, functools.partial(_interrupted_while_starting, name))
    settings = importlib.import_module(f"{name}_service.settings")
    server = importlib.import_module(f"{name}_service.server")
    try:
        config = settings.from_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from shared.service import StartupError

    try:
        asyncio.run(server.serve(config))
    except StartupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _interrupted_while_starting(name: str, signum: int, frame: object) -> None:
    print(f"tandem {name}: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


# --- tandem demo ------------------------------------------------------------------------


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (the help text says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def _at_least(low: float, kind: type) -> Callable[[str], float]:
    """An argparse type: a finite `kind` >= low (argparse names the option in its error)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"{text} must be >= {low:g}")
        return value

    return parse


def _add_demo(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="start a drafter and a verifier on localhost with the embedded model and stream a completion",
        formatter_class=_DefaultsShown,
    )
    parser.add_argument("--prompt", default="import os\n\n\ndef read_lines(path):", help="text prompt (\\n for newlines)")
    parser.add_argument("--max-new-tokens", type=_at_least(1, int), default=160, help="tokens to generate")
    # Seeded sampling by default: greedy decoding of the small embedded model soon loops.
    parser.add_argument("--temperature", type=_at_least(0, float), default=0.7, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=1, help="the request's seed (sampling is reproducible)")
    parser.add_argument("--mode", choices=("exact", "probabilistic"), default="exact",
                        help="exact mode drafts coupled to the target's own draws (same tokens as plain decoding)")
    parser.add_argument("--max-draft-tokens", type=_at_least(0, int), default=4, help="drafts per round, at most")
    parser.add_argument("--model", default=None, help="checkpoint directory or name; the embedded model when not given")
    parser.add_argument("--markers", choices=("auto", "color", "brackets", "none"), default="auto",
                        help="how accepted drafts are marked: auto = color on a terminal, none otherwise (plain text)")
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from shared.demo import run_demo

    return run_demo(args)


# --- tandem protocol --------------------------------------------------------------------


def _add_protocol(subcommands) -> None:
    parser = subcommands.add_parser(
        "protocol", help="print the wire protocol version and the gRPC services", formatter_class=_FORMATTER
    )
    parser.set_defaults(handler=_run_protocol)


def _run_protocol(args: argparse.Namespace) -> int:
    from shared.protocol import PROTOCOL_VERSION, service_names

    print(f"tandem protocol v{PROTOCOL_VERSION}")
    for name in service_names():
        print(f"  {name}")
    return 0


# --- tandem generate --------------------------------------------------------------------


def _token_id_list(value: str) -> list[int]:
    """argparse type: "1,2,3" -> [1, 2, 3] (uint32 ids, at least one)."""
    parts = [part.strip() for part in value.split(",")]
    try:
        ids = [int(part) for part in parts]
    except ValueError:
        ids = None
    if not ids or any(not 0 <= token < 2**32 for token in ids):
        raise argparse.ArgumentTypeError(f"invalid token id list {value!r}: expected comma-separated integers in [0, 2**32)")
    return ids


def _add_generate(subcommands) -> None:
    parser = subcommands.add_parser(
        "generate",
        help="send one request to a verifier and print the generation as it streams",
        description=(
            "Send one Generate request to a verifier. Text is streamed to stdout as it is "
            "committed (token ids when the verifier has no tokenizer), then a summary goes to "
            "stderr; --json prints a single JSON object instead."
        ),
        formatter_class=_FORMATTER,
    )
    parser.set_defaults(handler=_run_generate)
    parser.add_argument("--verifier", required=True, metavar="HOST:PORT", help="address of the verifier service")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (the verifier tokenizes it)")
    prompt.add_argument("--prompt-ids", type=_token_id_list, metavar="IDS", help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="most tokens to generate")

    sampling = parser.add_argument_group("sampling (the target distribution)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    sampling.add_argument("--top-p", type=float, default=None, metavar="P", help="in (0, 1]; unset = off")
    sampling.add_argument("--min-p", type=float, default=0.0, metavar="P", help="0 = off")
    sampling.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (uint64)")
    sampling.add_argument("--max-support", type=int, default=0, metavar="N", help="0 = server default")

    speculation = parser.add_argument_group("speculation")
    speculation.add_argument("--mode", choices=("exact", "probabilistic"), default="exact", help="verification mode")
    speculation.add_argument("--gate", choices=("top", "pick"), default="top", help="admission statistic (probabilistic mode)")
    speculation.add_argument("--max-draft-tokens", type=int, default=0, metavar="N", help="0 = server default")
    speculation.add_argument(
        "--retention-schedule", default=None, metavar="THRESHOLDS", help='e.g. "0.10,0.35,0.55"; unset = min-p per step'
    )
    speculation.add_argument("--retention-min-cum", type=float, default=0.0, metavar="C", help="cumulative floor; 0 = off")
    speculation.add_argument(
        "--no-speculation", action="store_true", help="decode without drafts (the plain-decoding baseline)"
    )
    speculation.add_argument("--coupled", action="store_true", help="exact mode: drafter draws with the target's u_pick")

    stopping = parser.add_argument_group("stopping")
    stopping.add_argument("--stop", action="append", default=None, metavar="STR", help="stop sequence (repeatable)")
    stopping.add_argument("--eos-ids", type=_token_id_list, default=None, metavar="IDS", help="end-of-sequence token ids, comma-separated")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    output.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="with --json: each token's log-probability under the target and N alternatives (0-20)")
    output.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                        help="raw: the model's distribution; processed: the law the token is drawn from")
    output.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline of the whole request in seconds; unset = none")
    output.add_argument("--request-id", default=None, metavar="ID", help="caller-chosen id, echoed in the verifier's logs and traces")

    security = parser.add_argument_group("security")
    security.add_argument("--tls-ca", default=None, metavar="PEM", help="CA bundle to verify the verifier's certificate (TLS)")
    security.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (mutual TLS)")
    security.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    security.add_argument("--token", default=None, metavar="TOKEN",
                          help="bearer token for Generate; unset = env TANDEM_TOKEN if set")


def _generation_config(args: argparse.Namespace):
    from shared.client import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_support=args.max_support,
        mode=args.mode,
        gate=args.gate,
        max_draft_tokens=args.max_draft_tokens,
        retention_schedule=args.retention_schedule,
        retention_min_cum=args.retention_min_cum,
        speculation=not args.no_speculation,
        coupled=args.coupled,
        eos_token_ids=tuple(args.eos_ids or ()),
        stop=tuple(args.stop or ()),
        request_id=args.request_id or "",
        logprobs=args.logprobs,
        logprobs_mode=args.logprobs_mode,
    )


def _summary(generation) -> str:
    stats = generation.stats
    parts = [
        f"{len(generation.token_ids)} tokens",
        f"finish: {generation.finish_reason or 'none'}",
        f"{stats['tokens_per_s']:.1f} tokens/s",
        f"{stats['rounds']} rounds",
        f"mean accepted length {stats['mean_accepted_length']:.2f} (bonus included)",
    ]
    by_source = stats["acceptance_by_source"]
    if by_source:
        parts.append("acceptance " + ", ".join(f"{name} {rate:.2f}" for name, rate in by_source.items()))
    else:
        parts.append("acceptance -")
    if stats["drafter_faults"]:
        parts.append(f"{stats['drafter_faults']} drafter faults")
    return "; ".join(parts)


def _run_generate(args: argparse.Namespace) -> int:
    from shared.client import GenerationAccumulator, VerifierClient, VerifierError

    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    try:
        if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
            raise ValueError(f"--timeout {args.timeout} must be a positive number of seconds")
        config = _generation_config(args)
        config.to_request(prompt)  # out-of-range values fail here, before any connection
        if args.logprobs is not None and not args.json:
            raise ValueError("--logprobs is printed with --json")
    except (TypeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    accumulator = GenerationAccumulator()
    out = sys.stdout
    wrote = False  # anything streamed to stdout (owes a closing newline)
    try:
        from shared.security import channel_credentials

        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key, prefix="--tls-")
        token = args.token or os.environ.get("TANDEM_TOKEN") or None
        with VerifierClient(args.verifier, timeout=args.timeout, credentials=credentials, token=token) as client:
            events = client.stream(prompt, config)
            try:
                for event in events:
                    accumulator.add(event)
                    if args.json:
                        continue
                    if event.HasField("text_delta"):  # a verifier with a tokenizer: text only
                        if not event.text_delta:
                            continue  # text held back (an incomplete character)
                        out.write(event.text_delta)
                    elif event.token_ids:
                        out.write(("" if not wrote else " ") + " ".join(map(str, event.token_ids)))
                    else:
                        continue
                    wrote = True
                    out.flush()
            finally:
                events.close()
    except VerifierError as error:
        if wrote:
            out.write("\n")
            out.flush()
        print(f"error: {error.code.name}: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if wrote:
            out.write("\n")
            out.flush()
        print("error: interrupted", file=sys.stderr)
        return 130

    generation = accumulator.result()
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": generation.token_ids,
                    "text": generation.text,
                    "finish_reason": generation.finish_reason,
                    "stats": generation.stats,
                    **({} if generation.logprobs is None else {"logprobs": [
                        {"token_id": x.token_id, "logprob": x.logprob, "rank": x.rank, "top": [list(t) for t in x.top]}
                        for x in generation.logprobs]}),
                }
            )
        )
    else:
        out.write("\n")
        out.flush()
        print(_summary(generation), file=sys.stderr)
    return 0


# --- entry point ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs routine connection events (a peer's GOAWAY) at INFO: errors only,
    # unless the operator asks (before any handler imports grpc).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    name = "tandem"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return 2
        name = f"tandem {args.command}"
        return handler(args)
    except Exception as error:
        if not _interrupted(error):
            raise
    except KeyboardInterrupt:  # Ctrl-C while the command line is read, or in a command that does not catch it
        pass
    print(f"{name}: interrupted", file=sys.stderr)
    return 130


def _interrupted(error: BaseException) -> bool:
    """Whether a Ctrl-C lies under `error`: one that lands inside a class body being built
    (torch's imports are full of them) reaches us wrapped, as the cause of a RuntimeError."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


if __name__ == "__main__":
    sys.exit(main())
