"""The services a run starts (child processes) and the byte-counting tap in front of a drafter."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import EXTRA_PATHS, REPO
from .common import CHANNEL_OPTIONS, ServiceError, free_port, log

# --- child processes --------------------------------------------------------------------


class Children:
    """The services this run starts: logs to files, health waits, SIGTERM at the end."""

    def __init__(self, workdir: Path, threads: int = 0) -> None:
        self.workdir = workdir
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_VERIFIER_", "TANDEM_DRAFTER_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *EXTRA_PATHS, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        if threads > 0:  # torch's intra-op threads per service (OMP/MKL read these at start)
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        self.env = env

    def start(self, name: str, argv: list[str], *, tree: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """tree: another checkout of tandem to run the service from (e.g. the code before a
        change, for a side-by-side run); its modules are imported first. env: variables of this
        child's own (over the run's)."""
        log_path = self.workdir / f"{name}.log"
        handle = open(log_path, "a")  # (a service started again in a later block adds to its log)
        log(f"  start {name}{f' from {tree}' if tree else ''}: {' '.join(argv[1:])}")
        env = dict(self.env, **(env or {}))
        if tree is not None:
            tree = tree.resolve()  # (the child runs in it: relative paths would not hold)
            env = dict(env, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "protos"), env["PYTHONPATH"]]))
        proc = subprocess.Popen(argv, cwd=tree or REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
        handle.close()
        self.procs[name] = (proc, log_path)
        return proc

    def tail(self, name: str, lines: int = 25) -> str:
        _, path = self.procs[name]
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    | " + line for line in text[-lines:])

    def check_alive(self) -> None:
        for name, (proc, _) in self.procs.items():
            if proc.poll() is not None:
                raise ServiceError(f"the {name} exited with status {proc.returncode}; its log ends:\n{self.tail(name)}")

    async def wait_serving(self, name: str, address: str, timeout: float) -> None:
        proc, _ = self.procs[name]
        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise ServiceError(f"the {name} exited with status {proc.returncode} before serving; its log ends:\n{self.tail(name)}")
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        log(f"  {name} SERVING at {address}")
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise ServiceError(f"the {name} at {address} was not SERVING within {timeout:.0f}s; its log ends:\n{self.tail(name)}")
                await asyncio.sleep(0.25)

    def stop(self, name: str | None = None, timeout: float = 20.0) -> None:
        names = [name] if name else list(self.procs)
        for n in names:
            proc, _ = self.procs[n]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for n in names:
            proc, _ = self.procs[n]
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"  {n} did not stop within {timeout:.0f}s of SIGTERM: killing it")
                proc.kill()
                proc.wait()


# --- the byte-counting tap (real drafter) -------------------------------------------------


def link_flags(link: str, socket: Path) -> tuple[list[str], list[str]]:
    """(verifier flags, drafter flags) of a drafter link: "local" Draft streams on the drafter's
    Unix socket `socket` (shared.local_stream, as `tandem demo` starts the pair), "grpc" its port."""
    if link == "grpc":
        return [], []
    return ["--drafter-socket", str(socket)], ["--local-socket", str(socket)]


class ServicePair:
    """A drafter and a verifier of one tree (another checkout's, or this one's: None) started as
    children, default flags plus `verifier_args` (and `drafter_args`, and `env`); `ready()` waits
    until both serve."""

    def __init__(self, name: str, children: Children, model_dir: Path, device: str, tree: Path | None,
                 verifier_args: list[str], drafter_args: list[str] = (), env: dict[str, str] | None = None) -> None:
        self.name, self.children, self.tree = name, children, tree
        self.d_port, self.v_port = free_port(), free_port()
        common = ["--model", str(model_dir), "--device", device]
        children.start(f"{name}-drafter", [sys.executable, "-m", "shared.cli", "drafter", *common,
                                           "--port", str(self.d_port), *drafter_args], tree=tree, env=env)
        children.start(f"{name}-verifier", [sys.executable, "-m", "shared.cli", "verifier", *common,
                                            "--port", str(self.v_port), "--drafter", f"127.0.0.1:{self.d_port}",
                                            *verifier_args], tree=tree, env=env)

    async def ready(self) -> None:
        await asyncio.gather(self.children.wait_serving(f"{self.name}-drafter", f"127.0.0.1:{self.d_port}", 600),
                             self.children.wait_serving(f"{self.name}-verifier", f"127.0.0.1:{self.v_port}", 600))


class Tap:
    """A pass-through proxy of Drafter.Draft that keeps every message's raw bytes; delay_s: each
    message from the drafter reaches the verifier that much later (a far drafter: another host
    or region), in order. Drafter.Record (a finished request's output) passes through too, its
    reply as late."""

    METHOD = "/tandem.v1.Drafter/Draft"
    RECORD_METHOD = "/tandem.v1.Drafter/Record"

    def __init__(self, target: str, *, delay_s: float = 0.0) -> None:
        self.target = target
        self.delay_s = delay_s
        self.streams: list[dict] = []
        self.server: grpc.aio.Server | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.forward = self.channel.stream_stream(self.METHOD)  # no (de)serializers: raw bytes
        self.forward_record = self.channel.unary_unary(self.RECORD_METHOD)
        handler = grpc.method_handlers_generic_handler(
            "tandem.v1.Drafter", {"Draft": grpc.stream_stream_rpc_method_handler(self._draft),
                                  "Record": grpc.unary_unary_rpc_method_handler(self._record)})
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.server.add_generic_rpc_handlers((handler,))
        if self.server.add_insecure_port(f"127.0.0.1:{port}") == 0:
            raise ServiceError(f"the tap could not bind 127.0.0.1:{port}")
        await self.server.start()

    async def _draft(self, request_iterator, context):
        record: dict = {"up": [], "down": []}
        self.streams.append(record)

        async def upstream():
            async for raw in request_iterator:
                record["up"].append(raw)
                yield raw

        call = self.forward(upstream())
        if not self.delay_s:
            try:
                async for raw in call:
                    record["down"].append(raw)
                    yield raw
            finally:
                call.cancel()
            return
        arrivals: asyncio.Queue = asyncio.Queue()

        async def receive() -> None:
            try:
                async for raw in call:
                    record["down"].append(raw)
                    arrivals.put_nowait((time.monotonic(), raw))
            finally:  # (the stream's end or error ends the verifier's side too)
                arrivals.put_nowait(None)

        reader = asyncio.create_task(receive())
        try:
            while (item := await arrivals.get()) is not None:
                arrived, raw = item
                await asyncio.sleep(max(0.0, arrived + self.delay_s - time.monotonic()))
                yield raw
        finally:
            reader.cancel()
            call.cancel()

    async def _record(self, raw: bytes, context) -> bytes:
        reply = await self.forward_record(raw)
        await asyncio.sleep(self.delay_s)
        return reply

    async def stop(self) -> None:
        server, channel, self.server, self.channel = self.server, self.channel, None, None
        if server is not None:
            await server.stop(1.0)
        if channel is not None:
            await channel.close()
