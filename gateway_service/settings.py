"""Gateway settings: `tandem gateway --help` lists them; env TANDEM_GATEWAY_<NAME> too."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from shared import settings as base

ENV_PREFIX = "TANDEM_GATEWAY_"


@dataclass(frozen=True)
class GatewaySettings:
    verifier: str = field(default="127.0.0.1:50051", metadata={"help": "verifier address (host:port, dns:///name:port, ipv4:a:p,b:p); requests are spread round-robin"})
    verifier_socket: str | None = field(default=None, metadata={"help": "a verifier's --local-socket on this host: Generate streams go over this Unix socket instead of gRPC (no gRPC cost an event on either side); health checks stay on --verifier"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback unless told otherwise)"})
    port: int = field(default=8000, metadata={"help": "HTTP port to bind; 0 picks a free one"})
    model: str | None = field(default=None, metadata={"help": "checkpoint directory or model name the verifiers serve (its chat template and name); none = the embedded demo model"})
    served_model_name: str | None = field(default=None, metadata={"help": "the model id clients send and /v1/models lists; none = the checkpoint directory's name"})
    auth_token: str | None = field(default=None, metadata={"help": "bearer token HTTP clients must send (Authorization: Bearer ...); none = no auth"})
    verifier_token: str | None = field(default=None, metadata={"help": "bearer token sent to the verifier (its --auth-token)"})
    verifier_tls_ca: str | None = field(default=None, metadata={"help": "PEM CA bundle to verify the verifier's certificate (TLS to the verifier)"})
    verifier_tls_cert: str | None = field(default=None, metadata={"help": "PEM client certificate for mutual TLS to the verifier"})
    verifier_tls_key: str | None = field(default=None, metadata={"help": "PEM private key of verifier_tls_cert"})
    default_max_tokens: int = field(default=256, metadata={"help": "max_tokens of a chat completion that does not say (completions default to 16, as OpenAI's)"})
    timeout_s: float = field(default=600.0, metadata={"help": "deadline of one request to the verifier, in seconds"})
    grace_s: float = field(default=10.0, metadata={"help": "SIGTERM: seconds in-flight requests get to finish (health answers 503 meanwhile; streams still open near the end get an error event and [DONE])"})
    max_body_mb: float = field(default=16.0, metadata={"help": "largest request body in MiB; a larger one is answered 413"})

    def __post_init__(self) -> None:
        if not self.verifier:
            raise ValueError("verifier must name an address (host:port)")
        base.validate_address(self.verifier, "verifier")
        if self.verifier_socket is not None and not self.verifier_socket:
            raise ValueError("verifier_socket must not be empty (leave it unset for gRPC)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} must lie in [0, 65535]")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} must be >= 1")
        if not (math.isfinite(self.max_body_mb) and self.max_body_mb > 0):
            raise ValueError(f"max_body_mb {self.max_body_mb!r} must be finite and > 0")
        for name in ("timeout_s", "grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name == "timeout_s" and value == 0):
                raise ValueError(f"{name} {value!r} must be finite and {'> 0' if name == 'timeout_s' else '>= 0'}")
        if (self.verifier_tls_cert is None) != (self.verifier_tls_key is None):
            raise ValueError("verifier_tls_cert and verifier_tls_key must be given together")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty (leave it unset for no auth)")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return base.build_parser(GatewaySettings, parser, ENV_PREFIX)


def from_args(args: argparse.Namespace | None = None, environ=None) -> GatewaySettings:
    return base.from_env_and_args(GatewaySettings, args, ENV_PREFIX, environ)
