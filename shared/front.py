"""A service's gRPC port served by front processes that relay its stream method to the service's
local socket as bytes (DESIGN §9, "The gRPC front").

Every streamed event costs the process that serves it gRPC's own per-event work (~5× what the
local socket's frames cost: bench/event_floor.py, docs/PERFORMANCE.md), and in the verifier that
work runs on the event loop whose interpreter lock the engine thread needs between steps. With
fronts, the service binds no gRPC port: each front process serves it — the service's stream
method relayed unparsed (the request's bytes in a MESSAGE frame, each event's frame payload sent
on as the gRPC message, the stream's STATUS as the call's status), health checking and
reflection answered there — so the service's own process pays the local socket's cost a message.
The request is parsed, checked and refused by the service itself, with gRPC's codes and
messages; the caller's metadata (bearer token, trace context) travels in the METADATA frame, and a
front refuses a missing or wrong token before the hop as well.

One module, both sides: `Fronts` (in the service's process) starts the processes and tells them
the service's health; `main` is a front (`python -m shared.front`). The control is the front's
stdin: a JSON line (FrontConfig), then lines `serving`, `not_serving`, `stop <grace_s>`; stdin's
end (the service gone) stops the front at once. A front answers on stdout one line, `ready
<port>` or `error <message>` (then exits 2). Several fronts share the port (SO_REUSEPORT; the
kernel spreads connections over them); one that dies unasked is started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from shared.local_stream import LocalCall

log = structlog.get_logger("tandem")
READY, ERROR = "ready", "error"
START_TIMEOUT_S = 60.0  # a front's import and bind; a slow disk's first Python start is seconds


@dataclass(frozen=True)
class FrontConfig:
    """What a front serves: `address` (host:port; port 0 = a free one), the service's
    `service_name` and its unary-stream `method`, relayed to `socket` (a path)."""

    address: str
    service_name: str
    method: str
    socket: str
    message_limit: int
    max_connection_age_s: float = 0.0
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    reuse_port: bool = False  # (several fronts on one port)


# -- the service's side --------------------------------------------------------------------------

class FrontError(Exception):
    """A front could not start; the message is its own (e.g. the port in use)."""


class Fronts:
    """`count` front processes serving one port for a service in this process."""

    def __init__(self, count: int, config: FrontConfig) -> None:
        if count < 1:
            raise ValueError(f"front processes {count} must be >= 1")
        self.count = count
        self.config = config if count == 1 else dataclasses.replace(config, reuse_port=True)
        self.port: int | None = None
        self._processes: list[asyncio.subprocess.Process] = []
        self._watchers: list[asyncio.Task] = []
        self._health = "not_serving"
        self.restarts = 0  # fronts started again after dying unasked

    async def start(self) -> int:
        """Start every front (the first binds the address, the others the port it got); the
        port. FrontError (every front stopped) when one cannot start."""
        try:
            for index in range(self.count):
                self._processes.append(await self._spawn())
        except BaseException:
            await self.stop(0)
            raise
        self._watchers = [asyncio.create_task(self._watch(index)) for index in range(self.count)]
        return self.port

    async def _spawn(self) -> asyncio.subprocess.Process:
        config = self.config
        if self.port is not None:  # (the others join the first one's port)
            config = dataclasses.replace(config, address=f"{config.address.rpartition(':')[0]}:{self.port}")
        # (this package importable there whatever the service's working directory)
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shared.front", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
        process.stdin.write((json.dumps(dataclasses.asdict(config)) + "\n" + self._health + "\n").encode())
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)).decode().strip()
        except asyncio.TimeoutError:
            line = f"{ERROR} no answer in {START_TIMEOUT_S:.0f} s"
        word, _, rest = line.partition(" ")
        if word != READY:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise FrontError(rest or f"the front process ended (exit code {process.returncode})")
        self.port = int(rest)
        process.stdin.write((self._health + "\n").encode())  # (health may have changed while it started)
        return process

    async def _watch(self, index: int) -> None:
        """Start a front again when it ends unasked (the port stays the service's)."""
        while True:
            code = await self._processes[index].wait()
            log.error("front process ended; starting it again", exit_code=code, port=self.port)
            self.restarts += 1
            while True:
                await asyncio.sleep(0.5)
                try:
                    self._processes[index] = await self._spawn()
                    break
                except FrontError as error:
                    log.error("front process could not start again", error=str(error))
                    await asyncio.sleep(5.0)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes if process.returncode is None]

    def set_health(self, serving: bool) -> None:
        self._health = "serving" if serving else "not_serving"
        self._send(self._health)

    def _send(self, line: str) -> None:
        for process in self._processes:
            if process.returncode is None and process.stdin is not None and not process.stdin.is_closing():
                process.stdin.write((line + "\n").encode())

    async def stop(self, grace: float) -> None:
        """Ask every front to stop within `grace` seconds (open calls end by then), then end it."""
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._send(f"stop {max(0.0, grace)}")
        for process in self._processes:
            with contextlib.suppress(ConnectionError):
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), grace + 5.0)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self._processes.clear()


