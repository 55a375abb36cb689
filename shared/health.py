"""Waiting for a tandem service to report SERVING on the standard gRPC health service."""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_serving(address: str, *, timeout: float = 120.0, process: subprocess.Popen | None = None,
                 name: str = "service") -> None:
    """Block until `address` answers SERVING. RuntimeError if `process` exits first,
    TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                said = process.stderr.read().strip().splitlines()[-3:] if process.stderr is not None else []
                raise RuntimeError(f"the {name} exited with status {process.returncode}"
                                   + "".join(f"\n  {line}" for line in said))
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"the {name} at {address} did not become SERVING within {timeout:.0f}s")
