"""Verifier settings: `tandem verifier --help` lists them; env TANDEM_VERIFIER_<NAME> too."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from shared import settings as base

ENV_PREFIX = "TANDEM_VERIFIER_"


@dataclass(frozen=True)
class VerifierSettings:
    model: str | None = field(default=None, metadata={"help": "checkpoint directory or model name; none = the embedded demo model"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback unless told otherwise)"})
    port: int = field(default=50051, metadata={"help": "port to bind; 0 picks a free one"})
    drafter: str | None = field(default=None, metadata={"help": "drafter address (host:port, dns:///name:port, ipv4:a:p,b:p); none = decode without drafts"})
    drafter_socket: str | None = field(default=None, metadata={"help": "the drafter's --local-socket (a drafter on this host): Draft streams go over this Unix socket instead of gRPC, saving gRPC's share of every speculative round's round trip (docs/PERFORMANCE.md); Record and health checks stay on --drafter, which it needs"})
    local_socket: str | None = field(default=None, metadata={"help": "also serve Generate on this Unix socket path (created owner-only) for clients on this host (shared.client's local_socket, the gateway's --verifier-socket): the same requests, events and status codes without gRPC's per-event cost (docs/PERFORMANCE.md); --auth-token, if set, is checked there too"})
    offer_local_socket: bool = field(default=True, metadata={"help": "serve Generate on a Unix socket too (--local-socket, else a private one in an owner-only temp dir) and name it to gRPC callers on this host (GetServerInfo; loopback peers, no TLS): tandem's clients then stream over it, without gRPC's per-event cost on either side (docs/PERFORMANCE.md). --no-offer-local-socket: gRPC callers stay on gRPC"})
    front_processes: int = field(default=0, metadata={"help": "processes that serve the gRPC port instead of this one (0 = this process serves it): each relays Generate to this process's local socket (--local-socket, else a private one) as bytes, so gRPC's per-event work (docs/PERFORMANCE.md) runs outside the process whose interpreter lock the engine needs between steps; health and reflection are answered there too, health as this process says. Several share the port"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    parallel: int = field(default=1, metadata={"help": "processes the model is split over (DESIGN §13): each holds 1/N of the routed experts (expert parallel) and of the attention heads (tensor parallel); on CUDA one GPU each (from --device's index up), on the CPU gloo processes. The fused path; --num-expert-slots applies to each process's experts"})
    parallel_dense: str = field(default="split", metadata={"help": "with --parallel: split (the dense weights too: each process 1/N of the attention heads and KV (the hybrid family's linear-attention heads and states too), of any dense MLP and of the lm_head's vocabulary; two collectives a layer and one for the logits) or whole (every process all but its experts; one collective a layer: the better trade where the dense weights are a small share of a step's bytes)."})
    dtype: str = field(default="float32", metadata={"help": "model dtype: float32, bfloat16 or float16"})
    quantize: str = field(default="auto", metadata={"help": "weight format: auto (an FP8 checkpoint stays FP8 on a GPU, dequantised to --dtype on the CPU, where per-op dequantisation is slower), none (full precision everywhere), fp8 (block-scaled e4m3, blocks of 128 x 128: the projections and routed experts, routers and lm_head left; full-precision checkpoints converted on load). --dtype stays the activations'"})
    cpu_threads: int = field(default=0, metadata={"help": "torch CPU threads of the model (0 = auto: on the CPU all cores, but the native step leaves one to a drafter on this host, a loopback --drafter address, while some request drafts; two processes spinning on the same cores slow each other several-fold)"})
    random_weights: bool = field(default=False, metadata={"help": "benchmarks: random weights from the model directory's config.json (no safetensors needed)"})
    fused: str = field(default="auto", metadata={"help": "fused-kernel decode/verify path: auto (on where the model's family allows it, the CPU included: rounds of concurrent requests batched into one forward, every row keeping its one-row bits), on (the same, or an error naming why not), off (the reference modules: rounds one by one)"})
    row_invariant: bool = field(default=True, metadata={"help": "a row's logits are bit-identical to decoding it whatever shares its window or batch (exact mode's guarantee): the fused path's kernels and CPU ops are so at no cost; with --fused off an exact-mode window on the CPU runs as its rows' one-row steps. --no-row-invariant: projections by F.linear / cuBLAS (a yardstick; exact mode then no longer holds bit for bit)"})
    cuda_graphs: bool = field(default=True, metadata={"help": "capture the fused decode/verify windows as CUDA graphs (CUDA only)"})
    pdl: str = field(default="auto", metadata={"help": "programmatic dependent launch of the fused kernels: auto (on for compute capability 9.0+), off"})
    num_expert_slots: int = field(default=0, metadata={"help": "device slots per MoE layer (0 = all experts resident); the others wait in pinned host memory and are copied in when a forward routes to them (bit-identical output; on CUDA the fused path replays graph segments between each MoE layer's route read; throughput in docs/PERFORMANCE.md)"})
    expert_prefetch: bool = field(default=False, metadata={"help": "with expert slots: while a layer's experts run, start copying (at most 2 of) the experts the next layer routed the window's tokens to the last time it saw them. Off by default: on the H200 at Qwen3-30B-A3B shapes it cost more than it hid (a copy outlasts a layer's compute; docs/PERFORMANCE.md)"})
    max_sessions: int = field(default=32, metadata={"help": "requests in flight at once (within the KV pool: each holds the blocks of its prompt + max_new_tokens)"})
    kv_cache_tokens: int = field(default=0, metadata={"help": "KV positions in the pool, all sessions together (0 = sized from memory by kv_memory_fraction, at most max_sessions x max_context)"})
    kv_memory_fraction: float = field(default=0.9, metadata={"help": "KV pool sizing when kv_cache_tokens is 0: on a GPU the pool leaves (1 - this) of the device's memory free once the weights are in (like vLLM's gpu_memory_utilization); on the CPU it takes this share of the available RAM"})
    kv_block_size: int = field(default=64, metadata={"help": "positions per KV block (the paged pool's unit; 64 = one attention tile)"})
    max_queued: int = field(default=64, metadata={"help": "requests that wait for a session (first come, first served); more get RESOURCE_EXHAUSTED"})
    queue_timeout_s: float = field(default=30.0, metadata={"help": "longest wait in the queue before RESOURCE_EXHAUSTED"})
    max_new_tokens_limit: int = field(default=4096, metadata={"help": "largest max_new_tokens a request may ask for"})
    max_context: int = field(default=0, metadata={"help": "prompt + completion limit in tokens (0 = the model's max_position_embeddings)"})
    prefill_chunk: int = field(default=2048, metadata={"help": "prompt tokens per prefill forward, shared by the prompts that prefill together (larger chunks prefill faster and hold decode rounds longer: docs/PERFORMANCE.md)"})
    max_batch_rows: int = field(default=64, metadata={"help": "most rows (all sessions' windows together) in one batched forward; decode batches up to it run as CUDA graphs"})
    batch_gather_ms: float = field(default=2.0, metadata={"help": "how long a batch waits for the sessions of the last one to submit their next round"})
    max_draft_tokens: int = field(default=4, metadata={"help": "drafts per round when a request does not say"})
    max_draft_tokens_limit: int = field(default=16, metadata={"help": "largest max_draft_tokens a request may ask for"})
    max_support_limit: int = field(default=1024, metadata={"help": "largest sampling.max_support a request may ask for; with max_draft_tokens_limit it bounds a valid chain, and the drafter link refuses messages larger than that"})
    drafter_deadline_ms: float = field(default=0.0, metadata={"help": "fixed per-round wait for a chain (0 = adaptive: recent p95 of MTP chains' waits + margin)"})
    drafter_deadline_margin_ms: float = field(default=5.0, metadata={"help": "adaptive deadline: margin above the recent p95"})
    drafter_deadline_max_ms: float = field(default=1000.0, metadata={"help": "adaptive deadline: upper bound (also the first round's wait)"})
    draft_ahead: bool = field(default=True, metadata={"help": "take chains the drafter sends before a round's commit, when the committed tokens are what they assume (hides the hop)"})
    governor: bool = field(default=True, metadata={"help": "measure what rounds with drafts realise against plain rounds, per request, and decode plainly (probing now and then) while speculation does not pay"})
    governor_hold: int = field(default=16, metadata={"help": "plain rounds of a request after speculation stopped paying before it may probe again"})
    governor_probe_share: float = field(default=0.03, metadata={"help": "of the time spent decoding plainly, what probing a drafter that does not pay may cost (0.03: a useless drafter slows requests by at most 3%, plus one probe)"})
    metrics_port: int = field(default=0, metadata={"help": "port of the Prometheus /metrics endpoint (0 = off)"})
    tls_cert: str | None = field(default=None, metadata={"help": "PEM server certificate: serve TLS (with tls_key)"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of tls_cert"})
    tls_client_ca: str | None = field(default=None, metadata={"help": "PEM CA bundle: require client certificates signed by it (mutual TLS)"})
    auth_token: str | None = field(default=None, metadata={"help": "bearer token Generate callers must send (authorization: Bearer ...); none = no auth"})
    draw_secret: str | None = field(default=None, metadata={"help": "secret keying probabilistic mode's accept/residual draws (drafters never see it); none = a random one per process"})
    probabilistic_drafters: str = field(default="none", metadata={"help": "drafters trusted with the probabilistic rule: none (every chain of a probabilistic request is verified by the coupled exact rule, so its output law is the target's whatever a drafter sends), authenticated (a drafter token or mutual TLS configured), or any"})
    drafter_token: str | None = field(default=None, metadata={"help": "bearer token sent to the drafter on Draft streams (its --auth-token)"})
    drafter_tls_ca: str | None = field(default=None, metadata={"help": "PEM CA bundle to verify the drafter's certificate (TLS to the drafter)"})
    drafter_tls_cert: str | None = field(default=None, metadata={"help": "PEM client certificate for mutual TLS to the drafter"})
    drafter_tls_key: str | None = field(default=None, metadata={"help": "PEM private key of drafter_tls_cert"})
    grace_s: float = field(default=10.0, metadata={"help": "SIGTERM: seconds in-flight requests get to finish"})
    max_connection_age_s: float = field(default=60.0, metadata={"help": "seconds before a client connection is asked to reconnect (GOAWAY; open streams run on), so clients re-resolve DNS and reach new replicas; 0 = never"})

    def __post_init__(self) -> None:
        base.validate_service(self)
        positive = ("governor_hold", "max_sessions", "max_new_tokens_limit", "prefill_chunk", "max_draft_tokens_limit",
                    "max_support_limit", "max_batch_rows", "kv_block_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        for name in ("num_expert_slots", "max_context", "max_queued", "kv_cache_tokens", "front_processes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 0")
        if self.parallel < 1:
            raise ValueError(f"parallel {self.parallel} must be >= 1")
        if self.parallel_dense not in ("split", "whole"):
            raise ValueError(f"parallel_dense {self.parallel_dense!r} must be split or whole")
        if self.parallel > 1 and self.fused == "off":
            raise ValueError("fused: a model split over processes (parallel > 1) runs the fused path only")
        if self.pdl not in ("auto", "off"):
            raise ValueError(f"pdl {self.pdl!r} must be auto or off")
        if self.drafter is not None:
            base.validate_address(self.drafter, "drafter")
        if self.drafter_socket is not None:
            if self.drafter is None:
                raise ValueError("drafter_socket needs drafter too (the drafter's gRPC address: its Record and health)")
            if not self.drafter_socket:
                raise ValueError("drafter_socket must not be empty (leave it unset for gRPC streams)")
        if self.local_socket is not None and not self.local_socket:
            raise ValueError("local_socket must not be empty (leave it unset for gRPC only)")
        if self.probabilistic_drafters not in ("none", "authenticated", "any"):
            raise ValueError(f"probabilistic_drafters {self.probabilistic_drafters!r} must be none, authenticated or any")
        if self.draw_secret is not None and not self.draw_secret:
            raise ValueError("draw_secret must not be empty (leave it unset for a random one)")
        if not 0 <= self.max_draft_tokens <= self.max_draft_tokens_limit:
            raise ValueError(
                f"max_draft_tokens {self.max_draft_tokens} must lie in [0, max_draft_tokens_limit = {self.max_draft_tokens_limit}]"
            )
        for name in ("drafter_deadline_ms", "drafter_deadline_margin_ms", "batch_gather_ms"):  # (grace_s: base)
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} must be finite and >= 0")
        if not (math.isfinite(self.kv_memory_fraction) and 0 < self.kv_memory_fraction <= 1):
            raise ValueError(f"kv_memory_fraction {self.kv_memory_fraction!r} must lie in (0, 1]")
        if self.kv_cache_tokens and self.kv_cache_tokens < self.kv_block_size:
            raise ValueError(f"kv_cache_tokens {self.kv_cache_tokens} must be 0 (from memory) or at least one block "
                             f"(kv_block_size = {self.kv_block_size})")
        if not (math.isfinite(self.governor_probe_share) and 0 < self.governor_probe_share <= 1):
            raise ValueError(f"governor_probe_share {self.governor_probe_share!r} must lie in (0, 1]")
        if not self.batch_gather_ms < 1000:
            raise ValueError(f"batch_gather_ms {self.batch_gather_ms!r} must be below 1000")
        if not (math.isfinite(self.queue_timeout_s) and self.queue_timeout_s > 0):
            raise ValueError(f"queue_timeout_s {self.queue_timeout_s!r} must be finite and > 0")
        if not (math.isfinite(self.drafter_deadline_max_ms) and self.drafter_deadline_max_ms > 0):
            raise ValueError(f"drafter_deadline_max_ms {self.drafter_deadline_max_ms!r} must be finite and > 0")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return base.build_parser(VerifierSettings, parser, ENV_PREFIX)


def from_args(args: argparse.Namespace | None = None, environ=None) -> VerifierSettings:
    return base.from_env_and_args(VerifierSettings, args, ENV_PREFIX, environ)
