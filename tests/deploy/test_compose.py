"""The deployment files: compose.yaml, the Dockerfile, deploy/ and deploy/k8s/.

No container engine is needed. The structural tests read the files; the wiring tests take
the default (CPU) `verifier` and `drafter` services of compose.yaml and run each one's
`command` and `environment` as a local process, exactly as the image would (ENTRYPOINT
`tandem` = `python -m shared.cli`), with only the container-specific parts substituted:
0.0.0.0 -> 127.0.0.1, every port -> a free local port, the drafter's service name in the
verifier's dns:/// address -> 127.0.0.1, and no OTLP exporter (nothing listens for it).
They wait for SERVING on the gRPC health service, run the compose healthcheck commands,
generate through the verifier (drafts must be proposed, so the verifier really reached the
drafter), read /metrics, and stop both with SIGTERM (exit status 0).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
MODEL_COMMANDS = ("verifier", "drafter")
PREFIX = {"verifier": "TANDEM_VERIFIER_", "drafter": "TANDEM_DRAFTER_"}
START_TIMEOUT_S = 60.0


# --- reading the files ------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """Compose variable interpolation ($$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default})."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(1):
            return "$"
        name = match.group(2) or match.group(5)
        operator, default = match.group(3), match.group(4)
        current = env.get(name)
        if operator == ":-":
            return current if current else default
        if operator == "-":
            return current if current is not None else default
        return current or ""

    if re.search(r"\$\{[^}]*[?+][^}]*\}", value):
        raise AssertionError(f"unsupported interpolation in {value!r}: extend interpolate()")
    return _VARIABLE.sub(substitute, value)


def load_compose() -> dict:
    # safe_load resolves anchors and `<<` merge keys the way Compose does; the environment
    # is empty so every ${VAR:-default} takes its default, as on a fresh machine.
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), {})


def environment(service: dict) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, "") for item in raw)
    return {key: "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in raw.items()}


def command(service: dict) -> list[str]:
    raw = service.get("command") or []
    return shlex.split(raw) if isinstance(raw, str) else [str(part) for part in raw]


def role(service: dict) -> str | None:
    """'verifier' or 'drafter' for a tandem model service, else None."""
    argv = command(service)
    return argv[0] if argv and argv[0] in MODEL_COMMANDS else None


def model_services(compose: dict, profile: str | None) -> dict[str, dict]:
    """role -> (name, service) of the model services active by default (profile None) or in `profile`."""
    found: dict[str, tuple[str, dict]] = {}
    for name, service in compose["services"].items():
        if role(service) is None:
            continue
        profiles = service.get("profiles") or []
        if (profile is None and not profiles) or (profile is not None and profile in profiles):
            assert role(service) not in found, f"two {role(service)} services in profile {profile}: {name}"
            found[role(service)] = (name, service)
    return found


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def entrypoint() -> list[str]:
    entries = [json.loads(rest) for word, rest in dockerfile_instructions() if word == "ENTRYPOINT"]
    assert entries, "the Dockerfile has no ENTRYPOINT"
    return entries[-1]


def env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value
    return pairs


def settings_of(kind: str, env: dict[str, str]):
    """The service's own settings parser on `env` (raises ValueError on a bad name or value)."""
    if kind == "verifier":
        from verifier_service import settings
    else:
        from drafter_service import settings
    prefix = PREFIX[kind]
    fields = {f.name.upper() for f in dataclasses.fields(settings.VerifierSettings if kind == "verifier" else settings.DrafterSettings)}
    unknown = sorted(key for key in env if key.startswith(prefix) and key.removeprefix(prefix) not in fields)
    assert not unknown, f"not {kind} settings: {unknown}"
    return settings.from_args(None, environ=env)


def split_address(address: str) -> tuple[str, str, int]:
    """'dns:///name:port' -> ('dns:///', 'name', port); 'name:port' -> ('', 'name', port)."""
    scheme = "dns:///" if address.startswith("dns:///") else ""
    host, _, port = address.removeprefix(scheme).rpartition(":")
    return scheme, host, int(port)


# --- structure: compose.yaml ------------------------------------------------------------


def test_compose_defines_the_services_and_profiles():
    compose = load_compose()
    services = compose["services"]
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert {"verifier", "drafter", "otel-collector", "jaeger", "prometheus"} <= default
    cpu, gpu = model_services(compose, None), model_services(compose, "gpu")
    assert set(cpu) == set(gpu) == set(MODEL_COMMANDS)
    images = set()
    for name, service in [*cpu.values(), *gpu.values()]:
        build = service.get("build")
        assert isinstance(build, dict) and build.get("context") == ".", f"{name} builds the repository's Dockerfile"
        assert "TORCH_SPEC" in (build.get("args") or {}), f"{name} passes TORCH_SPEC"
        images.add(service.get("image"))
    assert len(images) == 1 and None not in images, "one image for every model service"


def test_default_services_run_on_cpu_and_gpu_profile_reserves_gpus():
    compose = load_compose()
    for kind, (name, service) in model_services(compose, None).items():
        env = environment(service)
        assert env[PREFIX[kind] + "DEVICE"] == "cpu", name
        assert "deploy" not in service, f"{name}: the default services must start without a GPU"
        settings_of(kind, env)
    cpu = model_services(compose, None)
    for kind, (name, service) in model_services(compose, "gpu").items():
        env = environment(service)
        assert env[PREFIX[kind] + "DEVICE"].startswith("cuda"), name
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in device.get("capabilities", []) for device in devices), name
        # the gpu variant answers to the default service's name (verifier DNS, Prometheus)
        aliases = service["networks"]["default"]["aliases"]
        assert cpu[kind][0] in aliases, f"{name} needs the network alias {cpu[kind][0]}"
        settings_of(kind, env)


