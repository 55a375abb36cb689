"""Drafter settings: `tandem drafter --help` lists them; env TANDEM_DRAFTER_<NAME> too."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from shared import settings as base

ENV_PREFIX = "TANDEM_DRAFTER_"


@dataclass(frozen=True)
class DrafterSettings:
    model: str | None = field(default=None, metadata={"help": "checkpoint directory or model name; none = the embedded demo model"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback unless told otherwise)"})
    port: int = field(default=50052, metadata={"help": "port to bind; 0 picks a free one"})
    local_socket: str | None = field(default=None, metadata={"help": "also serve Draft streams on this Unix socket path (created owner-only) for a verifier on this host (its --drafter-socket): no gRPC on the speculative round's path; --auth-token, if set, is checked there too"})
    random_weights: bool = field(default=False, metadata={"help": "benchmarks: random weights from the model directory's config.json (no safetensors needed; drafts are then noise, their cost is real)"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    dtype: str = field(default="float32", metadata={"help": "model dtype: float32, bfloat16 or float16"})
    quantize: str = field(default="auto", metadata={"help": "weight format: auto (an FP8 checkpoint stays FP8 on a GPU, dequantised to --dtype on the CPU, where per-op dequantisation is slower), none (full precision everywhere), fp8 (block-scaled e4m3, blocks of 128 x 128: the projections and routed experts, routers and lm_head left; full-precision checkpoints converted on load). --dtype stays the activations'"})
    cpu_threads: int = field(default=0, metadata={"help": "torch CPU threads of the model (0 = auto: 1 on the CPU, leaving the other cores to a verifier on this host; two processes spinning on the same cores slow each other several-fold)"})
    fused: str = field(default="auto", metadata={"help": "fused-kernel MTP path: auto (on where the model allows, CUDA or CPU), on, off (reference path)"})
    max_sessions: int = field(default=256, metadata={"help": "sessions kept; the least recently used is evicted (its verifier re-syncs)"})
    max_streams_per_peer: int = field(default=64, metadata={"help": "Draft streams one unauthenticated peer (client address) may hold open; more get RESOURCE_EXHAUSTED. Callers authenticated by --auth-token or --tls-client-ca are not capped by address"})
    moce_scale: float = field(default=0.0, metadata={"help": "MoCE base scale b for the MTP layer's draft rows (m = b*b; 1 = plain routing); 0 = by the expert slots: plain routing with every expert resident, 3 with --expert-slots at most 25% of the experts, 2 above (chosen by bench/moce_drafts.py; docs/PERFORMANCE.md)"})
    expert_slots: int = field(default=0, metadata={"help": "device expert slots per MoE layer (0 = all resident)"})
    global_index_mb: int = field(default=512, metadata={"help": "MiB (2**20 bytes) the cross-session suffix index may hold: its native context tables and the finished outputs' tokens (docs/PERFORMANCE.md: tokens held per MiB); when full, the oldest outputs leave whole; 0 = off"})
    draft_ahead: bool = field(default=True, metadata={"help": "after a suffix chain, send the next round's chain at once, assuming every draft accepted and the bonus the suffix index expects (used by the verifier only if that is what it commits)"})
    load_shedding: bool = field(default=True, metadata={"help": "plan without MTP drafts when the model worker's backlog would make them miss the verifier's wait (the commit says it): a suffix or empty chain at once instead of a late one"})
    planner: str = field(default="adaptive", metadata={"help": "source choice: adaptive (learned estimates), mtp or suffix (fixed, for ablations)"})
    metrics_port: int = field(default=0, metadata={"help": "port of the Prometheus /metrics endpoint (0 = off)"})
    tls_cert: str | None = field(default=None, metadata={"help": "PEM server certificate: serve TLS (with tls_key)"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of tls_cert"})
    tls_client_ca: str | None = field(default=None, metadata={"help": "PEM CA bundle: require client certificates signed by it (mutual TLS)"})
    auth_token: str | None = field(default=None, metadata={"help": "bearer token Draft callers (verifiers) must send; none = no auth (use mutual TLS or this in production)"})
    grace_s: float = field(default=5.0, metadata={"help": "SIGTERM: seconds open streams get to finish"})
    max_connection_age_s: float = field(default=60.0, metadata={"help": "seconds before a client connection is asked to reconnect (GOAWAY; open streams run on), so clients re-resolve DNS and reach new replicas; 0 = never"})

    def __post_init__(self) -> None:
        base.validate_service(self)
        if self.local_socket is not None and not self.local_socket:
            raise ValueError("local_socket must not be empty (leave it unset for gRPC only)")
        if self.planner not in ("adaptive", "mtp", "suffix"):
            raise ValueError(f"planner {self.planner!r} must be adaptive, mtp or suffix")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions {self.max_sessions} must be >= 1")
        if self.max_streams_per_peer < 1:
            raise ValueError(f"max_streams_per_peer {self.max_streams_per_peer} must be >= 1")
        if not (math.isfinite(self.moce_scale) and self.moce_scale >= 0):
            raise ValueError(f"moce_scale {self.moce_scale!r} must be finite and > 0 (or 0: by the expert slots)")
        if self.expert_slots < 0:
            raise ValueError(f"expert_slots {self.expert_slots} must be >= 0")
        if self.global_index_mb < 0:
            raise ValueError(f"global_index_mb {self.global_index_mb} must be >= 0 (0: the cross-session index off)")

    def moce_base_scale(self, num_experts: int) -> float:
        """The MoCE base scale b for a model of `num_experts` routed experts per layer: the
        setting, or with 0 the measured best for the slot budget (bench/moce_drafts.py)."""
        if self.moce_scale:
            return self.moce_scale
        if not self.expert_slots or self.expert_slots >= num_experts:
            return 1.0
        return 3.0 if self.expert_slots <= num_experts / 4 else 2.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return base.build_parser(DrafterSettings, parser, ENV_PREFIX)


def from_args(args: argparse.Namespace | None = None, environ=None) -> DrafterSettings:
    return base.from_env_and_args(DrafterSettings, args, ENV_PREFIX, environ)
