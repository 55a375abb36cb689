"""Prometheus metrics of the services, each on its own registry, served at /metrics.

A registry per server instance (not the process-global one) keeps several servers in one
process (tests, the demo) apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 17)


class VerifierMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("tandem_verifier_completion_tokens", "Completion tokens streamed to clients", registry=r)
        self.requests = Counter("tandem_verifier_requests", "Finished requests", ["finish_reason"], registry=r)
        self.drafts = Counter("tandem_verifier_drafts", "Draft tokens by source and outcome (retained, accepted)",
                              ["source", "outcome"], registry=r)
        self.accepted_length = Histogram("tandem_verifier_accepted_length", "Committed tokens per round (bonus included)",
                                         buckets=LENGTH_BUCKETS, registry=r)
        self.round_seconds = Histogram("tandem_verifier_round_seconds", "Round latency: chain wait + verification",
                                       buckets=ROUND_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("tandem_verifier_ttft_seconds", "Time to first token", registry=r)
        self.active = Gauge("tandem_verifier_active_sessions", "Requests in flight", registry=r)
        self.queued = Gauge("tandem_verifier_queued_requests", "Requests waiting for a session", registry=r)
        self.kv_blocks = Gauge("tandem_verifier_kv_blocks", "Blocks of the KV pool", registry=r)
        self.model_bytes = Gauge("tandem_verifier_model_bytes",
                                 "Bytes of the model weights the verifier holds on its device", registry=r)
        self.kv_blocks_held = Gauge("tandem_verifier_kv_blocks_held",
                                    "KV blocks held by requests (each holds its prompt + max_new_tokens + a window)",
                                    registry=r)
        self.faults = Counter("tandem_verifier_drafter_faults", "Drafter faults seen by the verifier", ["kind"], registry=r)
        self.slot_hit_rate = Gauge("tandem_verifier_expert_slot_hit_rate", "Expert slot hit rate of the target model", registry=r)
        self.batch_rounds = Histogram("tandem_verifier_batch_rounds", "Sessions' rounds per batched forward",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.prefill_sessions = Histogram("tandem_verifier_prefill_sessions", "Sessions' prompt chunks per prefill forward",
                                          buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.prefill_tokens = Counter("tandem_verifier_prefill_tokens", "Prompt tokens prefilled", registry=r)
        self.rounds = Counter("tandem_verifier_rounds",
                              "Rounds by kind: speculative (waited for a chain) or plain (no drafter asked)",
                              ["kind"], registry=r)
        self.detaches = Counter("tandem_verifier_drafter_detaches",
                                "Times a request stopped asking its drafter because speculation did not pay", registry=r)
        self.governor_phases = Counter("tandem_verifier_governor_phases",
                                       "Phases of requests' rounds begun, by why (the governor's Phase: verdict, "
                                       "verdict_plain, explore, await, calibrate, recheck, calibrated, detach, probe, "
                                       "not_drafting)", ["why"], registry=r)
        self.records = Counter("tandem_verifier_drafter_records",
                               "Finished requests' outputs sent to the drafter's index of outputs: recorded, failed (the "
                               "drafter refused or was unreachable) or dropped (too many in flight)", ["outcome"],
                               registry=r)
        self.ahead = Counter("tandem_verifier_ahead_chains",
                             "Chains drafted ahead of a commit: hit (used) or miss (dropped)", ["outcome"], registry=r)
        self.drafter_reachable = Gauge(
            "tandem_verifier_drafter_reachable",
            "1 while the drafter answers (start-up probe, streams, chains), 0 after it failed; -1 without a drafter",
            registry=r)
        # (labelled children looked up once: a round's counts are on every token's way)
        self._rounds_of = {True: self.rounds.labels("speculative"), False: self.rounds.labels("plain")}
        self._drafts_of: dict[str, tuple] = {}

    def engine_time(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Export the engine loop's seconds by what its thread did (`read()`: state -> seconds
        so far, read at each scrape: nothing on the loop's way)."""
        self.registry.register(_SecondsByState(
            "tandem_verifier_engine_seconds", "The engine loop thread's wall time by what it did: step (the model's "
            "work), job (prefill chunks, begins, closes), gather (waiting for a step's lanes), idle, other", read))

    def round_done(self, *, tokens: int, emitted: int, seconds: float, speculative: bool, source: str,
                   retained: int, accepted: int, slot_hit_rate: float) -> None:
        """A round's counts: tokens delivered, tokens committed (emitted), its drafts by source."""
        self.tokens.inc(tokens)
        self.accepted_length.observe(emitted)
        self.round_seconds.observe(seconds)
        self._rounds_of[speculative].inc()
        self.slot_hit_rate.set(slot_hit_rate)
        if retained:
            drafts = self._drafts_of.get(source)
            if drafts is None:
                drafts = self._drafts_of[source] = (self.drafts.labels(source, "retained"),
                                                    self.drafts.labels(source, "accepted"))
            drafts[0].inc(retained)
            drafts[1].inc(accepted)


