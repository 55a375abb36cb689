"""A SYNTHETIC drafter with controlled acceptance, for benchmarks (bench/pair_speedup.py).

A real `tandem.v1.Drafter` gRPC service (grpc.aio, with health checking) that proposes the
next K tokens of a known reference continuation — the verifier's own output for the prompt
— each token independently corrupted with probability 1 - alpha. Against a verifier in
exact mode every uncorrupted draft is accepted (while the committed tokens still equal the
reference), so the per-step acceptance is alpha by construction. Nothing it produces is a
real draft: label every number measured with it "synthetic".

    python bench/replay_drafter.py --port P --reference FILE --alpha A --seed S [--max-drafts K]
        [--vocab-size V] [--stats FILE.jsonl] [--delay-ms D]

Reference file (JSON): {"prompt_ids": [...], "token_ids": [...]} for one prompt, or
{"references": [{"prompt_ids": ..., "token_ids": ...}, ...], "vocab_size": V} for several
(a plain JSON list of such objects works too). A session is matched to the reference whose
prompt is a prefix of the opened context and whose continuation equals the rest.

Per open / commit the chain for the next round is: the reference tokens at the session's
committed position (at most K: min(--max-drafts, the verifier's max_draft_tokens)) if the
committed tokens still equal the reference prefix, else no drafts. Draft j at absolute
position p is corrupted iff u(seed, prompt, p) >= alpha, u a fixed hash-based uniform in
[0, 1) (blake2b of seed, a CRC of the prompt ids and p), so a rerun proposes exactly the
same chains; a corrupted token t becomes (t + 1) % vocab_size (t - 1 where the vocabulary
size is unknown and t + 1 might fall outside it). Drafts are point masses (no q rows),
source SUFFIX, confidences 1.0.

A session id containing "@alpha=A" (the verifier forwards the request's request_id as the
session id) overrides --alpha for that session, so one replay drafter and one verifier can
serve several alpha values in one interleaved run; one containing "@no-ahead" gets no chains
drafted ahead (otherwise, like tandem's drafter, after each chain it sends the next round's
chain assuming every draft accepted and the reference's next token as the bonus).

--stats FILE appends one JSON line per finished Draft stream (label "synthetic"): the
session id, alpha, the bytes of every message each way (protobuf ByteSize: payload bytes,
no gRPC/HTTP2 framing), the drafter's own compute time per chain (message received → chain
built), drafts proposed and corrupted, and where the session left the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

try:
    from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc
except ImportError:  # run as a script from anywhere: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc
from shared.local_stream import LocalStreamServer  # noqa: E402

LABEL = "synthetic"
MAX_DRAFTS = 16
MAX_MESSAGE_BYTES = 64 << 20
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
ALPHA_IN_SESSION = re.compile(r"@alpha=([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")
NO_AHEAD_IN_SESSION = "@no-ahead"  # a session id with it gets no chains drafted ahead (an A/B arm)


@dataclass(frozen=True)
class Reference:
    index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    key: int  # CRC32 of the prompt ids: keys the corruption draws per prompt

    def matches(self, tokens: list[int]) -> bool:
        n = len(self.prompt_ids)
        if len(tokens) < n or tuple(tokens[:n]) != self.prompt_ids:
            return False
        rest = tokens[n:]
        return len(rest) <= len(self.token_ids) and tuple(rest) == self.token_ids[: len(rest)]


def load_references(path: str | Path) -> tuple[list[Reference], int]:
    """The references in `path` and the vocabulary size it names (0 = unknown)."""
    raw = json.loads(Path(path).read_text())
    vocab_size = 0
    if isinstance(raw, dict) and "references" in raw:
        vocab_size = int(raw.get("vocab_size") or 0)
        items = raw["references"]
    elif isinstance(raw, dict):
        vocab_size = int(raw.get("vocab_size") or 0)
        items = [raw]
    else:
        items = raw
    references = []
    for index, item in enumerate(items):
        prompt = tuple(int(t) for t in item["prompt_ids"])
        tokens = tuple(int(t) for t in item["token_ids"])
        if not prompt:
            raise ValueError(f"reference {index}: prompt_ids is empty")
        key = zlib.crc32(b",".join(str(t).encode() for t in prompt))
        references.append(Reference(index, prompt, tokens, key))
    if not references:
        raise ValueError(f"{path}: no references")
    return references, vocab_size


def uniform(seed: int, key: int, position: int) -> float:
    """A fixed uniform in [0, 1) for (seed, prompt key, absolute position)."""
    digest = hashlib.blake2b(f"{seed}:{key}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def corrupt(token: int, vocab_size: int) -> int:
    if vocab_size > 0:
        return (token + 1) % vocab_size
    return token - 1 if token > 0 else token + 1


@dataclass
class ReplaySession:
    session_id: str
    alpha: float
    max_drafts: int
    reference: Reference | None
    tokens: list[int]
    round_id: int
    diverged_at: int | None = None  # committed length where the session left its reference
    stats: dict = field(default_factory=dict)
    draft_ahead: bool = False
    ahead: drafter_pb2.DraftChain | None = None  # the chain drafted ahead and sent, not yet judged
    chain_cap: int = 0  # the verifier's cap on the next chain (0: none)

    @property
    def on_reference(self) -> bool:
        return self.reference is not None and self.diverged_at is None


class ReplayDrafter:
    """The drafting logic, without gRPC (bench/pair_speedup.py also times it in-process)."""

    def __init__(self, references: list[Reference], *, alpha: float, seed: int, max_drafts: int = MAX_DRAFTS,
                 vocab_size: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha {alpha} must lie in [0, 1]")
        self.references = references
        self.alpha = alpha
        self.seed = seed
        self.max_drafts = max(0, min(max_drafts, MAX_DRAFTS))
        self.vocab_size = vocab_size

    def session_alpha(self, session_id: str) -> float:
        match = ALPHA_IN_SESSION.search(session_id)
        if match is None:
            return self.alpha
        alpha = float(match.group(1))
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"session id {session_id!r}: alpha {alpha} must lie in [0, 1]")
        return alpha

    def open(self, message: drafter_pb2.DraftOpen) -> ReplaySession:
        tokens = list(message.token_ids)
        if not tokens:
            raise ValueError("open.token_ids is empty")
        reference = next((r for r in self.references if r.matches(tokens)), None)
        session = ReplaySession(
            session_id=message.session_id, alpha=self.session_alpha(message.session_id),
            max_drafts=max(0, min(self.max_drafts, message.max_draft_tokens)), reference=reference,
            tokens=tokens, round_id=message.next_round_id,
            draft_ahead=message.draft_ahead and NO_AHEAD_IN_SESSION not in message.session_id,
        )
        session.stats = {
            "label": LABEL, "session_id": session.session_id, "alpha": session.alpha, "seed": self.seed,
            "reference": reference.index if reference else None, "prompt_tokens": len(tokens),
            "up": [], "down": [], "compute_ms": [], "drafted": 0, "corrupted": 0, "diverged_at": None,
            "ahead_sent": 0, "ahead_hits": 0,
        }
        return session

    def commit(self, session: ReplaySession, message: drafter_pb2.DraftCommit) -> bool:
        """Apply a commit; True when it emitted what the chain drafted ahead assumed (a hit)."""
        emitted = list(message.emitted_token_ids)
        ahead, session.ahead = session.ahead, None
        hit = (ahead is not None and message.num_rounds <= 1 and ahead.round_id == message.round_id + 1
               and emitted == list(ahead.assumed_token_ids))
        if hit:
            session.ahead = ahead
            session.stats["ahead_hits"] += 1
        start = len(session.tokens)
        session.tokens.extend(emitted)
        session.round_id = message.round_id + 1
        session.chain_cap = message.max_draft_tokens  # the verifier's load gate (0: none)
        if session.on_reference:
            ref = session.reference
            offset = start - len(ref.prompt_ids)
            expected = list(ref.token_ids[offset : offset + len(emitted)])
            if emitted != expected:  # the verifier left the reference (or ran past its end)
                same = next((i for i, (a, b) in enumerate(zip(emitted, expected)) if a != b), min(len(emitted), len(expected)))
                session.diverged_at = start + same
                session.stats["diverged_at"] = session.diverged_at
        return hit

    def _drafts_at(self, session: ReplaySession, base: int) -> list[int]:
        """The (possibly corrupted) reference tokens from absolute position `base` on."""
        drafts: list[int] = []
        limit = min(session.max_drafts, session.chain_cap) if session.chain_cap else session.max_drafts
        if session.on_reference and limit:
            ref = session.reference
            offset = base - len(ref.prompt_ids)
            for j, token in enumerate(ref.token_ids[offset : offset + limit]):
                if uniform(self.seed, ref.key, base + j) >= session.alpha:
                    token = corrupt(token, self.vocab_size)
                    session.stats["corrupted"] += 1
                drafts.append(token)
            session.stats["drafted"] += len(drafts)
        return drafts

    def propose(self, session: ReplaySession) -> drafter_pb2.DraftChain:
        drafts = self._drafts_at(session, len(session.tokens))
        return drafter_pb2.DraftChain(
            round_id=session.round_id,
            base_length=len(session.tokens),
            source=common_pb2.DRAFT_SOURCE_SUFFIX if drafts else common_pb2.DRAFT_SOURCE_NONE,
            token_ids=drafts,
            confidences=[1.0] * len(drafts),
        )

    def propose_ahead(self, session: ReplaySession, sent: drafter_pb2.DraftChain | None) -> drafter_pb2.DraftChain | None:
        """Draft-ahead, as tandem's drafter does it: the next round's chain assuming every draft of
        `sent` accepted and then the bonus it expects (here: the reference's next token)."""
        session.ahead = None
        if not session.draft_ahead or sent is None or not sent.token_ids or not session.on_reference:
            return None
        ref = session.reference
        after = sent.base_length + len(sent.token_ids)
        offset = after - len(ref.prompt_ids)
        if offset >= len(ref.token_ids):
            return None
        assumed = [*sent.token_ids, ref.token_ids[offset]]
        drafts = self._drafts_at(session, after + 1)
        if not drafts:
            return None
        session.ahead = drafter_pb2.DraftChain(
            round_id=sent.round_id + 1, base_length=sent.base_length + len(assumed), source=common_pb2.DRAFT_SOURCE_SUFFIX,
            token_ids=drafts, confidences=[1.0] * len(drafts), assumed_token_ids=assumed)
        session.stats["ahead_sent"] += 1
        return session.ahead


class ReplayDrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, drafter: ReplayDrafter, stats_path: str | None = None, delay_s: float = 0.0) -> None:
        self.drafter = drafter
        self.stats_path = stats_path
        self.delay_s = delay_s  # a slow drafter: each chain leaves this long after its message came
        self.sessions = 0

    def _write_stats(self, session: ReplaySession) -> None:
        if not self.stats_path:
            return
        with open(self.stats_path, "a") as out:
            out.write(json.dumps(session.stats) + "\n")

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        session: ReplaySession | None = None
        try:
            async for up in request_iterator:
                started = time.perf_counter()
                kind = up.WhichOneof("kind")
                try:
                    if kind == "open":
                        session = self.drafter.open(up.open)
                        self.sessions += 1
                    elif kind == "commit":
                        if session is None:
                            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "commit before open: re-open the stream")
                        hit = self.drafter.commit(session, up.commit)
                    else:
                        continue
                    if kind == "commit" and hit:  # the verifier holds the chain drafted ahead: the next one ahead
                        ahead = self.drafter.propose_ahead(session, session.ahead)
                        session.stats["up"].append([kind, up.ByteSize()])
                        if ahead is not None:
                            if self.delay_s:
                                await asyncio.sleep(self.delay_s)
                            yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=ahead)
                        continue
                    chain = self.drafter.propose(session)
                except ValueError as error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                elapsed = (time.perf_counter() - started) * 1e3
                chain.costs.draft_ms = elapsed
                down = drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=chain)
                session.stats["up"].append([kind, up.ByteSize()])
                session.stats["down"].append(down.ByteSize())
                session.stats["compute_ms"].append((time.perf_counter() - started) * 1e3)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield down
                ahead = self.drafter.propose_ahead(session, chain)
                if ahead is not None:
                    yield drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=ahead)
        finally:
            if session is not None:
                self._write_stats(session)


