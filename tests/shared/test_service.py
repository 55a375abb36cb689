"""Service start-up: a busy port, a busy metrics port or a missing model stops the start with
one line naming the setting (exit status 2 from the CLI), and nothing is left half-started."""

import asyncio
import os
import time
import socket
import subprocess
import sys

import grpc
import pytest

from shared.service import STALE_AFTER_S, ServiceServer, StartupError, server_options, sweep_private_dirs
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


@pytest.mark.parametrize("service", ["verifier", "drafter", "gateway"])
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
        assert "add_port" not in result.stderr  # (gRPC core's raw log line of a failed bind)


class PeerEcho(ServiceServer):
    """A bare service whose one method answers the caller's address (host:port of its connection)."""

    service_name = "test.PeerEcho"

    def register(self) -> None:
        async def peer(request: bytes, context) -> bytes:
            return context.peer().encode()

        handler = grpc.unary_unary_rpc_method_handler(peer)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.service_name, {"Peer": handler}),))

    async def load(self) -> None:
        pass

    @property
    def metrics_registry(self):
        return None


@pytest.mark.parametrize("age_s", [0.0, 0.3])
async def test_clients_reconnect_after_the_maximum_connection_age(age_s):
    """New replicas behind a DNS name are only seen when a client reconnects (issue 15): with
    a maximum age the server sends GOAWAY and the channel's next call uses a new connection
    (a new client port); without one the connection stays."""
    server = PeerEcho(VerifierSettings(port=0, max_connection_age_s=age_s))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.PeerEcho/Peer")
            first = await call(b"")
            await asyncio.sleep(2.0)  # well past the age plus gRPC's 10% jitter, on a loaded machine too
            second = await call(b"")
        assert (first != second) == (age_s > 0), (first, second)
    finally:
        await server.stop(0)


class LoadsUntilClosed(PeerEcho):
    """A service whose load waits until close() takes its workers away, then fails (as a
    verifier's load fails with LoopClosed when it is stopped mid-load)."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.closed = asyncio.Event()

    async def load(self) -> None:
        await self.closed.wait()
        raise RuntimeError("the workers are gone")

    async def close(self) -> None:
        self.closed.set()
        await asyncio.sleep(0)  # (the load runs on and fails before the stop goes on)


async def test_a_stop_while_loading_ends_the_load_without_an_unretrieved_error():
    import gc

    reported = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context.get("message", "")))
    try:
        server = LoadsUntilClosed(VerifierSettings(port=0))
        await server.start()
        await server.stop(0)
        assert server.loaded.done()
        del server
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not [message for message in reported if "never retrieved" in message], reported


def test_the_connection_age_is_validated():
    with pytest.raises(ValueError, match="max_connection_age_s"):
        VerifierSettings(max_connection_age_s=-1)
    assert ("grpc.max_connection_age_ms", 60000) in server_options(VerifierSettings())


@pytest.mark.parametrize("service", ["verifier", "drafter", "gateway"])
def test_help_lists_every_setting(service):
    """`tandem <service> --help` works (argparse formats help text with %: a "25%" in a
    setting's help once crashed it) and names every setting."""
    import dataclasses
    import importlib

    settings = importlib.import_module(f"{service}_service.settings")
    cls = next(v for v in vars(settings).values() if dataclasses.is_dataclass(v))
    result = run_cli(service, "--help")
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(cls):
        assert "--" + field.name.replace("_", "-") in result.stdout


@pytest.mark.parametrize("after_s", [0.4, 1.5, 3.0])  # (past the interpreter's own start: into torch's import, tandem's)
def test_ctrl_c_during_start_up_ends_the_service_without_a_traceback(after_s):
    """Ctrl-C while a service imports, loads or binds (before it handles SIGINT itself, which
    drains): one line and status 130 — or, once it handles SIGINT, a drain and status 0. (A
    KeyboardInterrupt inside numpy's import once left it half-imported: a RecursionError.)"""
    import signal
    import time

    # (SIGINT as a terminal delivers it: a suite run in the background, as `cmd &` in a script,
    # would hand the child SIGINT ignored, and Python then never raises KeyboardInterrupt)
    service = subprocess.Popen([sys.executable, "-m", "shared.cli", "verifier", "--port", "0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(after_s)
        service.send_signal(signal.SIGINT)
        _, err = service.communicate(timeout=60)
    finally:
        if service.poll() is None:
            service.kill()
    # (130, or ended by the SIGINT itself, which a shell reports as 130 too)
    assert service.returncode in (0, 130, -signal.SIGINT) and "Traceback" not in err, err
    if service.returncode != 0:
        assert "tandem verifier: interrupted" in err


@pytest.mark.parametrize("wrapped", [False, True])
def test_ctrl_c_wrapped_by_an_import_still_reads_as_an_interrupt(monkeypatch, capsys, wrapped):
    """A Ctrl-C that lands while Python builds a class (torch's imports build hundreds) reaches
    the CLI as the cause of a RuntimeError ("Error calling __set_name__"): still one line and
    status 130; an error with no interrupt under it still raises."""
    from shared import cli

    def interrupted_import(_args):
        if not wrapped:
            raise KeyboardInterrupt
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance") from interrupt

    monkeypatch.setattr(cli, "_run_service", lambda name, args: interrupted_import(args))
    assert cli.main(["verifier", "--port", "0"]) == 130
    assert "tandem verifier: interrupted" in capsys.readouterr().err

    def plain_failure(name, args):
        raise RuntimeError("not an interrupt")

    monkeypatch.setattr(cli, "_run_service", plain_failure)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        cli.main(["verifier", "--port", "0"])


def test_ctrl_c_while_the_command_line_is_read_is_one_line_too(monkeypatch, capsys):
    from shared import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["verifier"]) == 130
    assert capsys.readouterr().err == "tandem: interrupted\n"


def test_a_killed_services_socket_directory_is_swept_and_nothing_else(tmp_path):
    """What a SIGKILLed verifier leaves (a private directory, its socket answered by nobody) goes
    at the next start; a live server's, a fresh one's, one holding more, another name stay."""
    old = time.time() - 2 * STALE_AFTER_S

    def private(name: str, *, listening: bool = False, mtime: float = old, extra: bool = False):
        folder = tmp_path / name
        folder.mkdir(mode=0o700)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(folder / "local.sock"))
        if listening:
            server.listen()
        else:
            server.close()  # (the file stays: nobody answers it)
        if extra:
            (folder / "notes.txt").write_text("mine")
        os.utime(folder, (mtime, mtime))
        return folder, server

    dead, _ = private("tandem-0123456789abcdef")
    live, server = private("tandem-00000000000000aa", listening=True)
    fresh, _ = private("tandem-00000000000000bb", mtime=time.time())
    fuller, _ = private("tandem-00000000000000cc", extra=True)
    other, _ = private("tandem-test-abc")
    try:
        assert sweep_private_dirs(str(tmp_path)) == [str(dead)]
        assert not dead.exists() and all(p.exists() for p in (live, fresh, fuller, other))
    finally:
        server.close()
