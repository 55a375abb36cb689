"""Three drafter processes behind one address; load spreads; losing one loses no request."""

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest

from shared.health import wait_serving
from shared.model import save_checkpoint
from shared.protocol import verifier_pb2_grpc
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

from ..verifier_service.conftest import generate, request

PROMPT = [3, 14, 15, 92, 65]


def proposals(metrics_port) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tandem_drafter_proposals_total{"))


@pytest.fixture
def drafters(tmp_path, tiny_mtp_model, free_port):
    save_checkpoint(tiny_mtp_model, tmp_path / "tiny")
    procs = []
    for _ in range(3):
        port, metrics = free_port(), free_port()
        env = dict(os.environ, TANDEM_DRAFTER_MODEL=str(tmp_path / "tiny"), TANDEM_DRAFTER_PLANNER="mtp",
                   OTEL_SDK_DISABLED="true")
        proc = subprocess.Popen([sys.executable, "-m", "drafter_service", "--port", str(port),
                                 "--metrics-port", str(metrics)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append((proc, port, metrics))
    yield procs
    for proc, _, _ in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def test_load_spreads_over_replicas_and_one_can_die(drafters, tiny_mtp_model):
    for process, port, _ in drafters:
        await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", timeout=60, process=process, name="drafter")
    target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port, _ in drafters)
    verifier = VerifierServer(VerifierSettings(port=0, drafter=target, drafter_deadline_ms=2000.0, governor=False), model=tiny_mtp_model)
    port = await verifier.start()
    await verifier.wait_loaded()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            reqs = [request(PROMPT, 24, temperature=0.8, seed=seed) for seed in range(9)]
            results = await asyncio.gather(*(generate(stub, r) for r in reqs[:6]))
            counts = [proposals(metrics) for _, _, metrics in drafters]
            assert all(c > 0 for c in counts), counts  # every replica served streams
            # Kill one replica while three requests are in flight.
            running = [asyncio.create_task(generate(stub, r)) for r in reqs[6:]]
            await asyncio.sleep(0.05)
            victim = drafters[0][0]
            victim.send_signal(signal.SIGKILL)
            results += await asyncio.gather(*running)
            for req, (tokens, final, _) in zip(reqs, results):
                assert final.finish_reason == "length" and len(tokens) == 24
                req.speculation.disable = True
                plain, _, _ = await generate(stub, req)
                assert tokens == plain  # exact-mode output unchanged
            survivors = [proposals(metrics) for _, _, metrics in drafters[1:]]
            assert all(c > 0 for c in survivors)
    finally:
        await verifier.stop(0)
