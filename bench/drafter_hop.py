"""The drafter's hop (issue 13): a commit's round trip to its chain, less the drafter's compute.

One process plays the verifier on one Draft stream per drafter over loopback gRPC: open a
session, then per round wait `--verify-ms` (the verifier verifying), send a commit of one
token with its hidden row, and time until the chain that answers it arrives; the drafter's
own compute (`DraftChain.costs.draft_ms`) is subtracted. Two drafters, interleaved in blocks
of `--rounds` rounds so drifts of machine load hit both:
- tandem's drafter (`drafter_service.server.DrafterServer`, the embedded model, planner
  `--planner`; draft-ahead off so that every commit is answered);
- a lean servicer that answers every commit with an empty chain at once (the floor of
  gRPC aio on this machine: what the hop costs without any drafter work).

Prints p50 / p95 per drafter (ms). Both ends share one event loop here, so absolute figures
are above a two-process deployment's; the difference between the rows is the drafter's own
per-message path (worker-thread hops, spans, metrics, deferred work it may queue behind).

    python bench/drafter_hop.py [--device cpu] [--blocks 4] [--rounds 100] [--verify-ms 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from drafter_service.server import DrafterServer  # noqa: E402
from drafter_service.settings import DrafterSettings  # noqa: E402
from shared.model import load_model  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402
from shared.protocol import PROTOCOL_VERSION, drafter_pb2, drafter_pb2_grpc, encode_hidden  # noqa: E402


class EmptyDrafter(drafter_pb2_grpc.DrafterServicer):
    """Answers every message with an empty chain at once."""

    async def Draft(self, request_iterator, context):
        round_id = 0
        async for up in request_iterator:
            if up.HasField("commit"):
                round_id = up.commit.round_id + 1
            yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION,
                                        chain=drafter_pb2.DraftChain(round_id=round_id))


class Stream:
    """One verifier-side Draft stream: open once, then timed commits."""

    def __init__(self, stub, hidden_size: int, max_rounds: int) -> None:
        self.stub, self.hidden_size, self.max_rounds = stub, hidden_size, max_rounds
        self.call = None
        self.round_id = 0

    async def open(self) -> None:
        tokens = list(range(1, 40))
        self.call = self.stub.Draft()
        await self.call.write(drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, open=drafter_pb2.DraftOpen(
            session_id="hop", token_ids=tokens, max_draft_tokens=4, max_new_tokens=self.max_rounds + 8,
            hidden=encode_hidden(torch.zeros(len(tokens) - 1, self.hidden_size)))))
        await self.call.read()

    async def rounds(self, count: int, verify_s: float) -> list[float]:
        hops = []
        for _ in range(count):
            await asyncio.sleep(verify_s)
            up = drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, commit=drafter_pb2.DraftCommit(
                round_id=self.round_id, emitted_token_ids=[5 + self.round_id % 7],
                hidden=encode_hidden(torch.zeros(1, self.hidden_size))))
            started = time.perf_counter()
            await self.call.write(up)
            down = await self.call.read()
            hops.append((time.perf_counter() - started) * 1e3 - down.chain.costs.draft_ms)
            self.round_id += 1
        return hops

    async def close(self) -> None:
        await self.call.done_writing()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def main_async(args) -> None:
    model = load_model(resolve_model(None), device=args.device)
    hidden = model.config.hidden_size
    tandem = DrafterServer(DrafterSettings(port=0, device=args.device, planner=args.planner, draft_ahead=False), model=model)
    tandem_port = await tandem.start()
    await tandem.wait_loaded()
    empty = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(EmptyDrafter(), empty)
    empty_port = empty.add_insecure_port("127.0.0.1:0")
    await empty.start()
    total = args.blocks * args.rounds
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in (tandem_port, empty_port)]
    streams = {"tandem drafter": Stream(drafter_pb2_grpc.DrafterStub(channels[0]), hidden, total),
               "empty-chain servicer": Stream(drafter_pb2_grpc.DrafterStub(channels[1]), hidden, total)}
    hops: dict[str, list[float]] = {name: [] for name in streams}
    try:
        for stream in streams.values():
            await stream.open()
        for block in range(args.blocks):
            order = list(streams) if block % 2 == 0 else list(streams)[::-1]
            for name in order:
                hops[name] += await streams[name].rounds(args.rounds, args.verify_ms / 1e3)
            print(f"block {block + 1}/{args.blocks} done", file=sys.stderr, flush=True)
        for stream in streams.values():
            await stream.close()
    finally:
        for channel in channels:
            await channel.close()
        await tandem.stop(0)
        await empty.stop(0)
    print(f"### drafter_hop: {time.strftime('%Y-%m-%d')}, device {args.device}, planner {args.planner}, "
          f"{args.blocks} blocks x {args.rounds} rounds, {args.verify_ms:g} ms between commit and chain\n")
    print("| drafter | rounds | hop p50 ms | hop p95 ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in hops.items():
        print(f"| {name} | {len(values)} | {statistics.median(values):.3f} | {percentile(values, 95):.3f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--planner", default="suffix", choices=("adaptive", "mtp", "suffix"))
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--verify-ms", type=float, default=15.0, help="wait before each commit (the verify step)")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
