"""The floor under a speculative round's drafter round trip: one message to another process on
this host and its answer back, by each transport the link could use (issue 35).

A speculative round waits for the drafter twice over the link: the commit goes out, the next chain
comes back. Whatever the drafter computes, a round cannot cost less than the verify step plus this
round trip. Measured here with a bare echo in a second process (no model, no protobuf), each way
an asyncio program as both services are:
- `grpc-tcp`: a gRPC bidirectional stream over loopback TCP (the link today);
- `grpc-unix`: the same over a Unix-domain socket (`unix:` addresses, which gRPC already takes);
- `unix-stream`: length-prefixed frames on an asyncio Unix-domain stream (no HTTP/2, no gRPC);
- `shm-eventfd`: a shared-memory mailbox each way and an eventfd each way, watched by the event
  loop (`add_reader`);
- `shm-eventfd-thread`: the same mailboxes with a blocking thread on each side (no event loop) —
  what a model thread that talked to the drafter directly would pay.

Blocks alternate the transports (order reversed each block); each block sends --messages
messages of --bytes bytes one at a time; a transport's figure is the median of its blocks'
medians (p90 likewise). The first --warmup messages of a block are not counted.

Usage:
  python bench/link_floor.py [--blocks 3] [--messages 2000] [--bytes 256,16384] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

MAILBOX = 1 << 20  # bytes each way (a frame's length, then its bytes)
SERVICE, METHOD = "tandem.bench.Echo", "Echo"


# --- gRPC: a generic bidirectional echo, raw bytes --------------------------------------------------

def grpc_server(address: str, ready) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAILBOX),
                                          ("grpc.max_send_message_length", MAILBOX)])

        async def echo(messages, context):
            async for message in messages:
                yield message

        handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(address)
        await server.start()
        ready.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def grpc_client(address: str, payload: bytes, count: int) -> list[int]:
    options = [("grpc.max_receive_message_length", MAILBOX), ("grpc.max_send_message_length", MAILBOX)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = channel.stream_stream(f"/{SERVICE}/{METHOD}")()
        times = []
        for _ in range(count):
            start = time.perf_counter_ns()
            await call.write(payload)
            await call.read()
            times.append(time.perf_counter_ns() - start)
        await call.done_writing()
    return times


# --- an asyncio Unix-domain stream, length-prefixed frames ------------------------------------------

def stream_server(path: str, ready) -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # (the client left)
                while True:
                    head = await reader.readexactly(4)
                    writer.write(head + await reader.readexactly(int.from_bytes(head, "little")))

        server = await asyncio.start_unix_server(handle, path)
        ready.put(path)
        await server.serve_forever()

    asyncio.run(main())


async def stream_client(path: str, payload: bytes, count: int) -> list[int]:
    reader, writer = await asyncio.open_unix_connection(path, limit=2 * MAILBOX)
    frame = len(payload).to_bytes(4, "little") + payload
    times = []
    for _ in range(count):
        start = time.perf_counter_ns()
        writer.write(frame)
        head = await reader.readexactly(4)
        await reader.readexactly(int.from_bytes(head, "little"))
        times.append(time.perf_counter_ns() - start)
    writer.close()
    return times


# --- shared-memory mailboxes, an eventfd each way ---------------------------------------------------

class Mailboxes:
    """Two mailboxes in one shared file: `put` writes a frame into one, `take` reads the other's."""

    def __init__(self, path: str, side: int) -> None:
        fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(fd, 2 * MAILBOX)
        os.close(fd)
        self.out_at, self.in_at = (0, MAILBOX) if side == 0 else (MAILBOX, 0)

    def put(self, payload: bytes) -> None:
        self.map[self.out_at:self.out_at + 4] = len(payload).to_bytes(4, "little")
        self.map[self.out_at + 4:self.out_at + 4 + len(payload)] = payload

    def take(self) -> bytes:
        size = int.from_bytes(self.map[self.in_at:self.in_at + 4], "little")
        return self.map[self.in_at + 4:self.in_at + 4 + size]


def shm_server(path: str, wake_in: int, wake_out: int, count: int, threaded: bool) -> None:
    boxes = Mailboxes(path, 1)
    if threaded:
        for _ in range(count):
            os.eventfd_read(wake_in)
            boxes.put(boxes.take())
            os.eventfd_write(wake_out, 1)
        return

    async def main() -> None:
        woken = asyncio.Event()
        asyncio.get_running_loop().add_reader(wake_in, lambda: (os.eventfd_read(wake_in), woken.set()))
        for _ in range(count):
            await woken.wait()
            woken.clear()
            boxes.put(boxes.take())
            os.eventfd_write(wake_out, 1)

    asyncio.run(main())


