"""Malformed-message floods against both services (issue 12's bar): each class is refused, and
the services' memory stays flat.

Starts `tandem drafter` and `tandem verifier --drafter ...` (embedded model, CPU) as child
processes, floods them with every malformed class at once from concurrent clients for a
warm-up and then for --seconds, and reports per class the status codes received, and per
service the resident memory (VmRSS) after the warm-up and at the end.

Usage: python bench/flood.py [--seconds 60] [--warmup 10] [--clients-per-class 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import free_port, log  # noqa: E402  (puts the repo and protocol modules on sys.path)
from pairbench.services import Children  # noqa: E402

from shared.protocol import PROTOCOL_VERSION, drafter_pb2, drafter_pb2_grpc, encode_hidden, verifier_pb2  # noqa: E402

HIDDEN = 256  # the embedded model's hidden size
VOCAB = 4096


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def generate_request(**fields) -> bytes:
    request = verifier_pb2.GenerateRequest(protocol_version=PROTOCOL_VERSION, max_new_tokens=4, **fields)
    return request.SerializeToString()


def verifier_classes() -> dict[str, bytes]:
    ids = verifier_pb2.TokenIds
    long_schedule = verifier_pb2.GenerateRequest(protocol_version=PROTOCOL_VERSION, max_new_tokens=4,
                                                 prompt_ids=ids(ids=[1, 2, 3]))
    long_schedule.speculation.retention.schedule = "0.1," * 1000 + "x"
    return {
        "verifier: malformed bytes": b"\xff\xff\xff\xff garbage" * 100,
        "verifier: 2M prompt ids": generate_request(prompt_ids=ids(ids=[1] * 2_000_000)),
        "verifier: 100k-char request_id": generate_request(prompt_ids=ids(ids=[1, 2, 3]), request_id="r" * 100_000),
        "verifier: 4k-char schedule": long_schedule.SerializeToString(),
        "verifier: 10 MB prompt_text": generate_request(prompt_text="x" * 10_000_000),
        "verifier: out-of-vocabulary id": generate_request(prompt_ids=ids(ids=[1, 10**6])),
    }


def draft_open(tokens, *, session_id="s", rows=None, size=HIDDEN):
    rows = len(tokens) - 1 if rows is None else rows
    return drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, open=drafter_pb2.DraftOpen(
        session_id=session_id, token_ids=tokens, hidden=encode_hidden(torch.zeros(rows, size)), max_draft_tokens=2,
        max_new_tokens=8))


def draft_commit(**fields):
    emitted = fields.pop("emitted", [5])
    return drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, commit=drafter_pb2.DraftCommit(
        emitted_token_ids=emitted, hidden=encode_hidden(torch.zeros(len(emitted), HIDDEN)), **fields))


def drafter_classes() -> dict[str, list[drafter_pb2.DraftUp]]:
    good = draft_open([1, 2, 3])
    return {
        "drafter: out-of-vocabulary open": [draft_open([1, 2, VOCAB + 5])],
        "drafter: 4M-token open": [draft_open([1] * 4_000_000, rows=1)],
        "drafter: wrong hidden size": [draft_open([1, 2, 3], size=7)],
        "drafter: 1 MB session id": [draft_open([1, 2, 3], session_id="x" * 1_000_000)],
        "drafter: accepted 1,000,000": [good, draft_commit(round_id=0, num_accepted=1_000_000, num_verified=1_000_000,
                                                           emitted=[5] * 9)],
        "drafter: wrong round": [good, draft_commit(round_id=7)],
    }


async def flood_verifier(address, payload, codes, stop_at):
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_stream("/tandem.v1.Verifier/Generate")
        while time.monotonic() < stop_at:
            try:
                async for _ in call(payload, timeout=30):
                    pass
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1


async def flood_drafter(address, messages, codes, stop_at):
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        while time.monotonic() < stop_at:
            call = stub.Draft(timeout=30)
            try:
                for message in messages:
                    await call.write(message)
                    await call.read()
                await call.done_writing()
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
            finally:
                call.cancel()


async def flood(v_address, d_address, seconds, clients, results, only=""):
    stop_at = time.monotonic() + seconds
    tasks = []
    for name, payload in verifier_classes().items():
        for _ in range(clients if only in name else 0):
            tasks.append(flood_verifier(v_address, payload, results[name], stop_at))
    for name, messages in drafter_classes().items():
        for _ in range(clients if only in name else 0):
            tasks.append(flood_drafter(d_address, messages, results[name], stop_at))
    await asyncio.gather(*tasks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--clients-per-class", type=int, default=2)
    parser.add_argument("--only", default="", help="flood only the classes whose name contains this")
    args = parser.parse_args()
    children = Children(Path(tempfile.mkdtemp(prefix="flood-")), threads=1)
    d_port, v_port = free_port(), free_port()
    d_address, v_address = f"127.0.0.1:{d_port}", f"127.0.0.1:{v_port}"
    drafter = children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", "--port", str(d_port)])
    verifier = children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", "--port", str(v_port),
                                           "--drafter", d_address])
    try:
        asyncio.run(children.wait_serving("drafter", d_address, 120))
        asyncio.run(children.wait_serving("verifier", v_address, 120))
        warm = collections.defaultdict(collections.Counter)
        log(f"warm-up flood, {args.warmup:.0f} s ...")
        asyncio.run(flood(v_address, d_address, args.warmup, args.clients_per_class, warm, args.only))
        time.sleep(1.0)
        before = {"verifier": rss_mib(verifier.pid), "drafter": rss_mib(drafter.pid)}
        results = collections.defaultdict(collections.Counter)
        log(f"flood, {args.seconds:.0f} s ...")
        samples = []  # (seconds into the flood, verifier MiB, drafter MiB): growth or a plateau?

        async def sample(every: float = 10.0):
            started = time.monotonic()
            while True:
                await asyncio.sleep(every)
                samples.append((time.monotonic() - started, rss_mib(verifier.pid), rss_mib(drafter.pid)))
                log(f"  {samples[-1][0]:.0f} s: verifier {samples[-1][1]:.0f} MiB, drafter {samples[-1][2]:.0f} MiB")

        async def flood_and_sample():
            sampler = asyncio.create_task(sample())
            await flood(v_address, d_address, args.seconds, args.clients_per_class, results, args.only)
            sampler.cancel()

        asyncio.run(flood_and_sample())
        time.sleep(1.0)
        after = {"verifier": rss_mib(verifier.pid), "drafter": rss_mib(drafter.pid)}
        children.check_alive()
    finally:
        children.stop()
    print(f"\n| message class ({args.clients_per_class} clients each, {args.seconds:.0f} s) | answers |")
    print("| --- | --- |")
    for name, codes in sorted(results.items()):
        print(f"| {name} | {', '.join(f'{code} x{count}' for code, count in codes.most_common())} |")
    print("\n| service | RSS after warm-up (MiB) | RSS after the flood (MiB) | change |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("verifier", "drafter"):
        print(f"| {name} | {before[name]:.0f} | {after[name]:.0f} | {after[name] / before[name] - 1:+.1%} |")
    print("\n| seconds into the flood | verifier RSS (MiB) | drafter RSS (MiB) |")
    print("| ---: | ---: | ---: |")
    for seconds, v_mib, d_mib in samples:
        print(f"| {seconds:.0f} | {v_mib:.0f} | {d_mib:.0f} |")


if __name__ == "__main__":
    main()
