"""Service start-up: a busy port, a busy metrics port or a missing model stops the start with
one line naming the setting (exit status 2 from the CLI), and nothing is left half-started."""

import socket
import subprocess
import sys

import pytest

from shared.service import StartupError
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings


def busy_port() -> socket.socket:
    """A listening TCP socket on a free loopback port (close it when done)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


async def test_a_second_service_on_a_busy_port_refuses_to_start(tiny_mtp_model):
    first = VerifierServer(VerifierSettings(port=0), model=tiny_mtp_model)
    port = await first.start()
    try:
        second = VerifierServer(VerifierSettings(port=port), model=tiny_mtp_model)
        with pytest.raises(StartupError, match=f"port = {port}"):
            await second.start()
    finally:
        await first.stop(0)


async def test_a_busy_metrics_port_refuses_to_start_and_binds_nothing(tiny_mtp_model):
    with busy_port() as taken:
        metrics_port = taken.getsockname()[1]
        server = VerifierServer(VerifierSettings(port=0, metrics_port=metrics_port), model=tiny_mtp_model)
        with pytest.raises(StartupError, match=f"metrics_port = {metrics_port}"):
            await server.start()
    # the gRPC port it had bound was never served: starting on it again works
    again = VerifierServer(VerifierSettings(port=0), model=tiny_mtp_model)
    await again.start()
    await again.stop(0)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.cli", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_cli_start_up_failures_are_one_line_and_exit_2(service):
    with busy_port() as taken:
        port = taken.getsockname()[1]
        # (a plain listening socket, not a gRPC server: the bind must fail either way)
        busy = run_cli(service, "--port", str(port))
    missing = run_cli(service, "--model", "/nonexistent/model", "--port", "0")
    for result, fragment in ((busy, f"port = {port}"), (missing, "model = /nonexistent/model")):
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and fragment in errors[0], result.stderr
        assert "Traceback" not in result.stderr
