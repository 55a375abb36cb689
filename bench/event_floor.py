"""What one streamed Generate event costs the serving process: gRPC's aio server against the
same-host local socket (shared/local_stream.py, the verifier's --local-socket).

A server process streams 64 small GenerateEvents on each of 8 concurrent streams (no model: each
event is yielded at once), a client in this process reads them; reported per transport are the
server process's CPU per event (Linux /proc: every thread) and the wall per event. Repeated in
alternating order; the medians are the claim. This is the floor a transport sets under the
verifier's event loop, whose thread the engine thread shares an interpreter lock with.

    python bench/event_floor.py [--rounds 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench import REPO  # noqa: E402,F401  (puts the repository and protocol modules on sys.path)
from pairbench.common import cpu_seconds, free_port  # noqa: E402

STREAMS, EVENTS = 8, 64


def event(i: int):
    from shared.protocol import verifier_pb2

    return verifier_pb2.GenerateEvent(token_ids=[i], text_delta="ab", round=verifier_pb2.RoundInfo(round_id=i))


async def generate(request, context):
    for i in range(EVENTS):
        await asyncio.sleep(0)  # (another stream's turn, as rounds interleave in the verifier)
        yield event(i)


async def local_generate(requests, context):
    await requests.read()
    async for e in generate(None, context):
        yield e


async def serve(transport: str, where: str, ready) -> None:
    import grpc

    from shared.local_stream import LocalStreamServer
    from shared.protocol import verifier_pb2

    if transport == "grpc":
        server = grpc.aio.server()
        handler = grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=verifier_pb2.GenerateRequest.FromString,
            response_serializer=verifier_pb2.GenerateEvent.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.v1.Verifier", {"Generate": handler}),))
        server.add_insecure_port(where)
        await server.start()
    else:
        server = LocalStreamServer(where, local_generate, verifier_pb2.GenerateRequest, limit=1 << 20)
        await server.start()
    ready.set()
    await asyncio.Event().wait()


def server_main(transport: str, where: str, ready) -> None:
    asyncio.run(serve(transport, where, ready))


async def drive(transport: str, where: str, rounds: int) -> None:
    from shared.client import AsyncVerifierClient, GenerationConfig

    local = where if transport == "local" else None
    async with AsyncVerifierClient(where if transport == "grpc" else "127.0.0.1:1", local_socket=local) as client:
        async def one() -> int:
            return len([e async for e in client.stream([1], GenerationConfig(max_new_tokens=1))])

        for _ in range(rounds):
            counts = await asyncio.gather(*(one() for _ in range(STREAMS)))
            assert counts == [EVENTS] * STREAMS, counts


def measure(transport: str, rounds: int, workdir: Path) -> tuple[float, float]:
    """(server CPU µs an event, wall µs an event)."""
    if transport == "grpc":
        where = f"127.0.0.1:{free_port()}"
    else:
        where = str(workdir / f"events-{time.monotonic_ns()}.sock")
    ready = mp.Event()
    server = mp.Process(target=server_main, args=(transport, where, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise SystemExit(f"the {transport} server did not start")
        asyncio.run(drive(transport, where, 3))  # warm-up
        cpu_before, started = cpu_seconds(server.pid), time.perf_counter()
        asyncio.run(drive(transport, where, rounds))
        wall, cpu = time.perf_counter() - started, cpu_seconds(server.pid) - cpu_before
    finally:
        server.kill()
        server.join()
    events = rounds * STREAMS * EVENTS
    return cpu / events * 1e6, wall / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds of 8 streams x 64 events a measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="event-floor-"))
    results: dict[str, list[tuple[float, float]]] = {"grpc": [], "local": []}
    for repeat in range(args.repeats):
        for transport in ("grpc", "local") if repeat % 2 == 0 else ("local", "grpc"):
            results[transport].append(measure(transport, args.rounds, workdir))
            cpu, wall = results[transport][-1]
            print(f"repeat {repeat + 1}/{args.repeats} {transport}: server CPU {cpu:.1f} µs an event, "
                  f"wall {wall:.1f} µs an event", file=sys.stderr, flush=True)
    print(f"\n### event_floor: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {STREAMS} streams x {EVENTS} "
          f"events, {args.rounds} rounds, {args.repeats} repeats (medians)\n")
    print("| transport | server CPU µs an event | wall µs an event |")
    print("| --- | ---: | ---: |")
    for transport, rows in results.items():
        print(f"| {transport} | {statistics.median(r[0] for r in rows):.1f} | {statistics.median(r[1] for r in rows):.1f} |")


if __name__ == "__main__":
    main()