async def serve(args: argparse.Namespace) -> None:
    references, file_vocab = load_references(args.reference)
    drafter = ReplayDrafter(references, alpha=args.alpha, seed=args.seed, max_drafts=args.max_drafts,
                            vocab_size=args.vocab_size or file_vocab)
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(options=OPTIONS)
    service = ReplayDrafterService(drafter, args.stats, args.delay_ms / 1e3)
    drafter_pb2_grpc.add_DrafterServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {args.host}:{args.port}")
    await server.start()
    local = None
    if args.local_socket:  # the same servicer's Draft streams on a Unix socket (shared.local_stream)
        local = LocalStreamServer(args.local_socket, service.Draft, drafter_pb2.DraftUp, limit=MAX_MESSAGE_BYTES)
        await local.start()
    for name in ("", "tandem.v1.Drafter"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"{LABEL} replay drafter listening on {args.host}:{port}: {len(references)} reference(s), "
          f"alpha {args.alpha}, seed {args.seed}, max drafts {drafter.max_drafts}, vocab {drafter.vocab_size or 'unknown'}",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    if local is not None:
        await local.close()
    await server.stop(2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reference", required=True, help="JSON reference file (see the module docstring)")
    parser.add_argument("--alpha", type=float, required=True, help="probability that a draft token is left uncorrupted")
    parser.add_argument("--seed", type=int, default=0, help="keys the corruption draws")
    parser.add_argument("--max-drafts", type=int, default=MAX_DRAFTS, help="most drafts per chain (also capped by the verifier's max_draft_tokens)")
    parser.add_argument("--vocab-size", type=int, default=0, help="0 = the reference file's vocab_size, else corrupt t to t-1")
    parser.add_argument("--stats", default=None, help="append one JSON line per finished stream to this file")
    parser.add_argument("--local-socket", default=None, help="also serve Draft streams on this Unix socket (a verifier's --drafter-socket)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="a slow drafter: send each chain this long after the message it answers")
    args = parser.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        parser.error(f"--alpha {args.alpha} must lie in [0, 1]")
    try:
        asyncio.run(serve(args))
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
