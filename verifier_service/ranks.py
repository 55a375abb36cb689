"""A verifier split over processes (DESIGN §13): rank 0 is the service; ranks 1..N-1 are
followers it starts, each loading its share of the model and running every step rank 0 runs.

Rank 0 (`Ranks.start`) picks the group's rendezvous address, starts the followers (`python -m
verifier_service.ranks`: a fresh interpreter each, inheriting no CUDA state and importing
nothing of the caller's main module), joins the group and loads its share; each
follower (`follower_main`) joins, loads its share, builds the same engine from the same settings
(`engine_options`: both sides build it alike, so the graphs they capture and the KV pools they
size match) and follows. At the end rank 0 tells them to stop and waits for them; a follower that
dies takes the verifier out of service (`Ranks.dead`): without it no step can finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import structlog
import torch

from shared.logs import configure_logging
from shared.model import DTYPES, load_model
from shared.model.parallel.group import NCCL_ENV, ModelGroup, free_address, rank_device
from shared.model.parallel.lockstep import follow
from shared.model.parallel.shard import Shard
from shared.model.registry import resolve_model
from shared.threads import ThreadPlan, use_device, use_threads
from verifier_service.settings import VerifierSettings

log = structlog.get_logger("verifier")
JOIN_TIMEOUT_S = 30.0


def engine_options(s: VerifierSettings, model) -> dict:
    """The Engine's keyword arguments from the settings (every rank builds its engine from these)."""
    config = model.config
    return dict(
        max_context=min(s.max_context or config.max_position_embeddings, config.max_position_embeddings),
        prefill_chunk=s.prefill_chunk, fused=s.fused, cuda_graphs=s.cuda_graphs, pdl=s.pdl != "off",
        expert_prefetch=s.expert_prefetch, max_sessions=s.max_sessions, max_window=s.max_draft_tokens_limit + 1,
        max_batch_rows=s.max_batch_rows, verify_window=s.max_draft_tokens + 1, row_invariant=s.row_invariant,
        kv_block_size=s.kv_block_size, kv_cache_tokens=s.kv_cache_tokens, kv_memory_fraction=s.kv_memory_fraction,
    )


def load_share(s: VerifierSettings, shard: Shard | None, device: torch.device | str):
    """This process's model: the whole trunk, or a rank's share of it."""
    return load_model(resolve_model(s.model), device=device, dtype=DTYPES[s.dtype], num_expert_slots=s.num_expert_slots or None,
                      random_weights=s.random_weights, parts="trunk", quantize=s.quantize, shard=shard)


def rank_threads(s: VerifierSettings) -> ThreadPlan:
    """Each rank's torch threads on the CPU: --cpu-threads, else an equal share of the cores (N
    processes each as wide as the machine would stall each other's spinning threads)."""
    if s.device != "cpu":
        return ThreadPlan(None, None)
    count = s.cpu_threads or max(1, (os.cpu_count() or 1) // s.parallel)
    return ThreadPlan(count, count)


def watch_parent(period_s: float = 1.0) -> threading.Thread:
    """A follower leaves when rank 0's process is gone (killed, crashed, failed to load): it would
    otherwise wait in a collective until the group's timeout."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period_s)
            if os.getppid() != parent:
                log.error("rank 0 is gone; this follower leaves")
                os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def follower_main(s: VerifierSettings, rank: int, address: str) -> None:
    """A follower process: join, load the rank's share, build the engine, follow rank 0 to the end.
    It ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a supervisor signals the whole process
    group): rank 0 drains its requests, which needs every rank, then tells the followers to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent()
    os.environ.update(NCCL_ENV)
    configure_logging()
    structlog.contextvars.bind_contextvars(rank=rank)  # (its lines share rank 0's stream)
    threads = rank_threads(s).full
    if threads is not None:
        use_threads(threads)
    use_device(str(rank_device(s.device, rank)))
    from verifier_service.engine import Engine  # (after the environment is set)

    shard = Shard(rank, s.parallel, s.parallel_dense)
    device = rank_device(s.device, rank)
    group = ModelGroup(shard, address, device)
    try:
        model = load_share(s, shard, device)
        engine = Engine(model, **engine_options(s, model), group=group)
        calls = follow(engine.runner, group)
    except BaseException:
        group.close(meet=False)  # (rank 0 is not at a meeting: it sees this process end)
        raise
    log.info("follower stopped", rank=rank, calls=calls)
    group.close()


class Ranks:
    """Rank 0's view of the followers: start them, join the group, stop them at the end."""

    def __init__(self, s: VerifierSettings) -> None:
        if s.parallel < 2:
            raise ValueError(f"parallel {s.parallel}: nothing to split")
        if s.device != "cpu" and torch.cuda.is_available():
            base = torch.device(s.device).index or 0
            if base + s.parallel > torch.cuda.device_count():
                raise ValueError(f"parallel {s.parallel} from {s.device} needs GPUs up to cuda:{base + s.parallel - 1}; "
                                 f"this host has {torch.cuda.device_count()}")
        self.settings = s
        self.address = free_address()
        self.processes: list[subprocess.Popen] = []
        self.group: ModelGroup | None = None

    def start(self) -> ModelGroup:
        """Start the followers and join the group as rank 0 (blocks until every rank joined)."""
        os.environ.update(NCCL_ENV)  # (the followers inherit it)
        s = self.settings
        settings_json = json.dumps(dataclasses.asdict(s))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        for rank in range(1, s.parallel):
            command = [sys.executable, "-m", "verifier_service.ranks", "--rank", str(rank), "--address", self.address]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, text=True)
            process.stdin.write(settings_json)  # (the settings may hold secrets: not on the command line)
            process.stdin.close()
            self.processes.append(process)
        device = rank_device(s.device, 0)
        self.group = ModelGroup(Shard(0, s.parallel, s.parallel_dense), self.address, device)
        return self.group

    def dead(self) -> list[str]:
        """Followers that ended (a verifier missing one cannot step)."""
        return [f"rank {rank} (exit code {p.returncode})" for rank, p in enumerate(self.processes, 1)
                if p.poll() is not None]

    def stop(self, *, told: bool = True) -> None:
        """At the end. told: the engine told the followers to stop — leave the group with them,
        then wait for them to end (terminate a straggler). Otherwise (rank 0 failed before its
        engine was built) they are somewhere in start-up: kill them (they ignore SIGTERM), then
        leave."""
        if not told:
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
        if self.group is not None:
            self.group.close(meet=told)
            self.group = None
        for rank, process in enumerate(self.processes, 1):
            try:
                process.wait(JOIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("follower did not stop; killing it", rank=rank)
                process.kill()
                process.wait(5)


def main(argv: list[str] | None = None) -> None:
    """A follower's entry point (started by rank 0; the settings come on stdin as JSON)."""
    parser = argparse.ArgumentParser(description="a follower rank of a verifier split over processes")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--address", required=True)
    args = parser.parse_args(argv)
    settings = VerifierSettings(**json.loads(sys.stdin.read()))
    follower_main(settings, args.rank, args.address)


if __name__ == "__main__":
    main()