# -- the front ----------------------------------------------------------------------------------

class _Raw:
    """A message as bytes, for LocalCall: the relay parses neither requests nor events."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name, which LocalCall calls)
        return self.payload

    FromString = staticmethod(bytes)  # (an event's frame payload, as it came)


class Relay:
    """The service's stream method: request bytes to the local socket (the transport's own
    client, `LocalCall`), event bytes back, its failures as the call's status."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config

    async def call(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        metadata = [(key, value) for key, value in context.invocation_metadata() or () if isinstance(value, str)]
        call = LocalCall(self.config.socket, _Raw, metadata, self.config.message_limit)
        failed = None
        try:
            await call.write(_Raw(raw))
            del raw
            await call.done_writing()
            async for payload in call:
                yield payload
        except grpc.aio.AioRpcError as error:
            failed = error.code(), error.details()
        finally:
            call.cancel()  # (a call the client left: the service sees the stream end at its next write)
        if failed is not None:  # (outside the except: the abort's traceback holds no request)
            await context.abort(*failed)


async def serve(config: FrontConfig, control: asyncio.StreamReader) -> int:
    """Serve until told to stop (or the control's end); the exit code."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from shared import security
    from shared.service import server_options

    token = security.BearerTokenInterceptor(config.auth_token, protected_methods=(
        f"/{config.service_name}/{config.method}",)) if config.auth_token else None
    options = [(key, value) for key, value in server_options(config) if key != "grpc.so_reuseport"]
    server = grpc.aio.server(options=[*options, ("grpc.so_reuseport", int(config.reuse_port))],
                             interceptors=[token] if token else [])
    handler = grpc.unary_stream_rpc_method_handler(Relay(config).call)  # (bytes in, bytes out)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(config.service_name, {config.method: handler}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((config.service_name, reflection.SERVICE_NAME,
                                         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)

    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", config.service_name):
            await health_servicer.set(name, status)

    await set_health(False)
    try:
        credentials = security.server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        if config.reuse_port:  # (the port-in-use check would see the other fronts)
            port = server.add_secure_port(config.address, credentials) if credentials else server.add_insecure_port(config.address)
        else:
            port = security.add_port(server, config.address, credentials)
    except (RuntimeError, ValueError, OSError) as error:
        print(f"{ERROR} {error}", flush=True)
        return 2
    await server.start()
    print(f"{READY} {port}", flush=True)
    grace = 0.0
    while line := (await control.readline()).decode().strip():
        word, _, rest = line.partition(" ")
        if word in ("serving", "not_serving"):
            await set_health(word == "serving")
        elif word == "stop":
            grace = float(rest or 0)
            break
    await set_health(False)
    await server.stop(grace)
    return 0


async def _main() -> int:
    loop = asyncio.get_running_loop()
    control = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), sys.stdin)
    first = await control.readline()
    if not first:
        return 2
    config = FrontConfig(**json.loads(first))
    return await serve(config, control)


def main() -> None:
    from shared.logs import configure_logging

    configure_logging()
    sys.exit(asyncio.run(_main()))


if __name__ == "__main__":
    main()