def test_drafters_are_scalable():
    compose = load_compose()
    for profile in (None, "gpu"):
        name, drafter = model_services(compose, profile)["drafter"]
        assert "container_name" not in drafter, f"{name}: a fixed container name forbids --scale"
        assert not drafter.get("ports"), f"{name}: a fixed host port forbids --scale"
        port = environment(drafter)["TANDEM_DRAFTER_PORT"]
        assert port in [str(p) for p in drafter.get("expose", [])], name
        verifier_name, verifier = model_services(compose, profile)["verifier"]
        published = [str(p) for p in verifier.get("ports", [])]
        port = environment(verifier)["TANDEM_VERIFIER_PORT"]
        assert any(p.endswith(":" + port) for p in published), f"{verifier_name} publishes its gRPC port"


def test_verifier_reaches_the_drafters_by_dns_name():
    compose = load_compose()
    for profile in (None, "gpu"):
        services = model_services(compose, profile)
        verifier_name, verifier = services["verifier"]
        drafter_name, drafter = services["drafter"]
        scheme, host, port = split_address(environment(verifier)["TANDEM_VERIFIER_DRAFTER"])
        assert scheme == "dns:///", "dns:/// resolves every drafter replica (round-robin)"
        names = {drafter_name, *((drafter.get("networks") or {}).get("default") or {}).get("aliases", [])}
        assert host in names, f"{verifier_name} points at {host!r}, not at {drafter_name}"
        assert port == int(environment(drafter)["TANDEM_DRAFTER_PORT"])
        depends = verifier.get("depends_on") or {}
        assert depends.get(drafter_name, {}).get("condition") == "service_healthy", verifier_name


def test_model_services_have_grpc_healthchecks():
    compose = load_compose()
    for profile in (None, "gpu"):
        for kind, (name, service) in model_services(compose, profile).items():
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD" and test[1] == "python" and test[2] == "-c", name
            assert "grpc_health" in test[3] and "SERVING" in test[3], name
            assert PREFIX[kind] + "PORT" in test[3], f"{name}: the check follows the configured port"
            assert service["healthcheck"].get("start_period"), f"{name}: model loading needs a start period"


