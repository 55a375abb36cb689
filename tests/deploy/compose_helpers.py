"""Reading the deployment files (compose.yaml, the Dockerfile, env files) for tests/deploy.

Shared by test_compose_structure.py (the static checks) and test_compose_wiring.py (the
compose model services as local processes).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
MODEL_COMMANDS = ("verifier", "drafter")
PREFIX = {"verifier": "TANDEM_VERIFIER_", "drafter": "TANDEM_DRAFTER_"}


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
