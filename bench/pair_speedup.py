"""Speedup of speculation through the two services (verifier + drafter over loopback gRPC).

Method (DESIGN §7): interleaved paired blocks. Each block runs the same prompts and seeds
once per arm — with speculation (the verifier configured with a drafter) and without (the
same verifier process, requests with speculation.disable = True) — with the arm order
reversed on alternate blocks; within a block the arms run back to back per prompt (block
1: spec, plain for prompt 0, then prompt 1, ...; block 2: plain, spec), so a drift in
machine load lands on both arms of a pair. Per block: ratio = tokens/s(spec) /
tokens/s(plain), tokens/s = the block's completion tokens / its requests' wall time
(client side, send → final event; prefill included). One warm-up request per arm first. Quoted: the MEDIAN OF PAIRED RATIOS (not the ratio of medians); the same from the
verifier's own tokens_per_s as a cross-check.

Also reported (all from the timed runs unless said otherwise):
- mean accepted length = completion tokens / rounds (bonus/correction token included),
  acceptance by source (accepted / retained drafts, from RoundInfo), rounds per request;
- per-round time: wall, verify (RoundInfo.verify_ms), draft wait (RoundInfo.draft_wait_ms);
- drafter compute per round and bytes per round each way:
  * real drafter (embedded setups): a byte-counting tap (a pass-through gRPC proxy in this
    process) sits between a SECOND verifier process and the same drafter; after the timed
    blocks every prompt runs once through it (untimed). Bytes = serialized DraftUp /
    DraftDown payloads (no gRPC/HTTP2 framing). The captured up-stream messages are then
    replayed into an in-process `drafter_service.server.Drafter` on the same model and
    device, timing commit + propose per round (open + propose for round 0);
  * replay drafter (synthetic setups): measured inside bench/replay_drafter.py during the
    timed runs (protobuf ByteSize, compute = message received → chain built);
- hop + service overhead per round = median draft_wait_ms (rounds >= 1) − median drafter
  compute per round (medians: robust to bursts of load on a shared machine);
- the ideal speedup (DESIGN §7 cost model, verify cost only: no draft cost, no hop, no
  per-round host overhead): C1 = mean verify_ms of the plain arm's 1-row rounds, C(w) =
  mean verify_ms of the spec arm's w-row windows; ideal = (spec tokens / spec verify ms) /
  (plain tokens / plain verify ms), i.e. R / (C_mix / C1); fraction realised = measured
  median ratio / ideal. Per k, R_k = 1 + sum_i prod_{j<=i} a_j from the measured per-step
  acceptance a_j, and R_k / (C(k+1) / C1) where C(k+1) was measured.

Setups:
  cpu-embedded (default)  tandem drafter + tandem verifier --drafter, embedded model, CPU
  gpu-embedded            the same with --device cuda
  cpu-synthetic           embedded model on CPU, bench/replay_drafter.py (SYNTHETIC drafts)
  gpu-synthetic           random bf16 weights at Qwen3-30B-A3B shapes on CUDA, replay drafter
                          (--random-shapes smoke: a tiny random model, for a quick check)
CPU setups start each service with OMP_NUM_THREADS=1 (--threads): on a small CPU two
services with two OpenMP threads each stall on barriers whenever another process holds a
core, which turns a 10 ms verify window into 300-600 ms at random.

Synthetic setups: one verifier (--drafter = the replay drafter's port) first records each
prompt's output without speculation (the reference), then one replay drafter serves every
alpha: the request id carries "@alpha=A", which the replay drafter reads. Each block runs
the plain arm once and one spec arm per alpha (all paired with that block's plain arm).

The drafter's cross-session suffix index is OFF by default (--global-index-contexts 0):
every block repeats the same prompts, and the index would replay earlier blocks' outputs
as drafts. --global-index keeps the drafter's default.

Usage: python bench/pair_speedup.py [--setup cpu-embedded] [--blocks 5] [--max-new-tokens 96] [--out raw.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
try:
    import tandem.v1  # noqa: F401  (the generated protocol modules)
    _EXTRA_PATHS: list[str] = []
except ImportError:  # not installed: the generated modules beside their .proto sources
    sys.path.insert(0, str(REPO / "protos"))
    _EXTRA_PATHS = [str(REPO / "protos")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError  # noqa: E402
from shared.protocol import drafter_pb2  # noqa: E402

SETUPS = ("cpu-embedded", "gpu-embedded", "cpu-synthetic", "gpu-synthetic")
PROMPTS = (
    "import os\n\n\ndef read_lines(path):",
    "class Stack:\n    def __init__(self):",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Node:\n    def __init__(self, value, children=None):",
    "def merge_sort(items):\n    if len(items) <= 1:",
    "import re\n\n\ndef tokenize(text):",
)
QWEN3_30B_A3B = dict(  # bench/model_baseline.py's shapes (no eos: fixed-length completions)
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6, model_type="qwen3_moe",
)
SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    # a few-MB model of the same family: smoke-tests the random-weights path anywhere
    "smoke": QWEN3_30B_A3B | dict(vocab_size=4096, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                                  num_experts=16, num_experts_per_tok=2),
}
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def fmt(value, spec: str = ".2f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


class ServiceError(RuntimeError):
    """A child service that did not start or died (the message carries its log's tail)."""


# --- child processes --------------------------------------------------------------------


class Children:
    """The services this run starts: logs to files, health waits, SIGTERM at the end."""

    def __init__(self, workdir: Path, threads: int = 0) -> None:
        self.workdir = workdir
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_VERIFIER_", "TANDEM_DRAFTER_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *_EXTRA_PATHS, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        if threads > 0:  # torch's intra-op threads per service (OMP/MKL read these at start)
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        self.env = env

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log_path = self.workdir / f"{name}.log"
        handle = open(log_path, "w")
        log(f"  start {name}: {' '.join(argv[1:])}")
        proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=handle, stderr=subprocess.STDOUT)
        handle.close()
        self.procs[name] = (proc, log_path)
        return proc

    def tail(self, name: str, lines: int = 25) -> str:
        _, path = self.procs[name]
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    | " + line for line in text[-lines:])

    def check_alive(self) -> None:
        for name, (proc, _) in self.procs.items():
            if proc.poll() is not None:
                raise ServiceError(f"the {name} exited with status {proc.returncode}; its log ends:\n{self.tail(name)}")

    async def wait_serving(self, name: str, address: str, timeout: float) -> None:
        proc, _ = self.procs[name]
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise ServiceError(f"the {name} exited with status {proc.returncode} before serving; its log ends:\n{self.tail(name)}")
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        log(f"  {name} SERVING at {address}")
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise ServiceError(f"the {name} at {address} was not SERVING within {timeout:.0f}s; its log ends:\n{self.tail(name)}")
                await asyncio.sleep(0.25)

    def stop(self, name: str | None = None, timeout: float = 20.0) -> None:
        names = [name] if name else list(self.procs)
        for n in names:
            proc, _ = self.procs[n]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for n in names:
            proc, _ = self.procs[n]
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"  {n} did not stop within {timeout:.0f}s of SIGTERM: killing it")
                proc.kill()
                proc.wait()