def test_prometheus_scrapes_both_metrics_ports():
    compose = load_compose()
    prometheus = compose["services"]["prometheus"]
    assert any(str(volume).startswith("./deploy/prometheus.yml:") for volume in prometheus["volumes"])
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd.get("type") == "A", f"{job['job_name']}: type A lists every replica"
            targets |= {(name, sd["port"]) for name in sd["names"]}
    for kind, (name, service) in model_services(compose, None).items():
        port = int(environment(service)[PREFIX[kind] + "METRICS_PORT"])
        assert port, f"{name} has /metrics on"
        assert (name, port) in targets, f"prometheus does not scrape {name}:{port}"
    assert {port for _, port in targets} == {9091, 9092}


def test_traces_flow_to_the_collector_and_on_to_jaeger():
    compose = load_compose()
    services = compose["services"]
    for profile in (None, "gpu"):
        for kind, (name, service) in model_services(compose, profile).items():
            env = environment(service)
            assert env["OTEL_TRACES_EXPORTER"] == "otlp", name
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
            assert env["OTEL_SERVICE_NAME"] == f"tandem-{kind}", name
    collector = services["otel-collector"]
    assert "opentelemetry-collector-contrib" in collector["image"]
    assert any(str(v).startswith("./deploy/otel-collector.yaml:") for v in collector["volumes"])
    config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    endpoints = [config["exporters"][exporter]["endpoint"] for exporter in pipeline["exporters"]]
    assert "jaeger:4317" in endpoints
    jaeger = services["jaeger"]
    assert "jaegertracing/all-in-one" in jaeger["image"]
    assert str(jaeger["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"
    assert "16686:16686" in [str(p) for p in jaeger["ports"]]


def test_docker_compose_config_accepts_the_file():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], check=False, capture_output=True).returncode != 0:
        pytest.skip("`docker compose` is not available here")
    for extra in ([], ["--profile", "gpu"]):
        out = subprocess.run([docker, "compose", "-f", str(COMPOSE_FILE), *extra, "config", "--quiet"],
                             check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, out.stderr


# --- structure: Dockerfile --------------------------------------------------------------


def test_dockerfile_installs_the_project_from_pypi_only():
    instructions = dockerfile_instructions()
    text = DOCKERFILE.read_text()
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text and all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    assert ("ARG", "TORCH_SPEC=torch") in instructions
    runs = [rest for word, rest in instructions if word == "RUN"]
    torch_step = next(i for i, run in enumerate(runs) if "${TORCH_SPEC}" in run)
    project_step = next(i for i, run in enumerate(runs) if re.search(r"pip install \.(\s|$)", run))
    assert torch_step < project_step, "torch first, so `pip install .` keeps the chosen build"
    assert not re.search(r"\b(curl|wget)\b|ADD\s+https?://|index-url|find-links", text), "nothing but PyPI/Debian at build time"
    copied = {part.rstrip("/") for word, rest in instructions if word == "COPY" and "--from" not in rest
              for part in rest.split()[:-1]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = {package.split(".")[0] for package in project["tool"]["setuptools"]["packages"]}
    package_dirs = {project["tool"]["setuptools"]["package-dir"].get(p, p).split("/")[0] for p in package_dirs}
    needed = {"pyproject.toml", "setup.py", "README.md", "models", *package_dirs}
    assert needed <= copied, f"not copied: {sorted(needed - copied)}"
    assert entrypoint() == ["tandem"] and project["project"]["scripts"]["tandem"] == "shared.cli:main"
    models_dir = re.search(r"TANDEM_MODELS_DIR=(\S+)", text).group(1)
    assert re.search(rf"COPY models/ {re.escape(models_dir)}/?\s", text), "TANDEM_MODELS_DIR is where models/ goes"
    assert re.search(r"^USER\s+(?!0\b|root\b)", text, re.MULTILINE), "runs unprivileged"
    exposed = {int(p) for word, rest in instructions if word == "EXPOSE" for p in rest.split()}
    assert {50051, 50052, 9091, 9092} <= exposed


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for kept in ("pyproject.toml", "setup.py", "README.md", "protos", "kernels", "shared", "verifier_service",
                 "drafter_service", "models"):
        assert kept not in patterns, f".dockerignore drops {kept}, which the Dockerfile copies"
    for dropped in ("**/.venv", "**/.git", "tests", "protos/tandem/v1/*_pb2.py"):
        assert dropped in patterns, f".dockerignore should drop {dropped}"


# --- structure: deploy/k8s --------------------------------------------------------------


def kustomize(directory: Path) -> list[dict]:
    kubectl, tool = shutil.which("kubectl"), shutil.which("kustomize")
    if tool:
        argv = [tool, "build", str(directory)]
    elif kubectl:
        argv = [kubectl, "kustomize", str(directory)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_k8s_settings_are_valid_settings():
    for kind in MODEL_COMMANDS:
        env = env_file(K8S / f"{kind}.env")
        settings = settings_of(kind, env)
        assert settings.host == "0.0.0.0"
        assert settings.metrics_port == {"verifier": 9091, "drafter": 9092}[kind]


def test_k8s_base_wires_verifier_to_headless_drafters_and_autoscales_them():
    docs = kustomize(K8S)
    by_kind: dict[tuple[str, str], dict] = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    drafter_service = by_kind[("Service", "tandem-drafter")]
    assert drafter_service["spec"]["clusterIP"] == "None", "headless: one A record per drafter pod"
    configs = {doc["metadata"]["name"]: doc["data"] for doc in docs if doc["kind"] == "ConfigMap"}
    for kind in MODEL_COMMANDS:
        deployment = by_kind[("Deployment", f"tandem-{kind}")]
        pod = deployment["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False, "service links would set TANDEM_<SERVICE>_PORT=tcp://..."
        (container,) = pod["containers"]
        assert container["args"] == [kind]
        (source,) = container["envFrom"]
        env = configs[source["configMapRef"]["name"]]
        settings = settings_of(kind, env)
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports == {"grpc": settings.port, "metrics": settings.metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == settings.port, f"{kind} {probe}"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(settings.metrics_port)
        service = by_kind[("Service", f"tandem-{kind}")]
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"] == settings.port
        if kind == "verifier":
            scheme, host, port = split_address(settings.drafter)
            assert (scheme, host, port) == ("dns:///", "tandem-drafter", 50052)
            assert port == {p["name"]: p["port"] for p in drafter_service["spec"]["ports"]}["grpc"]
    hpa = by_kind[("HorizontalPodAutoscaler", "tandem-drafter")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tandem-drafter"}
    assert "replicas" not in by_kind[("Deployment", "tandem-drafter")]["spec"], "the HPA owns the drafter count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert "prometheus-adapter" in (K8S / "drafter-hpa.yaml").read_text()
    metrics_source = ROOT / "shared" / "metrics.py"
    if metrics_source.exists():
        assert f'"{name}"' in metrics_source.read_text(), f"no service publishes {name}"


def test_k8s_gpu_component(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S, overlay)],
        "components": [os.path.relpath(K8S / "gpu", overlay)],
    }))
    docs = kustomize(overlay)
    configs = {doc["metadata"]["name"]: doc["data"] for doc in docs if doc["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            kind = container["args"][0]
            env = configs[container["envFrom"][0]["configMapRef"]["name"]]
            assert settings_of(kind, env).device == "cuda"


# --- wiring: the compose model services as local processes ------------------------------


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


def wait_serving(local: Local, deadline: float) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{local.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if local.process.poll() is not None:
                pytest.fail(f"{local.name} exited with {local.process.returncode}:\n{local.output()}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    pytest.fail(f"{local.name} never became SERVING:\n{local.output()}")


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
            wait_serving(local, deadline)
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
    if not all(local.metrics_port for local in specs.values()):
        pytest.skip("the services do not take --metrics-port yet")
    bodies = {}
    for local in specs.values():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{local.metrics_port}/metrics", timeout=10) as reply:
                bodies[local.kind] = reply.read().decode()
        except (urllib.error.URLError, ConnectionError) as error:
            pytest.skip(f"{local.name} does not serve /metrics on METRICS_PORT yet ({error})")
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
