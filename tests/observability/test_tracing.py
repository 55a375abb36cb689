"""One trace from the client through the verifier's rounds into the drafter's proposals."""

import asyncio

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import telemetry
from shared.protocol import verifier_pb2_grpc

from ..drafter_service.conftest import Pair
from ..verifier_service.conftest import request


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        pytest.fail("a tracer provider was installed before this module; tracing tests need the first bootstrap")
    assert telemetry.setup_tracing("tandem-test", exporter=exporter)
    return exporter


@pytest.mark.parametrize("link", ["grpc", "local"])
async def test_one_trace_from_client_to_drafter(spans, tiny_mtp_model, link):
    """Over either link: the drafter's proposals join the request's trace by the context each
    message carries (a local stream has no gRPC instrumentation to carry it)."""
    pair = Pair()
    try:
        await pair.start(tiny_mtp_model, drafter_settings={"planner": "mtp"}, link=link)
        port = pair.verifier.port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # instrumented client
            stub = verifier_pb2_grpc.VerifierStub(channel)
            req = request([3, 14, 15, 92, 65], 12, temperature=0.8, seed=1)
            req.request_id = f"trace-me-{link}"
            with telemetry.tracer("test-client").start_as_current_span("client") as client_span:
                final = None
                async for event in stub.Generate(req):
                    if event.HasField("final"):
                        final = event.final
            trace_id = client_span.get_span_context().trace_id
    finally:
        await pair.stop()
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    names = [s.name for s in finished]
    by_name = {}
    for s in finished:
        by_name.setdefault(s.name, []).append(s)
    assert "/tandem.v1.Verifier/Generate" in names  # gRPC server instrumentation joined the trace
    assert {"Generate", "prefill", "round", "propose"} <= set(names)
    generate = by_name["Generate"][0]
    a = generate.attributes
    stats = final.stats
    assert a["tandem.request_id"] == f"trace-me-{link}"
    assert a["tandem.completion_tokens"] == stats.completion_tokens == 12
    assert a["tandem.rounds"] == stats.rounds == len(by_name["round"])
    assert a["tandem.accepted"] == stats.accepted == sum(r.attributes["tandem.accepted"] for r in by_name["round"])
    assert a["tandem.mean_accepted_length_with_bonus"] == pytest.approx(stats.mean_accepted_length)
    assert a["tandem.finish_reason"] == "length" and "tandem.ttft_ms" in a and "tandem.tokens_per_s" in a
    assert a["tandem.queue_ms"] == 0.0  # admitted at once: a session was free
    assert a["tandem.acceptance.MTP"] == pytest.approx(stats.acceptance_by_source["MTP"])
    prefill = by_name["prefill"][0].attributes
    assert prefill["tandem.prompt_tokens"] == stats.prompt_tokens and prefill["tandem.prefill_chunks"] >= 1
    for r in by_name["round"]:
        for key in ("tandem.source", "tandem.proposed", "tandem.retained", "tandem.accepted", "tandem.confidences",
                    "tandem.draft_ms", "tandem.rpc_ms", "tandem.verify_ms", "tandem.bytes_up", "tandem.bytes_down",
                    "tandem.drafter_slot_misses", "tandem.verifier_slot_misses", "tandem.speculative", "tandem.followed"):
            assert key in r.attributes, key
        assert r.attributes["tandem.load"] == "alone"  # (the one request in the engine loop)
        assert r.parent.span_id == generate.context.span_id
    drafted = [r for r in by_name["round"] if r.attributes["tandem.retained"] > 0]
    assert drafted and all(r.attributes["tandem.bytes_down"] > 0 for r in drafted)
    proposals = by_name["propose"]
    assert len(proposals) >= stats.rounds - 1
    assert all(p.attributes["tandem.request_id"] == f"trace-me-{link}" for p in proposals)
    # each proposal hangs under a verifier span of the same trace (open: Generate; commits: rounds)
    verifier_span_ids = {s.context.span_id for s in by_name["round"]} | {generate.context.span_id}
    assert all(p.parent.span_id in verifier_span_ids for p in proposals)
    # the request's record (its output for the drafter's index), sent after its end, joins it too
    (record,) = by_name["record"]
    assert record.parent.span_id == generate.context.span_id
    assert record.attributes["tandem.request_id"] == f"trace-me-{link}" and record.attributes["tandem.output_tokens"] >= 12