# --- the byte-counting tap (real drafter) -------------------------------------------------


class Tap:
    """A pass-through proxy of Drafter.Draft that keeps every message's raw bytes."""

    METHOD = "/tandem.v1.Drafter/Draft"

    def __init__(self, target: str) -> None:
        self.target = target
        self.streams: list[dict] = []
        self.server: grpc.aio.Server | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.forward = self.channel.stream_stream(self.METHOD)  # no (de)serializers: raw bytes
        handler = grpc.method_handlers_generic_handler(
            "tandem.v1.Drafter", {"Draft": grpc.stream_stream_rpc_method_handler(self._draft)})
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.server.add_generic_rpc_handlers((handler,))
        if self.server.add_insecure_port(f"127.0.0.1:{port}") == 0:
            raise ServiceError(f"the tap could not bind 127.0.0.1:{port}")
        await self.server.start()

    async def _draft(self, request_iterator, context):
        record: dict = {"up": [], "down": []}
        self.streams.append(record)

        async def upstream():
            async for raw in request_iterator:
                record["up"].append(raw)
                yield raw

        call = self.forward(upstream())
        try:
            async for raw in call:
                record["down"].append(raw)
                yield raw
        finally:
            call.cancel()

    async def stop(self) -> None:
        server, channel, self.server, self.channel = self.server, self.channel, None, None
        if server is not None:
            await server.stop(1.0)
        if channel is not None:
            await channel.close()


def tap_costs(streams: list[dict]) -> dict:
    """Bytes each way per message kind, and the drafter's self-reported propose time."""
    open_bytes, commit_bytes, down_bytes, draft_ms, hidden_bytes = [], [], [], [], []
    for stream in streams:
        for raw in stream["up"]:
            up = drafter_pb2.DraftUp.FromString(raw)
            kind = up.WhichOneof("kind")
            if kind == "open":
                open_bytes.append(len(raw))
            elif kind == "commit":
                commit_bytes.append(len(raw))
                hidden_bytes.append(len(up.commit.hidden.bf16))
        for raw in stream["down"]:
            down_bytes.append(len(raw))
            draft_ms.append(drafter_pb2.DraftDown.FromString(raw).chain.costs.draft_ms)
    return {
        "streams": len(streams), "open_bytes": mean(open_bytes), "commit_bytes": mean(commit_bytes),
        "commit_hidden_bytes": mean(hidden_bytes), "chain_bytes": mean(down_bytes), "chains": len(down_bytes),
        "propose_ms_self_reported": mean(draft_ms[1:]) if len(draft_ms) > 1 else None,
    }


