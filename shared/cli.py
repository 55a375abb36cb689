"""The `tandem` command line: one entry point with a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata


def _version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Speculative decoding for mixture-of-experts models, served as a drafter and a verifier.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    subcommands.add_parser("protocol", help="print the wire protocol version and the gRPC services")
    return parser


def _print_protocol() -> int:
    from shared.protocol import PROTOCOL_VERSION, service_names

    print(f"tandem protocol v{PROTOCOL_VERSION}")
    for name in service_names():
        print(f"  {name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "protocol":
        return _print_protocol()
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
