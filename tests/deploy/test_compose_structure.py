"""The deployment files, read statically: compose.yaml, deploy/ (Prometheus, OpenTelemetry
collector), the Dockerfile, .dockerignore and deploy/k8s/.

No container engine is needed: the tests read the files (`docker compose config` and
kustomize/kubectl run only where installed).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from .compose_helpers import (
    COMPOSE_FILE,
    DOCKERFILE,
    K8S,
    MODEL_COMMANDS,
    PREFIX,
    ROOT,
    dockerfile_instructions,
    entrypoint,
    env_file,
    environment,
    load_compose,
    model_services,
    settings_of,
    split_address,
)

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


def test_multigpu_profile_splits_the_verifier_and_gives_the_drafter_its_own_gpu():
    compose = load_compose()
    services = model_services(compose, "multigpu")
    assert set(services) == set(MODEL_COMMANDS)
    cpu = model_services(compose, None)
    gpus = {}
    for kind, (name, service) in services.items():
        env = environment(service)
        settings = settings_of(kind, env)
        assert settings.device == "cuda", name
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        gpus[kind] = device["device_ids"]
        assert cpu[kind][0] in service["networks"]["default"]["aliases"], name
    verifier = services["verifier"][1]
    assert settings_of("verifier", environment(verifier)).parallel == len(gpus["verifier"]) == 2
    assert environment(verifier)["NCCL_NVLS_ENABLE"] == "0"
    assert verifier["shm_size"]
    assert len(gpus["drafter"]) == 1 and not set(gpus["drafter"]) & set(gpus["verifier"]), gpus


def test_k8s_multigpu_component_asks_the_gpus_its_settings_split_over():
    component = yaml.safe_load((K8S / "multigpu" / "kustomization.yaml").read_text())
    (config,) = component["configMapGenerator"]
    literals = dict(item.split("=", 1) for item in config["literals"])
    gpu = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
    base = dict(item.split("=", 1) for c in gpu["configMapGenerator"] if c["name"] == config["name"] for item in c["literals"])
    settings = settings_of("verifier", env_file(K8S / "verifier.env") | base | literals)
    assert settings.parallel == 2 and settings.device == "cuda"
    assert literals["NCCL_NVLS_ENABLE"] == "0"
    (patch,) = component["patches"]
    pod = yaml.safe_load(patch["patch"])["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == settings.parallel
    assert {v["name"]: v["emptyDir"]["medium"] for v in pod["volumes"]} == {"shm": "Memory"}


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


def test_prometheus_scrapes_every_services_metrics():
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
    gateway = compose["services"]["gateway"]
    assert ("gateway", int(environment(gateway)["TANDEM_GATEWAY_PORT"])) in targets  # /metrics on its HTTP port
    assert {port for _, port in targets} == {9091, 9092, 8000}


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
    for extra in ([], ["--profile", "gpu"], ["--profile", "multigpu"]):
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
    find = project["tool"]["setuptools"]["packages"]["find"]
    roots = {pattern.split(".")[0] for pattern in find["include"]}  # (each root package's folder, under its `where`)
    package_dirs = {Path(where, root).parts[0] for root in roots for where in find["where"] if (ROOT / where / root).is_dir()}
    needed = {"pyproject.toml", "setup.py", "README.md", "models", *package_dirs}
    assert needed <= copied, f"not copied: {sorted(needed - copied)}"
    assert entrypoint() == ["tandem"] and project["project"]["scripts"]["tandem"] == "shared.cli:main"
    models_dir = re.search(r"TANDEM_MODELS_DIR=(\S+)", text).group(1)
    assert re.search(rf"COPY models/ {re.escape(models_dir)}/?\s", text), "TANDEM_MODELS_DIR is where models/ goes"
    assert re.search(r"^USER\s+(?!0\b|root\b)", text, re.MULTILINE), "runs unprivileged"
    exposed = {int(p) for word, rest in instructions if word == "EXPOSE" for p in rest.split()}
    assert {50051, 50052, 9091, 9092, 8000} <= exposed
    for service in ("VERIFIER", "DRAFTER", "GATEWAY"):  # the image serves beyond the container's loopback
        assert f"TANDEM_{service}_HOST=0.0.0.0" in text, service


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
            kind = container["args"][0]
            if kind not in MODEL_COMMANDS:  # the gateway runs no model
                assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
                continue
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            env = configs[container["envFrom"][0]["configMapRef"]["name"]]
            assert settings_of(kind, env).device == "cuda"


# --- the gateway (issue 19) ---------------------------------------------------------------


def gateway_settings(env: dict[str, str]):
    from gateway_service import settings

    fields = {f.name.upper() for f in dataclasses.fields(settings.GatewaySettings)}
    unknown = sorted(key for key in env if key.startswith(settings.ENV_PREFIX) and key.removeprefix(settings.ENV_PREFIX) not in fields)
    assert not unknown, f"not gateway settings: {unknown}"
    return settings.from_args(None, environ=env)


def test_the_gateway_is_deployed_in_front_of_the_verifier():
    compose = load_compose()
    service = compose["services"]["gateway"]
    assert service["command"] == ["gateway"] and not service.get("profiles")
    settings = gateway_settings(environment(service))
    assert settings.host == "0.0.0.0" and f"{settings.port}:{settings.port}" in service["ports"]
    assert split_address(settings.verifier) == ("dns:///", "verifier", 50051)
    assert f"{settings.port}/health" in " ".join(service["healthcheck"]["test"])
    # It waits for no verifier (its /health is 503 until one serves): a dependency would pull
    # the CPU verifier up beside the GPU profile's verifier-gpu, which serves it as `verifier`.
    assert not service.get("depends_on")
    k8s_env = env_file(K8S / "gateway.env")
    k8s = gateway_settings(k8s_env)
    assert k8s.host == "0.0.0.0" and split_address(k8s.verifier) == ("dns:///", "tandem-verifier", 50051)
    docs = [doc for doc in yaml.safe_load_all((K8S / "gateway.yaml").read_text()) if doc]
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["gateway"] and deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": k8s.port}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "gateway.yaml" in kustomization["resources"]
    assert {"name": "tandem-gateway-settings", "envs": ["gateway.env"]} in kustomization["configMapGenerator"]