def replay_real_drafter(streams: list[dict], model: str | None, device: str, dtype: str, threads: int = 0,
                        passes: int = 2) -> dict:
    """Replay the captured up-stream messages into an in-process Drafter; time each step
    (open + propose; commit + propose) on the last pass (earlier passes warm up)."""
    import torch

    from drafter_service.server import Drafter
    from drafter_service.settings import DrafterSettings
    from shared.model import load_model
    from shared.model.registry import resolve_model

    if threads > 0:
        torch.set_num_threads(threads)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    loaded = load_model(resolve_model(model), device=device, dtype=dtypes[dtype])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    open_ms: list[float] = []
    commit_ms: list[float] = []
    for _ in range(passes):
        open_ms, commit_ms = [], []
        drafter = Drafter(loaded, DrafterSettings(global_index_contexts=0, device=device, dtype=dtype))
        for stream in streams:
            session = None
            for raw in stream["up"]:
                up = drafter_pb2.DraftUp.FromString(raw)
                kind = up.WhichOneof("kind")
                sync()
                started = time.perf_counter()
                if kind == "open":
                    session = drafter.open(up.open)
                    drafter.propose(session)
                elif kind == "commit" and session is not None:
                    drafter.commit(session, up.commit)
                    drafter.propose(session)
                else:
                    continue
                sync()
                (open_ms if kind == "open" else commit_ms).append((time.perf_counter() - started) * 1e3)
    return {"open_ms": median(open_ms), "commit_ms": median(commit_ms), "commit_ms_mean": mean(commit_ms),
            "steps": len(commit_ms)}


