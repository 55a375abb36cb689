"""Settings plumbing shared by both services: frozen dataclasses filled from environment
variables and command-line flags (flags win), validated at construction.

Each service declares its settings as a frozen dataclass whose fields carry
`metadata={"help": ...}`; `build_parser` turns the fields into `--flag`s (defaults shown in
--help) and `from_env_and_args` reads `<PREFIX><FIELD>` environment variables first.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _field_type(cls: type, field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def _optional(cls: type, field: dataclasses.Field) -> bool:
    """Whether the field may be None (its default shows as "none")."""
    return type(None) in typing.get_args(typing.get_type_hints(cls)[field.name])


def _convert(kind: type, raw: str, name: str, optional: bool = False) -> Any:
    if optional and raw.strip().lower() == "none":  # (what --help shows as such a field's default)
        return None
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} = {raw!r} is not a boolean (true/false)")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name} = {raw!r} is not a valid {kind.__name__}") from None


def build_parser(cls: type, parser: argparse.ArgumentParser, env_prefix: str) -> argparse.ArgumentParser:
    """Add one --flag per settings field (dashes for underscores)."""
    for field in dataclasses.fields(cls):
        kind = _field_type(cls, field)
        flag = "--" + field.name.replace("_", "-")
        default = "none" if field.default is None else field.default
        help_text = f"{field.metadata.get('help', '')} (default: {default}; env {env_prefix}{field.name.upper()})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %: a literal "25%" must not break --help
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=str, default=None, metavar=field.name.upper(), help=help_text)
    return parser


def from_env_and_args(
    cls: type[T], args: argparse.Namespace | None, env_prefix: str, environ: Mapping[str, str] | None = None
) -> T:
    """Defaults < environment < flags; "none" sets a field that may be None to None. Raises
    ValueError naming the bad setting."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = _field_type(cls, field)
        env_name = f"{env_prefix}{field.name.upper()}"
        raw = environ.get(env_name)
        optional = _optional(cls, field)
        if raw is not None and raw != "":
            values[field.name] = _convert(kind, raw, env_name, optional)
        flag_value = getattr(args, field.name, None) if args is not None else None
        if flag_value is not None:
            flag = "--" + field.name.replace("_", "-")
            values[field.name] = flag_value if isinstance(flag_value, bool) else _convert(kind, flag_value, flag, optional)
    return cls(**values)


def describe(settings: Any) -> dict[str, Any]:
    """Settings as a plain dict (for the startup log line)."""
    return dataclasses.asdict(settings)


def help_rows(cls: type, env_prefix: str) -> Sequence[tuple[str, str, str, str]]:
    """(flag, env var, default, help) rows for the configuration reference (docs/CONFIGURATION.md)."""
    rows = []
    for field in dataclasses.fields(cls):
        default = "none" if field.default is None else str(field.default)
        rows.append(("--" + field.name.replace("_", "-"), f"{env_prefix}{field.name.upper()}", default,
                     field.metadata.get("help", "")))
    return rows


def markdown_table(cls: type, env_prefix: str) -> str:
    """The settings of `cls` as the reference's Markdown table (`scripts/config_tables` prints them)."""
    lines = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{flag}` | `{env}` | {default} | {meaning} |" for flag, env, default, meaning in help_rows(cls, env_prefix)]
    return "\n".join(lines)


DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_CHOICES = ("auto", "none", "fp8")  # --quantize (shared.model.quantize.QUANTIZE)
FUSED_CHOICES = ("auto", "on", "off")  # the fused-kernel path: auto = on where the model allows (CUDA or CPU)


ADDRESS_FORMS = "host:port, [ipv6]:port, dns:///name:port, ipv4:a:p,b:p, ipv6:[a]:p or unix:path"


def validate_address(value: str, name: str) -> None:
    """A gRPC target a service dials, checked at start: every host with a port in [1, 65535]
    (gRPC would dial 443 without one, and wraps larger numbers to another port), no URL
    schemes gRPC does not resolve (http://...)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{name} {value!r} {why} (forms: {ADDRESS_FORMS})")

    if value.startswith(("unix:", "unix-abstract:")):
        if not value.split(":", 1)[1]:
            raise bad("names no socket path")
        return
    if value.startswith("dns:"):
        rest = value[len("dns:"):]
        if rest.startswith("//"):  # dns://[authority]/name:port
            _, slash, rest = rest[2:].partition("/")
            if not slash:
                raise bad("needs dns:///name:port")
        targets = [rest]
    elif value.startswith(("ipv4:", "ipv6:")):
        targets = value.split(":", 1)[1].split(",")
    elif "://" in value or "/" in value:
        raise bad("is not a gRPC target")
    else:
        targets = [value]
    for target in targets:
        host, colon, port = target.rpartition(":")
        if not (colon and host and port.isdigit() and 1 <= int(port) <= 65535):
            raise bad(f"has {target!r} where host:port with a port in [1, 65535] is needed")


def validate_service(settings: Any) -> None:
    """Checks every service's settings share: ports, device, dtype, TLS pairs, grace."""
    for name in ("port", "metrics_port"):
        value = getattr(settings, name)
        if not 0 <= value <= 65535:
            raise ValueError(f"{name} {value} must lie in [0, 65535]")
    if settings.cpu_threads < 0:
        raise ValueError(f"cpu_threads {settings.cpu_threads} must be >= 0 (0 = auto)")
    if settings.dtype not in DTYPES:
        raise ValueError(f"dtype {settings.dtype!r} must be one of {', '.join(DTYPES)}")
    if settings.quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize {settings.quantize!r} must be one of {', '.join(QUANTIZE_CHOICES)}")
    device = settings.device
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"device {device!r} must be cpu, cuda or cuda:N")
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together")
    if settings.tls_client_ca is not None and settings.tls_cert is None:
        raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
    if settings.fused not in FUSED_CHOICES:
        raise ValueError(f"fused {settings.fused!r} must be one of {', '.join(FUSED_CHOICES)}")
    for name in ("grace_s", "max_connection_age_s"):
        value = getattr(settings, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} {value!r} must be finite and >= 0")