async def test_a_clients_trace_crosses_the_verifiers_local_socket(spans, tiny_mtp_model):
    """A client on the verifier's --local-socket (no gRPC instrumentation on that path): its
    trace context rides in the stream's metadata, and the request's spans join its trace."""
    import shutil
    import tempfile

    from shared.client import AsyncVerifierClient, GenerationConfig

    folder = tempfile.mkdtemp(prefix="tandem-test-")  # (a Unix socket's path is at most 107 bytes)
    pair = Pair()
    try:
        await pair.start(tiny_mtp_model, local_socket=f"{folder}/v.sock")
        async with AsyncVerifierClient(f"127.0.0.1:{pair.verifier.port}", local_socket=f"{folder}/v.sock") as client:
            with telemetry.tracer("test-client").start_as_current_span("client") as client_span:
                config = GenerationConfig(max_new_tokens=6, temperature=0.8, seed=3, request_id="trace-local")
                generation = await client.generate([3, 14, 15, 92], config)
        assert len(generation.token_ids) == 6
    finally:
        await pair.stop()
        shutil.rmtree(folder, ignore_errors=True)
    trace_id = client_span.get_span_context().trace_id
    finished = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    (generate,) = [s for s in finished if s.name == "Generate"]
    assert generate.parent.span_id == client_span.get_span_context().span_id  # the client's span, no gRPC span between
    assert generate.attributes["tandem.request_id"] == "trace-local"
    assert any(s.name == "round" and s.parent.span_id == generate.context.span_id for s in finished)


def test_tracing_off_installs_nothing():
    assert telemetry.setup_tracing("x", environ={"OTEL_SDK_DISABLED": "true"}) in (True, False)
    assert telemetry._exporter({}) is None
    assert telemetry._exporter({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}) is None
    assert telemetry._exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) is not None
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER 'zipkin'"):
        telemetry._exporter({"OTEL_TRACES_EXPORTER": "zipkin"})


async def test_the_gateway_joins_the_callers_trace_and_the_verifiers(spans, tiny_mtp_model):
    """HTTP caller (traceparent header) → gateway span → the verifier's Generate span: one trace
    (issue 19), over the local socket the verifier names to the gateway beside it (the
    gateway's span travels as `traceparent` in the stream's metadata)."""
    import json
    import urllib.request

    from gateway_service.server import Gateway, start_in_loop
    from gateway_service.settings import GatewaySettings
    from shared.model.registry import resolve_model

    pair = Pair()
    server = None
    try:
        await pair.start(tiny_mtp_model)
        gateway = Gateway(GatewaySettings(verifier=f"127.0.0.1:{pair.verifier.port}", served_model_name="tiny"),
                          model_dir=resolve_model(None))
        server, task, port = await start_in_loop(gateway)
        with telemetry.tracer("test-client").start_as_current_span("http client") as client_span:
            headers = {"content-type": "application/json", "x-request-id": "edge-trace"}
            telemetry.inject_context(headers)
        body = json.dumps({"model": "tiny", "prompt": [3, 14, 15], "max_tokens": 4, "seed": 2}).encode()
        post = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers=headers)
        reply = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(post, timeout=30).read()))
        assert reply["id"] == "edge-trace" and reply["usage"]["completion_tokens"] == 4
    finally:
        if server is not None:
            server.should_exit = True
            await task
        await pair.stop()
    trace_id = client_span.get_span_context().trace_id
    finished = {s.name: s for s in spans.get_finished_spans() if s.context.trace_id == trace_id}
    assert {"completion", "Generate"} <= set(finished), sorted(finished)
    assert "/tandem.v1.Verifier/Generate" not in finished  # (no gRPC call: the socket)
    edge = finished["completion"]
    assert finished["Generate"].parent.span_id == edge.context.span_id
    assert edge.attributes["tandem.request_id"] == "edge-trace"
    assert finished["Generate"].attributes["tandem.request_id"] == "edge-trace"  # the id travels on


async def test_requests_that_arrive_together_round_as_sharing_from_their_first_round(spans, tiny_mtp_model):
    """A round's load (its span's `tandem.load`: the load its governor decides for, the ledger
    it judges by) counts the requests holding a session, not the lanes in the engine loop:
    requests admitted together share the steps from their first round, though their lanes join
    one prefill at a time (counting lanes, each of these governors started "alone")."""
    import threading

    pair = Pair()
    try:
        await pair.start(tiny_mtp_model, drafter_settings={"planner": "mtp"}, governor=True)
        service = pair.verifier.service
        gate = threading.Event()
        held = asyncio.ensure_future(service.worker.run(gate.wait))  # (the engine loop busy: prefills queue behind it)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pair.verifier.port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)

            async def one(index):
                req = request([3, 14, 15, 92, 65 + index], 8, temperature=0.0, seed=index)
                req.request_id = f"together-{index}"
                return [event async for event in stub.Generate(req)]

            calls = [asyncio.ensure_future(one(i)) for i in range(3)]
            for _ in range(500):
                if service.active == 3:
                    break
                await asyncio.sleep(0.01)
            assert service.active == 3
            gate.set()
            await held
            await asyncio.gather(*calls)
    finally:
        await pair.stop()
    firsts = {}
    for s in spans.get_finished_spans():
        if s.name == "Generate" and str(s.attributes.get("tandem.request_id", "")).startswith("together-"):
            rounds = [r for r in spans.get_finished_spans() if r.name == "round" and r.parent.span_id == s.context.span_id]
            firsts[s.attributes["tandem.request_id"]] = min(rounds, key=lambda r: r.attributes["tandem.round_id"])
    assert len(firsts) == 3
    assert all(r.attributes["tandem.load"] == "shared" for r in firsts.values())