def replay_stats(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def synthetic_costs(records: list[dict]) -> dict:
    open_bytes, commit_bytes, down_bytes, open_ms, commit_ms = [], [], [], [], []
    for record in records:
        for (kind, size), ms in zip(record["up"], record["compute_ms"]):
            (open_bytes if kind == "open" else commit_bytes).append(size)
            (open_ms if kind == "open" else commit_ms).append(ms)
        down_bytes.extend(record["down"])
    return {
        "streams": len(records), "open_bytes": mean(open_bytes), "commit_bytes": mean(commit_bytes),
        "chain_bytes": mean(down_bytes), "chains": len(down_bytes), "open_ms": median(open_ms),
        "commit_ms": median(commit_ms), "commit_ms_mean": mean(commit_ms),
        "diverged": sum(1 for r in records if r.get("diverged_at") is not None),
        "corrupted": sum(r["corrupted"] for r in records), "drafted": sum(r["drafted"] for r in records),
    }


# --- requests and blocks ------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str  # "plain", "spec", "spec@alpha=0.8"
    speculation: bool
    alpha: float | None = None


@dataclass
class Run:
    args: argparse.Namespace
    prompts: list[list[int]]
    records: list[dict] = field(default_factory=list)

    def config(self, arm: Arm, index: int, request_id: str) -> GenerationConfig:
        a = self.args
        return GenerationConfig(
            max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed + index, mode=a.mode,
            max_draft_tokens=a.max_draft_tokens, speculation=arm.speculation, request_id=request_id,
        )

    @staticmethod
    def request_id(arm: Arm, tag: str, index: int) -> str:
        rid = f"{'spec' if arm.speculation else 'plain'}-{tag}-p{index}"
        return rid + (f"@alpha={arm.alpha:g}" if arm.alpha is not None else "")

    async def request(self, client: AsyncVerifierClient, arm: Arm, index: int, tag: str) -> dict:
        rid = self.request_id(arm, tag, index)
        started = time.perf_counter()
        try:
            generation = await client.generate(self.prompts[index], self.config(arm, index, rid))
        except VerifierError as error:
            raise ServiceError(f"request {rid} failed: {error}") from error
        wall = time.perf_counter() - started
        return {
            "request_id": rid, "arm": arm.name, "speculation": arm.speculation, "alpha": arm.alpha, "prompt": index,
            "wall_s": wall, "token_ids": generation.token_ids, "tokens": len(generation.token_ids),
            "finish_reason": generation.finish_reason, "stats": generation.stats, "rounds": generation.rounds,
        }

    async def warm_up(self, client: AsyncVerifierClient, arms: list[Arm]) -> float:
        started = time.perf_counter()
        for arm in arms:
            await self.request(client, arm, 0, "warmup")
        return time.perf_counter() - started

    async def blocks(self, client: AsyncVerifierClient, arms: list[Arm], children: Children) -> None:
        n = self.args.blocks
        started = time.perf_counter()
        for block in range(n):
            order = arms if block % 2 == 0 else arms[::-1]
            log(f"block {block + 1}/{n}: per prompt {' -> '.join(arm.name for arm in order)}")
            for index in range(len(self.prompts)):
                for arm in order:  # arms back to back per prompt: slow drifts of machine load hit both
                    children.check_alive()
                    record = await self.request(client, arm, index, f"b{block}")
                    record["block"] = block
                    record["position"] = order.index(arm)
                    self.records.append(record)
            done = block + 1
            elapsed = time.perf_counter() - started
            mine = [r for r in self.records if r["block"] == block]
            tps = {arm.name: sum(r["tokens"] for r in mine if r["arm"] == arm.name)
                   / max(sum(r["wall_s"] for r in mine if r["arm"] == arm.name), 1e-9) for arm in arms}
            plain = next((arm.name for arm in arms if not arm.speculation), None)
            ratios = ", ".join(f"{name} {value / tps[plain]:.3f}" for name, value in tps.items() if name != plain and plain)
            log(f"  block {done}/{n} done ({elapsed / done:.1f}s per block, about {elapsed / done * (n - done):.0f}s left); "
                f"tokens/s ratio vs plain: {ratios}")
            if self.args.out:  # partial records survive a run cut off at a time limit
                Path(self.args.out).write_text(json.dumps({"partial": True, "blocks_done": done, "records": self.records}))


# --- analysis -------------------------------------------------------------------------------


def block_ratios(records: list[dict], spec: Arm, plain: Arm, blocks: int) -> list[dict]:
    rows = []
    for block in range(blocks):
        s = [r for r in records if r["block"] == block and r["arm"] == spec.name]
        p = [r for r in records if r["block"] == block and r["arm"] == plain.name]
        if not s or not p:
            continue
        s_tps = sum(r["tokens"] for r in s) / sum(r["wall_s"] for r in s)
        p_tps = sum(r["tokens"] for r in p) / sum(r["wall_s"] for r in p)

        def server_tps(rs):
            seconds = sum(r["stats"]["completion_tokens"] / r["stats"]["tokens_per_s"] for r in rs if r["stats"]["tokens_per_s"])
            return sum(r["stats"]["completion_tokens"] for r in rs) / seconds if seconds else None

        ss, ps = server_tps(s), server_tps(p)
        rows.append({
            "block": block, "spec_first": s[0]["position"] < p[0]["position"], "spec_tps": s_tps, "plain_tps": p_tps,
            "ratio": s_tps / p_tps, "server_ratio": ss / ps if ss and ps else None,
        })
    return rows


def analyse(records: list[dict], spec: Arm, plain: Arm, blocks: int, k_max: int) -> dict:
    s_recs = [r for r in records if r["arm"] == spec.name]
    p_recs = [r for r in records if r["arm"] == plain.name]
    per_block = block_ratios(records, spec, plain, blocks)
    ratios = [row["ratio"] for row in per_block]
    server_ratios = [row["server_ratio"] for row in per_block if row["server_ratio"] is not None]
    s_rounds = [x for r in s_recs for x in r["rounds"]]
    p_rounds = [x for r in p_recs for x in r["rounds"]]
    tokens = sum(r["tokens"] for r in s_recs)
    rounds = len(s_rounds)
    by_source: dict[str, list[int]] = {}
    for x in s_rounds:
        if x["retained"]:
            counts = by_source.setdefault(x["source"], [0, 0])
            counts[0] += x["retained"]
            counts[1] += x["accepted"]
    # Per-step conditional acceptance: step i judged iff >= i drafts retained and the i-1 before accepted.
    steps = []
    for i in range(1, k_max + 1):
        judged = [x for x in s_rounds if x["retained"] >= i and x["accepted"] >= i - 1]
        steps.append(sum(1 for x in judged if x["accepted"] >= i) / len(judged) if judged else None)
    c1 = mean(x["verify_ms"] for x in p_rounds)
    windows: dict[int, list[float]] = {}
    for x in s_rounds:
        windows.setdefault(x["retained"] + 1, []).append(x["verify_ms"])
    curve = []
    r_k, survive = 1.0, 1.0
    for k in range(0, k_max + 1):
        if k:
            a = steps[k - 1]
            if a is None:
                break
            survive *= a
            r_k += survive
        c = mean(windows.get(k + 1, [])) if k else c1
        curve.append({"k": k, "window": k + 1, "rounds": len(windows.get(k + 1, [])), "verify_ms": c,
                      "cost_ratio": c / c1 if c and c1 else None, "R_k": r_k,
                      "ideal": r_k * c1 / c if c and c1 else None})
    s_verify = sum(x["verify_ms"] for x in s_rounds)
    p_verify = sum(x["verify_ms"] for x in p_rounds)
    p_tokens = sum(r["tokens"] for r in p_recs)
    ideal = (tokens / s_verify) / (p_tokens / p_verify) if s_verify and p_verify and p_tokens else None
    mid = statistics.median(ratios) if ratios else None
    identical = sum(
        1 for r in s_recs for q in p_recs if q["block"] == r["block"] and q["prompt"] == r["prompt"] and q["token_ids"] == r["token_ids"])
    return {
        "arm": spec.name, "alpha": spec.alpha, "per_block": per_block, "median_ratio": mid,
        "min_ratio": min(ratios) if ratios else None, "max_ratio": max(ratios) if ratios else None,
        "median_server_ratio": statistics.median(server_ratios) if server_ratios else None,
        "tokens": tokens, "rounds": rounds, "requests": len(s_recs),
        "mean_accepted_length": tokens / rounds if rounds else None,
        "acceptance_by_source": {k: a / r for k, (r, a) in sorted(by_source.items())},
        "drafts_retained_per_round": mean(x["retained"] for x in s_rounds),
        "per_step_acceptance": steps,
        "faults": sum(r["stats"]["drafter_faults"] for r in s_recs),
        "spec_wall_ms_per_round": 1e3 * sum(r["wall_s"] for r in s_recs) / rounds if rounds else None,
        "spec_verify_ms": mean(x["verify_ms"] for x in s_rounds),
        "draft_wait_ms": mean(x["draft_wait_ms"] for x in s_rounds if x["round_id"] >= 1),
        "draft_wait_median_ms": median(x["draft_wait_ms"] for x in s_rounds if x["round_id"] >= 1),
        "open_wait_ms": mean(x["draft_wait_ms"] for x in s_rounds if x["round_id"] == 0),
        "plain_wall_ms_per_round": 1e3 * sum(r["wall_s"] for r in p_recs) / len(p_rounds) if p_rounds else None,
        "c1_ms": c1, "curve": curve, "ideal": ideal,
        "fraction_realised": mid / ideal if mid and ideal else None,
        "identical_outputs": f"{identical}/{len(s_recs)}",
    }


def report(setup: str, header: dict, summaries: list[dict], costs: dict[str, dict], plain: Arm, synthetic: bool) -> str:
    out = []
    label = " (SYNTHETIC drafts: replay drafter)" if synthetic else ""
    out.append(f"### pair_speedup: {setup}{label}, {time.strftime('%Y-%m-%d')}")
    out.append("")
    out.append("; ".join(f"{k} {v}" for k, v in header.items()))
    out.append("")
    out.append("Per block (tokens/s = completion tokens / client wall time of the block's requests):")
    out.append("")
    out.append("| arm | block | order | spec tokens/s | plain tokens/s | ratio | ratio (server tokens/s) |")
    out.append("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for s in summaries:
        for row in s["per_block"]:
            order = "spec first" if row["spec_first"] else "plain first"
            out.append(f"| {s['name']} | {row['block'] + 1} | {order} | {row['spec_tps']:.1f} | {row['plain_tps']:.1f} | "
                       f"{row['ratio']:.3f} | {fmt(row['server_ratio'], '.3f')} |")
    out.append("")
    out.append("| arm | median of paired ratios [min, max] | same, server tokens/s | mean accepted length (bonus incl.) "
               "| acceptance by source | per-step acceptance a_1..a_k | drafts retained/round | rounds/request "
               "| faults | spec = plain outputs | ideal (verify-only) | fraction realised |")
    out.append("| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in summaries:
        sources = ", ".join(f"{k} {v:.2f}" for k, v in s["acceptance_by_source"].items()) or "-"
        steps = " ".join(fmt(a, ".2f", "-") for a in s["per_step_acceptance"])
        out.append(
            f"| {s['name']} | **{fmt(s['median_ratio'], '.3f')}** [{fmt(s['min_ratio'], '.3f')}, {fmt(s['max_ratio'], '.3f')}] "
            f"| {fmt(s['median_server_ratio'], '.3f')} | {fmt(s['mean_accepted_length'])} | {sources} | {steps} "
            f"| {fmt(s['drafts_retained_per_round'])} | {s['rounds'] / max(s['requests'], 1):.1f} | {s['faults']} "
            f"| {s['identical_outputs']} | {fmt(s['ideal'], '.3f')} | {fmt(s['fraction_realised'], '.2f')} |")
    out.append("")
    out.append("Per round (ms; means over all timed rounds unless 'median'; 'draft wait' = RoundInfo.draft_wait_ms of "
               "rounds >= 1, round 0's wait includes the drafter's open; hop + service overhead = median draft wait - "
               "median drafter compute):")
    out.append("")
    out.append("| arm | spec wall/round | spec verify | draft wait (mean / median) | round-0 wait "
               "| drafter compute (median) | hop + service overhead "
               "| plain wall/round | plain verify (C1) | bytes up/commit | bytes down/chain | bytes up/open | cost method |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for s in summaries:
        c = costs.get(s["name"], {})
        compute = c.get("commit_ms")
        wait = s["draft_wait_median_ms"]
        hop = wait - compute if wait is not None and compute is not None else None
        out.append(
            f"| {s['name']} | {fmt(s['spec_wall_ms_per_round'])} | {fmt(s['spec_verify_ms'])} "
            f"| {fmt(s['draft_wait_ms'])} / {fmt(wait)} "
            f"| {fmt(s['open_wait_ms'])} | {fmt(compute, '.3f')} | {fmt(hop)} | {fmt(s['plain_wall_ms_per_round'])} "
            f"| {fmt(s['c1_ms'])} | {fmt(c.get('commit_bytes'), '.0f')} | {fmt(c.get('chain_bytes'), '.0f')} "
            f"| {fmt(c.get('open_bytes'), '.0f')} | {c.get('method', 'n/a')} |")
    out.append("")
    out.append("Cost curve and ideal per chain length k (C(w) = mean verify_ms of w-row windows in the spec arm; "
               "C(1) = the plain arm's; R_k from the per-step acceptance):")
    out.append("")
    out.append("| arm | k | window w | rounds | C(w) ms | C(w)/C(1) | R_k | R_k / (C(k+1)/C(1)) |")
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in summaries:
        for row in s["curve"]:
            rounds = row["rounds"] if row["k"] else "plain"
            out.append(f"| {s['name']} | {row['k']} | {row['window']} | {rounds} | {fmt(row['verify_ms'])} | "
                       f"{fmt(row['cost_ratio'])} | {row['R_k']:.2f} | {fmt(row['ideal'], '.3f')} |")
    return "\n".join(out)


# --- setups ---------------------------------------------------------------------------------


def parse_alphas(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid alpha list {text!r}") from None
    if not values or any(not 0.0 <= a <= 1.0 for a in values):
        raise argparse.ArgumentTypeError(f"alphas must lie in [0, 1]: {text!r}")
    return values


def text_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ServiceError(f"{model_dir} has no tokenizer: the built-in text prompts need one")
    if count > len(PROMPTS):
        raise ServiceError(f"--prompts {count}: there are {len(PROMPTS)} built-in prompts")
    return [tokenizer.encode(p).ids for p in PROMPTS[:count]]


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


async def run_embedded(args, children: Children, workdir: Path) -> tuple[list[dict], dict, list[Arm], Arm, dict]:
    from shared.model.registry import resolve_model

    device = "cuda" if args.setup.startswith("gpu") else "cpu"
    model_dir = resolve_model(args.model)
    prompts = text_prompts(model_dir, args.prompts)
    run = Run(args, prompts)
    d_port, v_port, t_port, tv_port = free_port(), free_port(), free_port(), free_port()
    common = ["--model", str(model_dir), "--device", device, "--dtype", args.dtype]
    drafter_args = [*common, "--port", str(d_port)]
    if not args.global_index:
        drafter_args += ["--global-index-contexts", "0"]
    verifier_args = [*common, "--max-draft-tokens", str(args.max_draft_tokens), "--grace-s", "2"]
    log("starting services ...")
    children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *drafter_args])
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", *verifier_args, "--port", str(v_port),
                                "--drafter", f"127.0.0.1:{d_port}"])
    tap = None
    spec, plain = Arm("spec", True), Arm("plain", False)
    arms = [spec, plain]
    costs: dict = {}
    tap_records: list[dict] = []
    try:
        if not args.no_tap:
            children.start("tap-verifier", [sys.executable, "-m", "shared.cli", "verifier", *verifier_args,
                                            "--port", str(tv_port), "--drafter", f"127.0.0.1:{t_port}"])
            tap = Tap(f"127.0.0.1:{d_port}")
            await tap.start(t_port)
        waits = [children.wait_serving("drafter", f"127.0.0.1:{d_port}", args.startup_timeout),
                 children.wait_serving("verifier", f"127.0.0.1:{v_port}", args.startup_timeout)]
        if tap:
            waits.append(children.wait_serving("tap-verifier", f"127.0.0.1:{tv_port}", args.startup_timeout))
        await asyncio.gather(*waits)
        async with AsyncVerifierClient(f"127.0.0.1:{v_port}", timeout=args.request_timeout) as client:
            log(f"warm-up ({len(arms)} requests) ...")
            seconds = await run.warm_up(client, arms)
            log(f"  warm-up {seconds:.1f}s")
            await run.blocks(client, arms, children)
        if tap:
            log(f"tap pass: {len(prompts)} spec requests through the byte-counting tap (untimed) ...")
            try:
                async with AsyncVerifierClient(f"127.0.0.1:{tv_port}", timeout=args.request_timeout) as client:
                    for index in range(len(prompts)):
                        tap_records.append(await run.request(client, spec, index, "tap"))
            except ServiceError as error:
                log(f"  tap pass failed: {error}")
            if tap_records:
                c = tap_costs(tap.streams)
                timed = {r["prompt"]: r["token_ids"] for r in run.records if r["arm"] == "spec"}
                c["same_tokens_as_timed"] = sum(1 for r in tap_records if timed.get(r["prompt"]) == r["token_ids"])
                log("replaying the captured streams into an in-process Drafter (compute timing) ...")
                try:
                    c.update(replay_real_drafter(tap.streams, str(model_dir), device, args.dtype, args.threads))
                    c["method"] = ("bytes: tap, untimed pass; compute: in-process Drafter commit+propose "
                                   "on the captured messages")
                except Exception as error:  # report what was measured, name what was not
                    log(f"  in-process replay failed: {type(error).__name__}: {error}")
                    c["commit_ms"] = None
                    c["method"] = f"bytes: tap; compute: n/a ({type(error).__name__})"
                costs["spec"] = c
    finally:
        if tap is not None:
            await tap.stop()
    header = {"model": model_dir.name, "device": device, "dtype": args.dtype,
              "drafter": "tandem drafter (MTP + suffix)" + ("" if args.global_index else ", cross-session index off")}
    if tap_records:
        header["tap-pass outputs equal to the timed spec arm"] = (
            f"{costs.get('spec', {}).get('same_tokens_as_timed', 0)}/{len(tap_records)}")
    extra = {"tap": {k: v for k, v in costs.get("spec", {}).items()}, "tap_records": tap_records}
    return run.records, header, arms, plain, {"costs": costs, "extra": extra}


async def run_synthetic(args, children: Children, workdir: Path) -> tuple[list[dict], dict, list[Arm], Arm, dict]:
    from shared.model.registry import resolve_model

    gpu = args.setup.startswith("gpu")
    device = "cuda" if gpu else "cpu"
    dtype = args.dtype if args.dtype_given or not gpu else "bfloat16"
    shapes = args.random_shapes or ("qwen3-30b-a3b" if gpu and not args.model else None)
    if shapes:
        model_dir = workdir / f"{shapes}-shapes"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(SHAPES[shapes], indent=1))
        vocab = SHAPES[shapes]["vocab_size"]
        prompts = random_prompts(vocab, args.prompts, args.prompt_length, args.seed)
        model_args = ["--model", str(model_dir), "--random-weights"]
        model_name = f"random {dtype} weights at {shapes} shapes, random prompts of {args.prompt_length} ids"
    else:
        model_dir = resolve_model(args.model)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = text_prompts(model_dir, args.prompts)
        model_args = ["--model", str(model_dir)]
        model_name = model_dir.name
    run = Run(args, prompts)
    r_port, v_port = free_port(), free_port()
    log("starting the verifier ...")
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", *model_args, "--device", device,
                                "--dtype", dtype, "--port", str(v_port), "--drafter", f"127.0.0.1:{r_port}",
                                "--max-draft-tokens", str(args.max_draft_tokens), "--grace-s", "2"])
    await children.wait_serving("verifier", f"127.0.0.1:{v_port}", args.startup_timeout)
    plain = Arm("plain", False)
    spec_arms = [Arm(f"synthetic alpha={a:g}", True, a) for a in args.alpha]
    arms = [plain, *spec_arms]
    stats_path = workdir / "replay_stats.jsonl"
    async with AsyncVerifierClient(f"127.0.0.1:{v_port}", timeout=args.request_timeout) as client:
        log(f"recording the reference: {len(prompts)} plain requests ...")
        await run.request(client, plain, 0, "warmup-ref")
        references = []
        for index in range(len(prompts)):
            record = await run.request(client, plain, index, "ref")
            references.append({"prompt_ids": prompts[index], "token_ids": record["token_ids"]})
        reference_path = workdir / "reference.json"
        reference_path.write_text(json.dumps({"label": "synthetic", "vocab_size": vocab, "references": references}))
        children.start("replay-drafter", [sys.executable, str(REPO / "bench" / "replay_drafter.py"), "--port", str(r_port),
                                          "--reference", str(reference_path), "--alpha", str(args.alpha[0]),
                                          "--seed", str(args.seed), "--max-drafts", str(args.max_draft_tokens),
                                          "--stats", str(stats_path)])
        await children.wait_serving("replay-drafter", f"127.0.0.1:{r_port}", args.startup_timeout)
        log(f"warm-up ({len(arms)} requests) ...")
        seconds = await run.warm_up(client, arms)
        log(f"  warm-up {seconds:.1f}s")
        await run.blocks(client, arms, children)
    children.stop("replay-drafter")
    stats = replay_stats(stats_path)
    costs = {}
    for arm in spec_arms:
        timed = [s for s in stats if s["session_id"].startswith("spec-b") and s["alpha"] == arm.alpha]
        c = synthetic_costs(timed)
        c["method"] = "replay drafter, timed runs: ByteSize per message, compute = received -> chain built"
        costs[arm.name] = c
    reference_ok = sum(1 for r in run.records if r["speculation"] and r["token_ids"] == references[r["prompt"]]["token_ids"])
    header = {"model": model_name, "device": device, "dtype": dtype, "drafter": "bench/replay_drafter.py (synthetic)",
              "spec outputs equal to the reference": f"{reference_ok}/{sum(1 for r in run.records if r['speculation'])}"}
    return run.records, header, arms, plain, {"costs": costs, "extra": {"replay_stats": stats, "references": references}}


