"""A verifier split over two processes (DESIGN §13), on the CPU with gloo, driven as the service
drives it: rank 0 in this process, the follower started by `Ranks` (`python -m
verifier_service.ranks`), both loading their share of a real checkpoint.

What must hold: the split model's logits equal one process's to float32 rounding (the routed
experts' sum is one process's bits; the o projection adds the ranks' partials in another order);
its rows are row-invariant (a window's rows and a batch's are their one-row steps' bits), so
exact mode is token-identical to plain decoding; a lost follower takes the verifier down.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.model import load_model
from shared.model.runner import Window
from verifier_service.engine import Engine
from verifier_service.ranks import Ranks, engine_options, load_share
from verifier_service.server import RANK_LOST_EXIT
from verifier_service.settings import VerifierSettings

from .conftest import ScriptedDrafter, chain, drafted_as_plain, generate, request, sampled_chain

PROMPT = [3, 14, 15, 92, 65]
LOGIT_TOLERANCE = 1e-4  # float32 logits of a tiny model: a reordered sum moves them by ~1e-6


def settings_for(path: Path, parallel: int, **overrides) -> VerifierSettings:
    return VerifierSettings(model=str(path), parallel=parallel, max_sessions=4, kv_cache_tokens=2048, **overrides)


def steps(engine: Engine) -> list[torch.Tensor]:
    """Logits of a prefill's next row, a window of 4 rows, and a batch of two sessions' windows."""
    r = engine.runner
    first, _ = r.acquire(128)
    r.prefill([Window(first, list(range(1, 20)), 0)])
    out = [r.run([Window(first, [5], 19)]).logits.clone()]
    r.settle(first)
    out.append(r.run([Window(first, [7, 8, 9, 10], 20)]).logits.clone())
    r.settle(first)
    second, _ = r.acquire(128)
    r.prefill([Window(second, [3, 4], 0)])
    out.append(r.run([Window(first, [11], 24), Window(second, [6, 2, 1], 2)]).logits.clone())
    r.release(second)
    r.release(first)
    return out


def one_row_steps(engine: Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits of `tokens` decoded one row a step after `prompt`."""
    r = engine.runner
    slot, _ = r.acquire(128)
    r.prefill([Window(slot, prompt, 0)])
    rows = []
    for i, t in enumerate(tokens):
        rows.append(r.run([Window(slot, [t], len(prompt) + i)]).logits.clone())
        r.settle(slot)  # (the hybrid family's linear state moves on only when a step is kept)
    r.release(slot)
    return torch.cat(rows)


@pytest.fixture
def split_engine(request, split_checkpoint, split_hybrid_checkpoints):
    """(rank 0's engine of the model split over 2 processes, one process's engine, all experts
    resident): the qwen3_moe checkpoint, or (param) a hybrid one by name, then options: "whole"
    (--parallel-dense whole), "slots" (2 of each rank's 4 experts per layer in device slots)."""
    family, *options = getattr(request, "param", "qwen3_moe").split()
    path = split_checkpoint[0] if family == "qwen3_moe" else split_hybrid_checkpoints[family]
    s = settings_for(path, 2, parallel_dense="whole" if "whole" in options else "split",
                     num_expert_slots=2 if "slots" in options else 0)
    one_process = replace(s, parallel=1, num_expert_slots=0)
    whole = load_share(one_process, None, "cpu")
    one = Engine(whole, **engine_options(one_process, whole))
    ranks = Ranks(s)
    group = ranks.start()
    engine = None
    try:
        share = load_share(s, group.shard, group.device)
        engine = Engine(share, **engine_options(s, share), group=group)
        yield engine, one
    finally:
        if engine is not None:
            engine.shutdown()
        ranks.stop()
    assert ranks.dead() == ["rank 1 (exit code 0)"]  # the follower left when told


