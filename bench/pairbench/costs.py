"""Drafter cost per round: bytes each way and drafter compute.

Real drafter: from the tap's captured streams (bytes) and their replay into an in-process
Drafter (compute). Replay drafter: from the stats file bench/replay_drafter.py writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from shared.protocol import drafter_pb2

from .common import mean, median


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

    from drafter_service.drafter import Drafter
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
        drafter = Drafter(loaded, DrafterSettings(global_index_mb=0, device=device, dtype=dtype))
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