async def main_async(args) -> int:
    synthetic = args.setup.endswith("synthetic")
    with tempfile.TemporaryDirectory(prefix="pair_speedup_") as tmp:
        workdir = Path(tmp)
        children = Children(workdir, args.threads)
        started = time.perf_counter()
        load_before = os.getloadavg()[0]
        try:
            runner = run_synthetic if synthetic else run_embedded
            records, header, arms, plain, more = await runner(args, children, workdir)
        except (ServiceError, FileNotFoundError) as error:
            log(f"error: {error}")
            return 1
        finally:
            children.stop()
        header = {
            **header, "blocks": args.blocks, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "max_draft_tokens": args.max_draft_tokens, "temperature": args.temperature, "mode": args.mode,
            "seed": args.seed, "threads per service": args.threads or "torch default", "wall": f"{time.perf_counter() - started:.0f}s", "cpus": os.cpu_count(),
            "1-min load average before/after": f"{load_before:.1f}/{os.getloadavg()[0]:.1f}",
        }
    payload = {"label": "synthetic" if synthetic else "real drafter", "setup": args.setup, "header": header,
               "args": dict(vars(args)), "costs": more["costs"], "records": records, **more["extra"]}
    if args.out:  # raw records first: they survive a failure of the analysis
        Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
    summaries = []
    for arm in arms:
        if arm is plain:
            continue
        summary = analyse(records, arm, plain, args.blocks, args.max_draft_tokens)
        summary["name"] = arm.name
        summaries.append(summary)
    print(report(args.setup, header, summaries, more["costs"], plain, synthetic))
    if args.out:
        payload["summaries"] = summaries
        Path(args.out).write_text(json.dumps(payload, indent=1, default=str))
        log(f"raw records written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--setup", choices=SETUPS, default="cpu-embedded")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="built-in Python-code prompts (random ids for gpu-synthetic)")
    parser.add_argument("--prompt-length", type=int, default=128, help="random-weight models: random prompt length")
    parser.add_argument("--random-shapes", choices=sorted(SHAPES), default=None,
                        help="synthetic setups: random weights at these shapes (gpu-synthetic default: qwen3-30b-a3b; "
                             "cpu-synthetic default: the embedded model)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--mode", choices=("exact", "probabilistic"), default="exact")
    parser.add_argument("--seed", type=int, default=0, help="request seeds are seed + prompt index")
    parser.add_argument("--alpha", type=parse_alphas, default=[0.6, 0.8, 0.9], help="synthetic setups: acceptance per draft")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model; gpu-synthetic: random 30B shapes)")
    parser.add_argument("--dtype", default=None, help="default float32 (embedded) / bfloat16 (gpu-synthetic)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads per service (OMP_NUM_THREADS); default 1 on CPU setups "
                             "(two services on a small shared CPU: OpenMP barriers stall under oversubscription), "
                             "torch's default on GPU setups; 0 = torch's default")
    parser.add_argument("--global-index", action="store_true", help="keep the drafter's cross-session suffix index")
    parser.add_argument("--no-tap", action="store_true", help="embedded setups: skip the tap pass (no bytes/compute)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a service gets to become SERVING")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one request, seconds")
    parser.add_argument("--out", default=None, help="write the raw per-request records (JSON) here")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.setup.startswith("cpu") else 0
    args.dtype_given = args.dtype is not None
    args.dtype = args.dtype or "float32"
    if args.blocks < 1 or args.prompts < 1 or args.max_new_tokens < 1 or args.max_draft_tokens < 1:
        parser.error("--blocks, --prompts, --max-new-tokens and --max-draft-tokens must be >= 1")
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
