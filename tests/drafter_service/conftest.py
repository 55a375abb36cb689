"""Fixtures: a real drafter and a real verifier on loopback port 0, in this process."""

from __future__ import annotations

import grpc
import pytest

from drafter_service.server import DrafterServer, timed
from drafter_service.settings import DrafterSettings
from shared.model import load_model
from shared.protocol import verifier_pb2_grpc
from verifier_service.server import VerifierServer
from shared.worker import ModelWorker
from verifier_service.settings import VerifierSettings

@pytest.fixture(scope="session")
def demo_model():
    return load_model()


class Pair:
    def __init__(self):
        self.drafter: DrafterServer | None = None
        self.verifier: VerifierServer | None = None
        self.channel = None

    async def start(self, model, /, *, tokenizer=None, drafter_settings=None, **verifier_settings):
        self.drafter = DrafterServer(DrafterSettings(port=0, **(drafter_settings or {})), model=model)
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

    async def stop(self):
        if self.channel is not None:
            await self.channel.close()
        if self.verifier is not None:
            await self.verifier.stop(0)
        if self.drafter is not None:
            await self.drafter.stop(0)


@pytest.fixture
async def pair():
    p = Pair()
    yield p
    await p.stop()


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
