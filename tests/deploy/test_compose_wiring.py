"""The compose wiring, run as local processes (no container engine needed).

The tests take the default (CPU) `verifier` and `drafter` services of compose.yaml and run
each one's `command` and `environment` as a local process, exactly as the image would
(ENTRYPOINT `tandem` = `python -m shared.cli`), with only the container-specific parts
substituted: 0.0.0.0 -> 127.0.0.1, every port -> a free local port, the drafter's service
name in the verifier's dns:/// address -> 127.0.0.1, and no OTLP exporter (nothing listens
for it). They wait for SERVING on the gRPC health service, run the compose healthcheck
commands, generate through the verifier (drafts must be proposed, so the verifier really
reached the drafter), read /metrics, and stop both with SIGTERM (exit status 0).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from shared.health import wait_serving

from .compose_helpers import (
    K8S,
    PREFIX,
    ROOT,
    command,
    entrypoint,
    environment,
    load_compose,
    model_services,
    split_address,
)

START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Local:
    kind: str
    name: str
    argv: list[str]
    env: dict[str, str]  # the service's environment after substitution
    port: int
    metrics_port: int
    log: Path
    process: subprocess.Popen | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def metrics_flag_supported(kind: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "shared.cli", kind, "--help"], check=False, capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    return "--metrics-port" in out.stdout


def localize(compose: dict, tmp: Path) -> dict[str, Local]:
    """The default model services as local process specs (see the module docstring)."""
    services = model_services(compose, None)
    names = {kind: name for kind, (name, _) in services.items()}
    ports: dict[int, int] = {}  # container port -> local port

    def local_port(value: str) -> str:
        port = int(value)
        if port == 0:
            return "0"
        return str(ports.setdefault(port, free_port()))

    specs = {}
    for kind, (name, service) in services.items():
        prefix = PREFIX[kind]
        metrics = metrics_flag_supported(kind)
        env = {}
        for key, value in environment(service).items():
            setting = key.removeprefix(prefix) if key.startswith(prefix) else None
            if key.startswith("OTEL_EXPORTER_OTLP"):
                continue  # no collector here
            if key == "OTEL_TRACES_EXPORTER":
                value = "none"
            elif setting == "HOST":
                value = "127.0.0.1" if value == "0.0.0.0" else value
            elif setting in ("PORT", "METRICS_PORT"):
                if setting == "METRICS_PORT" and not metrics:
                    continue
                value = local_port(value)
            elif setting == "DRAFTER":
                scheme, host, port = split_address(value)
                assert host == names["drafter"], f"{key}={value} does not name the drafter service"
                value = f"{scheme}127.0.0.1:{local_port(str(port))}"
            env[key] = value
        argv = command(service)
        for flag in ("--host", "--port", "--drafter", "--metrics-port"):
            assert flag not in argv, f"{name}: settings belong in environment (the test substitutes them there)"
        assert entrypoint() == ["tandem"]
        specs[kind] = Local(
            kind=kind, name=name, argv=[sys.executable, "-m", "shared.cli", *argv], env=env,
            port=int(env[prefix + "PORT"]), metrics_port=int(env.get(prefix + "METRICS_PORT", "0")),
            log=tmp / f"{name}.log",
        )
    return specs


def wait_until_serving(local: Local, deadline: float) -> None:
    try:
        wait_serving(f"127.0.0.1:{local.port}", timeout=max(deadline - time.monotonic(), 0.1),
                     process=local.process, name=local.name)
    except (RuntimeError, TimeoutError) as error:
        pytest.fail(f"{error}:\n{local.output()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The compose verifier and drafter as local processes, started in depends_on order."""
    compose = load_compose()
    specs = localize(compose, tmp_path_factory.mktemp("compose"))
    base = {key: value for key, value in os.environ.items() if not key.startswith(("TANDEM_", "OTEL_"))}
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for kind in ("drafter", "verifier"):  # verifier depends_on drafter: service_healthy
            local = specs[kind]
            with open(local.log, "wb") as log:
                local.process = subprocess.Popen(local.argv, env={**base, **local.env}, cwd=ROOT,
                                                 stdout=log, stderr=subprocess.STDOUT)
            wait_until_serving(local, deadline)
        yield compose, specs
    finally:
        for local in specs.values():
            if local.process is not None and local.process.poll() is None:
                local.process.kill()
                local.process.wait(10)


def test_compose_healthchecks_pass_against_the_services(stack):
    compose, specs = stack
    base = {key: value for key, value in os.environ.items() if not key.startswith(("TANDEM_", "OTEL_"))}
    for local in specs.values():
        test = compose["services"][local.name]["healthcheck"]["test"]
        argv = [sys.executable if part == "python" else part for part in test[1:]]
        out = subprocess.run(argv, check=False, env={**base, **local.env}, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{local.name} healthcheck failed:\n{out.stderr}"
        # and it fails where nothing serves
        dead = {**base, **local.env, PREFIX[local.kind] + "PORT": str(free_port())}
        assert subprocess.run(argv, check=False, env=dead, capture_output=True, timeout=30).returncode != 0


def test_generate_through_the_compose_wiring_uses_the_drafter(stack):
    from shared.client import GenerationConfig, VerifierClient

    _, specs = stack
    with VerifierClient(f"127.0.0.1:{specs['verifier'].port}", timeout=60) as client:
        result = client.generate("def fibonacci(n):", GenerationConfig(max_new_tokens=8))
    assert result.token_ids and len(result.token_ids) <= 8
    assert result.stats["completion_tokens"] == len(result.token_ids)
    assert result.stats["proposed"] > 0, f"no drafts: the verifier did not reach the drafter\n{specs['verifier'].output()}"


def test_metrics_endpoints_serve_what_prometheus_and_the_hpa_read(stack):
    _, specs = stack
    assert all(local.metrics_port for local in specs.values()), "every model service takes --metrics-port"
    bodies = {}
    for local in specs.values():
        with urllib.request.urlopen(f"http://127.0.0.1:{local.metrics_port}/metrics", timeout=10) as reply:
            bodies[local.kind] = reply.read().decode()
    assert "tandem_verifier_" in bodies["verifier"]
    assert "tandem_drafter_" in bodies["drafter"]
    hpa = yaml.safe_load((K8S / "drafter-hpa.yaml").read_text())
    name = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert re.search(rf"^{name}[{{ ]", bodies["drafter"], re.MULTILINE), f"the HPA scales on {name}, which the drafter does not publish"


def test_sigterm_stops_both_with_status_0(stack):
    _, specs = stack
    for kind in ("verifier", "drafter"):  # compose stops dependents first
        local = specs[kind]
        assert local.process.poll() is None, f"{local.name} died early:\n{local.output()}"
        local.process.send_signal(signal.SIGTERM)
        try:
            status = local.process.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{local.name} ignored SIGTERM:\n{local.output()}")
        assert status == 0, f"{local.name} exited with {status}:\n{local.output()}"
