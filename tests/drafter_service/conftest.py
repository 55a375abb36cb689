"""Fixtures: a real drafter and a real verifier on loopback port 0, in this process."""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import grpc
import pytest
import torch

from drafter_service.server import DrafterServer, timed
from drafter_service.settings import DrafterSettings
from shared.model import load_model
from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, encode_hidden, verifier_pb2_grpc
from verifier_service.server import VerifierServer
from shared.worker import ModelWorker
from verifier_service.settings import VerifierSettings

from ..verifier_service.conftest import generate, request


@pytest.fixture(scope="session")
def demo_model():
    return load_model()


class Pair:
    """link: "grpc" (Draft streams on the drafter's port) or "local" (on its Unix socket:
    --local-socket / --drafter-socket)."""

    def __init__(self):
        self.drafter: DrafterServer | None = None
        self.verifier: VerifierServer | None = None
        self.channel = None
        self.socket_dir: str | None = None

    async def start(self, model, /, *, tokenizer=None, drafter_settings=None, link="grpc", **verifier_settings):
        drafter_settings = dict(drafter_settings or {})
        if link == "local":  # (a short path: a Unix socket's is at most 107 bytes)
            self.socket_dir = tempfile.mkdtemp(prefix="tandem-test-")
            drafter_settings["local_socket"] = verifier_settings["drafter_socket"] = f"{self.socket_dir}/d.sock"
        self.drafter = DrafterServer(DrafterSettings(port=0, **drafter_settings), model=model)
        port = await self.drafter.start()
        await self.drafter.wait_loaded()
        # A fixed generous deadline: the adaptive one (recent p95 + 5 ms) turns a slow CPU
        # moment into a plain round, which is correct but makes "every round drafted" flaky.
        verifier_settings.setdefault("drafter_deadline_ms", 2000.0)
        # Every round asks the drafter unless a test turns the governor on: whether speculation
        # pays on this machine at this moment must not decide what these tests see.
        verifier_settings.setdefault("governor", False)
        settings = VerifierSettings(port=0, drafter=f"127.0.0.1:{port}", **verifier_settings)
        self.verifier = VerifierServer(settings, model=model, tokenizer=tokenizer)
        vport = await self.verifier.start()
        await self.verifier.wait_loaded()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{vport}")
        return verifier_pb2_grpc.VerifierStub(self.channel)

    def local_streams(self) -> int | None:
        """Draft streams the drafter's local socket served (None: it has none)."""
        return self.drafter.local.served if self.drafter.local is not None else None

    async def stop(self):
        if self.channel is not None:
            await self.channel.close()
        if self.verifier is not None:
            await self.verifier.stop(0)
        if self.drafter is not None:
            await self.drafter.stop(0)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


@pytest.fixture
async def pair():
    p = Pair()
    yield p
    await p.stop()


@contextlib.asynccontextmanager
async def serve_drafter(model, planner="adaptive", **settings):
    """A drafter (draft-ahead off) on port 0 and a channel to it: (server, channel)."""
    server = DrafterServer(DrafterSettings(port=0, planner=planner, draft_ahead=False, **settings), model=model)
    port = await server.start()
    await server.wait_loaded()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.stop(0)


@pytest.fixture(name="serve_drafter", scope="session")
def serve_drafter_fixture():
    """serve_drafter(model, planner, **settings): async context manager → (server, channel)."""
    return serve_drafter


@pytest.fixture
def worker_jobs(monkeypatch):
    """The names of the functions the drafters run on their model workers, in order (a job
    timed by the service is named by the function it times)."""
    names = []
    run = ModelWorker.run

    async def recorded(self, fn, *args, **kwargs):
        job = args[0] if fn is timed else fn
        names.append(getattr(job, "__name__", repr(job)))
        return await run(self, fn, *args, **kwargs)

    monkeypatch.setattr(ModelWorker, "run", recorded)
    return names


def open_up(model, tokens, *, session_id="s", hidden=None, max_draft_tokens=2):
    rows = torch.zeros(len(tokens) - 1, model.config.hidden_size) if hidden is None else hidden
    return drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, open=drafter_pb2.DraftOpen(
        session_id=session_id, token_ids=tokens, hidden=encode_hidden(rows), max_draft_tokens=max_draft_tokens,
        max_new_tokens=8))


def commit_up(model, *, round_id=0, emitted=(5,), num_accepted=0, num_verified=0, num_rounds=0, **fields):
    return drafter_pb2.DraftUp(protocol_version=PROTOCOL_VERSION, commit=drafter_pb2.DraftCommit(
        round_id=round_id, num_accepted=num_accepted, num_verified=num_verified, emitted_token_ids=list(emitted),
        num_rounds=num_rounds, **fields,
        hidden=encode_hidden(torch.zeros(len(emitted), model.config.hidden_size))))


@pytest.fixture(name="open_up", scope="session")
def open_up_fixture():
    """open_up(model, tokens, *, session_id="s", hidden=None, max_draft_tokens=2): a DraftUp opening
    a session (zero hidden rows unless given)."""
    return open_up


@pytest.fixture(name="commit_up", scope="session")
def commit_up_fixture():
    """commit_up(model, *, round_id=0, emitted=(5,), num_accepted=0, num_verified=0, num_rounds=0,
    **fields): a DraftUp committing `emitted` (zero hidden rows)."""
    return commit_up


async def same_with_and_without(stub, prompt, n, temperature, seed, mode=common_pb2.MODE_EXACT):
    """(tokens with speculation, tokens without, the first call's final event, its rounds)."""
    req = request(prompt, n, temperature=temperature, seed=seed, mode=mode)
    spec, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    return spec, plain, final, rounds


@pytest.fixture(name="same_with_and_without", scope="session")
def same_with_and_without_fixture():
    """await same_with_and_without(stub, prompt, n, temperature, seed, mode=MODE_EXACT): one
    request with speculation and again without: (spec, plain, final, rounds)."""
    return same_with_and_without