@pytest.mark.parametrize("split_engine", ["qwen3_moe", "qwen3_moe whole", "qwen3_moe slots", "hybrid"], indirect=True)
def test_split_steps_equal_one_process_to_rounding(split_engine):
    split, one = split_engine
    assert split.runner.path == one.runner.path == "fused"
    for a, b in zip(steps(split), steps(one)):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= LOGIT_TOLERANCE
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("split_engine", ["hybrid whole", "qwen3.5 whole", "qwen3.5 whole slots"], indirect=True)
def test_a_hybrid_model_split_by_experts_is_one_process_bit_for_bit(split_engine):
    """With the dense weights whole the hybrid family splits only its routed experts (each route
    one owner, the ranks' route outputs add exact zeros elsewhere), in prefill as in decode,
    with every expert resident or behind slots: every logit is one process's. (qwen3_moe so split is so for a step's rows too, but its
    one-process prefill sums a prompt's experts by another path: its prompt KV differs by
    rounding.)"""
    split, one = split_engine
    for a, b in zip(steps(split), steps(one)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("split_engine", ["qwen3_moe", "qwen3_moe whole", "qwen3.5"], indirect=True)
def test_split_rows_are_their_one_row_steps_bits(split_engine):
    split, _ = split_engine
    r = split.runner
    prompt, window = list(range(1, 12)), [40, 41, 42, 43, 44]
    alone = one_row_steps(split, prompt, window)
    slot, _ = r.acquire(128)
    r.prefill([Window(slot, prompt, 0)])
    other, _ = r.acquire(128)
    r.prefill([Window(other, [9, 9, 9], 0)])
    # the same window run as one step, beside another session's window
    rows = r.run([Window(other, [1, 2], 3), Window(slot, window, len(prompt))]).logits[2:7]
    assert torch.equal(rows, alone)
    r.release(slot)
    r.release(other)


async def test_split_verifier_serves_what_one_process_serves(servers, split_checkpoint):
    path, _ = split_checkpoint
    outputs = []
    for parallel in (1, 2):
        stub = await servers.start(None, model=str(path), parallel=parallel, max_sessions=4)
        results = await asyncio.gather(*(generate(stub, request([seed, *PROMPT], 16, temperature=t, seed=seed))
                                         for seed in range(3) for t in (0.0, 0.8)))
        outputs.append([tokens for tokens, _, _ in results])
        await servers.stop()
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 16 for tokens in outputs[1])


@pytest.mark.parametrize(("temperature", "num_expert_slots"), [(0.0, 0), (0.8, 0), (0.8, 2)])
async def test_exact_mode_split_over_processes_is_plain_decoding(servers, split_checkpoint, temperature,
                                                                 num_expert_slots, greedy_continuation):
    path, _ = split_checkpoint
    reference = load_model(path, parts="trunk")
    q = {t: 1 / 8 for t in range(0, 96, 12)}
    drafter = ScriptedDrafter(lambda s: sampled_chain(s, q, 3) if s.round_id % 3 else chain(
        s, greedy_continuation(reference, s.tokens, 3)))
    stub = await servers.start(None, drafter=drafter, model=str(path), parallel=2, num_expert_slots=num_expert_slots)
    for final in await drafted_as_plain(stub, PROMPT, 20, temperature=temperature, seeds=range(3)):
        assert final.stats.accepted > 0 and final.stats.rounds < 20  # drafts were accepted
        assert final.stats.drafter_faults == 0