async def shm_client(boxes: Mailboxes, wake_out: int, wake_in: int, payload: bytes, count: int) -> list[int]:
    woken = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(wake_in, lambda: (os.eventfd_read(wake_in), woken.set()))
    times = []
    try:
        for _ in range(count):
            start = time.perf_counter_ns()
            boxes.put(payload)
            os.eventfd_write(wake_out, 1)
            await woken.wait()
            woken.clear()
            boxes.take()
            times.append(time.perf_counter_ns() - start)
    finally:
        loop.remove_reader(wake_in)
    return times


def shm_thread_client(boxes: Mailboxes, wake_out: int, wake_in: int, payload: bytes, count: int) -> list[int]:
    times = []
    for _ in range(count):
        start = time.perf_counter_ns()
        boxes.put(payload)
        os.eventfd_write(wake_out, 1)
        os.eventfd_read(wake_in)
        boxes.take()
        times.append(time.perf_counter_ns() - start)
    return times


# --- one block of one transport ---------------------------------------------------------------------

def run_block(transport: str, payload: bytes, count: int, workdir: Path) -> list[int]:
    ctx = mp.get_context("spawn")  # (the servers: a fresh interpreter, no gRPC state of this one's)
    ready = ctx.Queue()
    if transport in ("grpc-tcp", "grpc-unix"):
        address = "127.0.0.1:0" if transport == "grpc-tcp" else f"unix:{workdir / 'grpc.sock'}"
        child = ctx.Process(target=grpc_server, args=(address, ready), daemon=True)
        child.start()
        port = ready.get(timeout=60)
        target = f"127.0.0.1:{port}" if transport == "grpc-tcp" else address
        try:
            return asyncio.run(grpc_client(target, payload, count))
        finally:
            child.terminate()
            child.join()
    if transport == "unix-stream":
        path = str(workdir / "stream.sock")
        child = ctx.Process(target=stream_server, args=(path, ready), daemon=True)
        child.start()
        ready.get(timeout=60)
        try:
            return asyncio.run(stream_client(path, payload, count))
        finally:
            child.terminate()
            child.join()
            os.unlink(path)
    threaded = transport == "shm-eventfd-thread"
    path = str(workdir / "mailboxes")
    with open(path, "wb") as f:
        f.truncate(2 * MAILBOX)
    to_server, to_client = os.eventfd(0), os.eventfd(0)
    # (forked: the child inherits the eventfds; it never touches gRPC)
    child = mp.get_context("fork").Process(target=shm_server, args=(path, to_server, to_client, count, threaded),
                                           daemon=True)
    child.start()
    boxes = Mailboxes(path, 0)
    try:
        if threaded:
            return shm_thread_client(boxes, to_server, to_client, payload, count)
        return asyncio.run(shm_client(boxes, to_server, to_client, payload, count))
    finally:
        child.join(timeout=10)
        os.close(to_server)
        os.close(to_client)


TRANSPORTS = ["grpc-tcp", "grpc-unix", "unix-stream", "shm-eventfd", "shm-eventfd-thread"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--bytes", default="256,16384", help="message sizes (comma separated)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"--transports: unknown {unknown} (known: {TRANSPORTS})")
    sizes = [int(s) for s in args.bytes.split(",") if s]
    if any(not 0 < s <= MAILBOX - 4 for s in sizes):
        parser.error(f"--bytes: each size must be in 1..{MAILBOX - 4}")
    if args.messages <= args.warmup:
        parser.error("--messages must exceed --warmup")
    medians: dict[tuple[str, int], list[float]] = {}
    tails: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="link_floor") as tmp:
        for block in range(args.blocks):
            order = transports if block % 2 == 0 else transports[::-1]
            for size in sizes:
                for transport in order:
                    times = run_block(transport, os.urandom(size), args.messages, Path(tmp))[args.warmup:]
                    times.sort()
                    medians.setdefault((transport, size), []).append(statistics.median(times) / 1e3)
                    tails.setdefault((transport, size), []).append(times[int(0.9 * len(times))] / 1e3)
                    print(f"  block {block + 1}/{args.blocks}, {size} B, {transport}: "
                          f"{medians[transport, size][-1]:.1f} µs", file=sys.stderr, flush=True)
    print(f"\nround trip to another process on this host ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; median of {args.blocks} blocks' medians, {args.messages - args.warmup} messages a block)")
    print("| transport | bytes | round trip p50 µs | p90 µs | / grpc-tcp |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for size in sizes:
        base = statistics.median(medians["grpc-tcp", size]) if ("grpc-tcp", size) in medians else None
        for transport in transports:
            p50 = statistics.median(medians[transport, size])
            p90 = statistics.median(tails[transport, size])
            ratio = f"{p50 / base:.2f}" if base else "—"
            print(f"| {transport} | {size} | {p50:.1f} | {p90:.1f} | {ratio} |")
            rows.append(dict(transport=transport, bytes=size, p50_us=p50, p90_us=p90,
                             block_medians_us=medians[transport, size]))
    if args.out:
        args.out.write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)}, rows=rows), indent=1))


if __name__ == "__main__":
    main()