class _SecondsByState:
    """A counter family read from a callable at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], Mapping[str, float]]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def describe(self):
        return [CounterMetricFamily(self.name, self.documentation, labels=["state"])]

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=["state"])
        for state, seconds in self.read().items():
            family.add_metric([state], seconds)
        yield family


class DrafterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._evictions_reported = 0
        self.proposals = Counter("tandem_drafter_proposals", "Chains sent, by source", ["source"], registry=r)
        self.draft_tokens = Counter("tandem_drafter_draft_tokens", "Draft tokens sent, by source", ["source"], registry=r)
        self.draft_seconds = Histogram("tandem_drafter_draft_seconds", "Drafter compute per chain", buckets=ROUND_BUCKETS, registry=r)
        self.active = Gauge("tandem_drafter_active_sessions", "Open Draft streams", registry=r)
        self.evictions = Counter("tandem_drafter_session_evictions", "Sessions evicted (their verifier re-syncs)", registry=r)
        self.slot_misses = Counter("tandem_drafter_expert_slot_misses", "Expert slot misses on draft rows", registry=r)
        self.slot_hit_rate = Gauge("tandem_drafter_expert_slot_hit_rate", "Expert slot hit rate of the MTP layer", registry=r)
        self.ahead = Counter("tandem_drafter_ahead_chains",
                             "Chains drafted ahead: sent, and hit (the round emitted what they assumed)", ["outcome"], registry=r)
        self.shed = Counter("tandem_drafter_shed_chains",
                            "Chains planned without MTP drafts because the model worker could not finish them "
                            "within the verifier's wait (load shedding)", registry=r)
        self.mtp_batch = Histogram("tandem_drafter_mtp_batch", "Sessions' MTP work (chains, deferred rows) per worker job",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.model_bytes = Gauge("tandem_drafter_model_bytes",
                                 "Bytes of the model weights the drafter holds on its device (a lean drafter: "
                                 "embeddings, the MTP layer, lm_head)", registry=r)
        self.global_contexts = Gauge("tandem_drafter_suffix_global_contexts",
                                     "Contexts in the cross-session suffix index, over every context length",
                                     registry=r)
        self.global_index_bytes = Gauge("tandem_drafter_global_index_bytes",
                                        "Bytes the cross-session suffix index holds: its native context tables and the "
                                        "outputs' tokens (bounded by --global-index-mb)", registry=r)
        self.global_index_requests = Gauge("tandem_drafter_global_index_requests",
                                           "Finished outputs the cross-session suffix index holds", registry=r)
        self.global_index_evictions = Counter("tandem_drafter_global_index_evictions",
                                              "Outputs evicted, whole, from the cross-session suffix index to stay "
                                              "within --global-index-mb (the oldest first)", registry=r)
        self.records = Counter("tandem_drafter_records", "Finished requests' outputs recorded by verifiers (Record)",
                               registry=r)

    def report_global_index(self, index) -> None:
        """The cross-session index's gauges, and its evictions since the last report."""
        self.global_contexts.set(len(index))
        self.global_index_bytes.set(index.nbytes)
        self.global_index_requests.set(index.requests)
        self.global_index_evictions.inc(index.evictions - self._evictions_reported)
        self._evictions_reported = index.evictions


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_gateway_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("tandem_gateway_request_seconds", "Completion latency, request to last byte",
                                         ["endpoint"], registry=r)
        self.ttft_seconds = Histogram("tandem_gateway_ttft_seconds", "Time to the first token (streamed requests)",
                                      registry=r)
        self.active = Gauge("tandem_gateway_active_requests", "Completions in flight", registry=r)


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """Start the /metrics HTTP server; returns an object with shutdown() (None when port is 0)."""
    if not port:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