async def test_exact_mode_split_hybrid_is_plain_decoding(servers, split_hybrid_checkpoints):
    q = {t: 1 / 8 for t in range(0, 96, 12)}
    drafter = ScriptedDrafter(lambda s: sampled_chain(s, q, 3))
    stub = await servers.start(None, drafter=drafter, model=str(split_hybrid_checkpoints["qwen3.5"]), parallel=2)
    for final in await drafted_as_plain(stub, PROMPT, 16, temperature=0.8, seeds=range(3)):
        assert final.stats.proposed > 0 and final.stats.drafter_faults == 0


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether process `pid` runs (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def split_verifier_process(split_checkpoint, tmp_path):
    """(the verifier's process, its follower's pid, its log path): `python -m verifier_service
    --parallel 2`, ready."""
    path, _ = split_checkpoint
    log_path = tmp_path / "verifier.log"
    with log_path.open("w") as log:
        verifier = subprocess.Popen([sys.executable, "-m", "verifier_service", "--model", str(path), "--parallel", "2",
                                     "--port", "0", "--kv-cache-tokens", "2048"], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # (its own process group, as under a terminal)
    try:
        deadline = time.monotonic() + 60
        while "verifier ready" not in log_path.read_text():
            assert verifier.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        (follower,) = children(verifier.pid)
        yield verifier, follower, log_path
    finally:
        if verifier.poll() is None:
            verifier.kill()
            verifier.wait()


def test_a_lost_follower_takes_the_verifier_down(split_verifier_process):
    verifier, follower, log_path = split_verifier_process
    os.kill(follower, signal.SIGKILL)
    assert verifier.wait(30) == RANK_LOST_EXIT
    assert "a follower rank ended" in log_path.read_text()


def test_a_signal_to_the_whole_process_group_drains_and_stops_every_rank(split_verifier_process):
    """Ctrl-C, `timeout` or a supervisor signal every process of the group: the follower keeps
    stepping while rank 0 drains, then stops when told."""
    verifier, follower, log_path = split_verifier_process
    os.killpg(verifier.pid, signal.SIGTERM)
    assert verifier.wait(30) == 0
    deadline = time.monotonic() + 10
    while alive(follower):
        assert time.monotonic() < deadline, "the follower outlived rank 0"
        time.sleep(0.1)
    text = log_path.read_text()
    assert "draining" in text and '"follower stopped"' in text, text[-2000:]


def test_a_follower_leaves_when_rank_0_is_gone(split_verifier_process):
    verifier, follower, log_path = split_verifier_process
    verifier.kill()
    verifier.wait()
    deadline = time.monotonic() + 20
    while alive(follower):
        assert time.monotonic() < deadline, "the follower outlived rank 0"
        time.sleep(0.2)


def processes_with(text: str) -> list[int]:
    """Running processes (not zombies) whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in command and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_a_model_the_ranks_cannot_split_fails_at_start_and_leaves_no_follower(split_checkpoint):
    """Every rank fails to load it (2 KV heads over 4 ranks): the verifier exits 2 at once naming
    the field, and no follower is left waiting in a collective."""
    path, _ = split_checkpoint
    verifier = subprocess.run([sys.executable, "-m", "verifier_service", "--model", str(path), "--parallel", "4",
                               "--port", "0"], capture_output=True, text=True, timeout=120)
    assert verifier.returncode == 2, verifier.stderr[-2000:]
    assert "num_key_value_heads (2) is not divisible by --parallel 4" in verifier.stderr
    (address,) = re.findall(r'"address": "(127\.0\.0\.1:\d+)", "event": "starting ranks"', verifier.stderr)
    deadline = time.monotonic() + 10
    while processes_with(f"--address {address}"):
        assert time.monotonic() < deadline, "a follower outlived its verifier"
        time.sleep(0.2)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(parallel=0), "parallel 0 must be >= 1"),
    (dict(parallel=2, parallel_dense="half"), "parallel_dense 'half'"),
    (dict(parallel=2, fused="off"), "fused"),
])
def test_settings_refuse_what_a_split_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        VerifierSettings(**overrides)


def test_a_model_in_memory_cannot_be_split(tiny_model):
    from verifier_service.server import VerifierService

    service = VerifierService(VerifierSettings(parallel=2), model=tiny_model)
    with pytest.raises(ValueError, match="cannot be split over processes"):
        asyncio.run(service.load())
    service.worker.shutdown()
