"""What both gRPC services share: the server lifecycle and the process entry point.

A `ServiceServer` binds its port (TLS when configured; or its front processes do, relaying
its stream method to its local socket: shared/front.py), registers health checking
(NOT_SERVING until the model is loaded) and reflection, starts the Prometheus endpoint,
loads the model in the background, and drains on stop: health NOT_SERVING while the port
stays open (so load balancers see it), new work refused with UNAVAILABLE, in-flight work
given `grace_s` to finish (a service may end it early, cleanly, near the limit), then the
port closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import security, telemetry
from shared.front import FrontConfig, FrontError, Fronts
from shared.local_stream import LocalStreamServer, answers
from shared.logs import configure_logging
from shared.metrics import serve_metrics

log = structlog.get_logger("tandem")
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC binds with SO_REUSEPORT by default, so a second service on a busy port would start and
# silently take half of the first one's connections: bind exclusively instead.
SERVER_OPTIONS = [*MESSAGE_OPTIONS, ("grpc.so_reuseport", 0)]


def server_options(settings) -> list[tuple[str, int]]:
    """SERVER_OPTIONS plus the maximum connection age: a client reconnects after it (streams
    already open run on: no age grace), and reconnecting re-resolves a DNS name, so replicas
    added behind one are reached within that age."""
    age_ms = round(settings.max_connection_age_s * 1000)
    return [*SERVER_OPTIONS, ("grpc.max_connection_age_ms", age_ms)] if age_ms > 0 else list(SERVER_OPTIONS)


class StartupError(Exception):
    """The service cannot start; the message names the setting and its value (one line)."""


def require_model(name_or_path: str | None) -> None:
    """StartupError unless the `model` setting names a checkpoint directory or a known model."""
    from shared.model.registry import resolve_model

    try:
        resolve_model(name_or_path)
    except FileNotFoundError as error:
        raise StartupError(f"model = {name_or_path}: {error}") from None


PRIVATE_PREFIX = "tandem-"  # a private socket's directory: tandem-<16 hex digits>, owner-only
PRIVATE_SOCKET = "local.sock"  # the socket in it
STALE_AFTER_S = 60.0  # a private directory whose socket has not answered for this long is a dead server's


def sweep_private_dirs(folder: str, now: float | None = None) -> list[str]:
    """Remove the private socket directories a killed service left in `folder` (a process gone
    without its stop: SIGKILL, a lost rank's exit): this user's, named as `local_path` names them,
    holding nothing but a socket that no server answers, untouched for STALE_AFTER_S (a service
    starting now binds its socket within moments of making its directory). The removed paths."""
    now = time.time() if now is None else now
    removed = []
    for entry in os.scandir(folder):
        name = entry.name
        if not (name.startswith(PRIVATE_PREFIX) and len(name) == len(PRIVATE_PREFIX) + 16
                and all(c in "0123456789abcdef" for c in name[len(PRIVATE_PREFIX):])):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if (not entry.is_dir(follow_symlinks=False) or info.st_uid != os.getuid()
                    or now - info.st_mtime < STALE_AFTER_S or os.listdir(entry.path) != [PRIVATE_SOCKET]):
                continue
            sock = os.path.join(entry.path, PRIVATE_SOCKET)
            if not stat.S_ISSOCK(os.lstat(sock).st_mode) or answers(sock):
                continue
            os.unlink(sock)
            os.rmdir(entry.path)
        except OSError:
            continue  # (another sweeper, or it changed under us: left as it is)
        removed.append(entry.path)
    return removed


class ServiceServer:
    """Subclasses set `service_name` and implement `make_service` and `register`."""

    service_name = ""  # fully-qualified gRPC service name, e.g. "tandem.v1.Verifier"
    front_method = ""  # the unary-stream method front processes relay (a service that may have fronts)

    def __init__(self, settings, *, interceptors=()) -> None:
        self.settings = settings
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=server_options(settings), interceptors=list(interceptors))
        self.port: int | None = None
        self.loaded: asyncio.Task | None = None
        self.metrics_server = None
        # The service's stream method on a Unix socket as well (its `local_socket` setting, for
        # clients on this host: shared/local_stream.py); set by the subclass.
        self.local: LocalStreamServer | None = None
        # Front processes serving the port instead of this process (shared/front.py: they relay
        # `front_method` to `local`), where the settings ask for them (`front_processes`).
        self.fronts: Fronts | None = None
        self._private_dir: str | None = None

    def local_path(self) -> str | None:
        """Where the subclass serves its stream method on this host: the `local_socket` setting,
        else, where front processes relay to it or it offers its callers a socket
        (`offer_local_socket`), one in an owner-only directory of this process's own (made at
        start, removed at stop); None: no local socket."""
        s = self.settings
        if getattr(s, "local_socket", None):
            return s.local_socket
        if not (getattr(s, "front_processes", 0) or self.offers_local()):
            return None
        self._private_dir = os.path.join(tempfile.gettempdir(), f"{PRIVATE_PREFIX}{secrets.token_hex(8)}")
        return os.path.join(self._private_dir, PRIVATE_SOCKET)

    def offers_local(self) -> bool:
        """Whether callers on this host are told of the local socket (`offer_local_socket`), so
        that they stream over it; never under TLS, which its callers chose."""
        s = self.settings
        return bool(getattr(s, "offer_local_socket", False)) and not s.tls_cert

    # -- subclass hooks -----------------------------------------------------------------

    def register(self) -> None:
        """Add the service's servicer to self.server."""
        raise NotImplementedError

    def preflight(self) -> None:
        """Check what can be checked before binding (e.g. that the model exists); raise
        StartupError naming the setting."""

    async def load(self) -> None:
        """Load the model; the base class marks the service SERVING afterwards."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the service holds (channels, workers) after the server stopped."""

    def begin_drain(self, finish_by: float) -> None:
        """Refuse new work; in-flight work should end by `finish_by` (time.monotonic())."""

    def in_flight(self) -> int:
        """Work the drain waits for before closing the port (default none)."""
        return 0

    @property
    def metrics_registry(self):
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------

    async def _load_then_serve(self) -> None:
        await self.load()
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.fronts is not None:
            self.fronts.set_health(True)

    async def start(self) -> int:
        self.register()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (self.service_name, reflection.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection(names, self.server)
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        s = self.settings
        self.preflight()
        credentials = security.server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)
        if getattr(s, "front_processes", 0):
            self.fronts = Fronts(s.front_processes, FrontConfig(
                address=s.address, service_name=self.service_name, method=self.front_method, socket=self.local.path,
                message_limit=MAX_MESSAGE_BYTES, max_connection_age_s=s.max_connection_age_s,
                auth_token=s.auth_token, tls_cert=s.tls_cert, tls_key=s.tls_key, tls_client_ca=s.tls_client_ca))
        if self.fronts is None:
            try:
                self.port = security.add_port(self.server, s.address, credentials)
            except RuntimeError as error:
                raise StartupError(f"port = {s.port}, host = {s.host}: {error}") from None
        try:  # before the gRPC server starts: nothing is half-started when this port is busy
            self.metrics_server = serve_metrics(self.metrics_registry, s.host, s.metrics_port)
        except OSError as error:
            raise StartupError(f"metrics_port = {s.metrics_port}: cannot serve /metrics on {s.host}: "
                               f"{error.strerror or error}") from None
        if self.fronts is None:
            await self.server.start()
        self.loaded = asyncio.create_task(self._load_then_serve())
        if self.local is not None:
            try:
                if self._private_dir is not None:
                    removed = sweep_private_dirs(os.path.dirname(self._private_dir))
                    if removed:
                        log.info("removed dead services' socket directories", paths=removed)
                    os.mkdir(self._private_dir, 0o700)
                await self.local.start()
            except OSError as error:
                await self.stop(0)
                raise StartupError(f"local_socket = {self.local.path}: {error}") from None
            log.info("serving on a local socket", path=self.local.path)
        if self.fronts is not None:
            try:
                self.port = await self.fronts.start()
            except FrontError as error:
                await self.stop(0)
                raise StartupError(f"port = {s.port}, host = {s.host}: {error}") from None
            log.info("front processes serve the port", processes=self.fronts.count, port=self.port)
        return self.port

    async def wait_loaded(self) -> None:
        await self.loaded

    async def stop(self, grace: float | None = None) -> None:
        grace = self.settings.grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self.fronts is not None:
            self.fronts.set_health(False)
        deadline = time.monotonic() + grace
        self.begin_drain(deadline - min(1.0, grace / 4))  # the last moments: final events go out
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.fronts is None:
            await self.server.stop(max(0.0, deadline - time.monotonic()))
        else:
            await self.fronts.stop(max(0.0, deadline - time.monotonic()))
        if self.local is not None:
            await self.local.close()
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        await self.close()
        await self._end_loading()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()

    async def _end_loading(self) -> None:
        """A stop while the model loads ends the load: its failure once close() has taken the
        workers away is the stop's doing, not an error to report (nor one left unretrieved)."""
        if self.loaded is None:
            return
        if not self.loaded.done():
            self.loaded.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.loaded


async def run_until_signalled(make_server: Callable[[], ServiceServer], service: str) -> None:
    """Process entry point: logs, tracing (before any server or channel), serve until
    SIGTERM/SIGINT, then drain."""
    configure_logging()
    telemetry.setup_tracing(service)
    server = make_server()
    port = await server.start()  # StartupError: the caller prints its one line and exits 2
    log.info("listening", service=service, host=server.settings.host, port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({server.loaded, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if server.loaded in done and server.loaded.exception() is not None:
        error = server.loaded.exception()
        await server.stop(0)
        raise StartupError(f"loading the model failed: {type(error).__name__}: {error}") from error
    await stop.wait()
    log.info("draining", service=service, grace_s=server.settings.grace_s)
    await server.stop()
    telemetry.shutdown_tracing()
