"""The OpenAI-compatible HTTP edge (issue 19): a FastAPI app over the async verifier client.

One gateway fronts any number of verifiers (one gRPC channel, round-robin over the
addresses its target resolves to). Each HTTP request becomes one `Generate` call: the
verifier streams events, the gateway turns them into OpenAI chunks (server-sent events) or
one response. A streamed request's first event is awaited before the HTTP status is sent, so
a bad parameter is a 400 with the field named, in streaming mode too. Request fields:
openai_api.py; bodies: body.py; response shapes: replies.py; errors: errors.py; drain and
disconnects: drain.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from gateway_service import openai_api
from gateway_service.body import decoded, read_body
from gateway_service.chat import ChatTemplate, ChatTemplateError
from gateway_service.drain import ClientGone, Drain, unless_client_leaves
from gateway_service.logprobs import TokenTexts
from gateway_service.errors import ApiError, ClientNames, bad, install_handlers, shutting_down
from gateway_service.replies import Reply
from gateway_service.settings import GatewaySettings
from shared import security, telemetry
from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError
from shared.metrics import GatewayMetrics
from shared.service import StartupError
from shared.tokenizer import load_tokenizer

log = structlog.get_logger("tandem")
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
OPEN_PATHS = ("/health", "/metrics")  # answered without the bearer token (probes, Prometheus)
CLIENT_GONE = 499  # the status a request whose client left is counted under (nginx's "client closed request")


class BearerAuth:
    """Refuses HTTP requests without the bearer token (OPEN_PATHS excepted); plain ASGI, so a
    streamed response passes through untouched. The scheme name is case-insensitive (RFC 6750),
    as the verifier's check; the token is compared in constant time."""

    def __init__(self, app, token: str) -> None:
        self.app, self.expected = app, token.encode()

    def _valid(self, header: bytes) -> bool:
        scheme, _, credential = header.strip().partition(b" ")
        return hmac.compare_digest(credential.strip(), self.expected) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            if not self._valid(dict(scope["headers"]).get(b"authorization", b"")):
                refusal = ApiError(401, "a valid bearer token is required (Authorization: Bearer ...)",
                                   kind="authentication_error", code="invalid_api_key")
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Prepared:
    """A request's fields, checked: what `_handle` needs to call the verifier."""

    config: GenerationConfig
    prompt: str | list[int]
    stream: bool
    include_usage: bool
    names: ClientNames


class Gateway:
    """The app and what it holds: the verifier client, the chat template, the model id."""

    def __init__(self, settings: GatewaySettings, *, model_dir, client: AsyncVerifierClient | None = None) -> None:
        self.settings = settings
        self.model_name = settings.served_model_name or model_dir.name
        self.template = ChatTemplate.for_checkpoint(model_dir)
        tokenizer = load_tokenizer(model_dir)
        self.texts = TokenTexts(tokenizer) if tokenizer is not None else None  # (logprobs' token texts)
        credentials = security.channel_credentials(settings.verifier_tls_ca, settings.verifier_tls_cert,
                                                   settings.verifier_tls_key, prefix="verifier_tls_")
        self.client = client or AsyncVerifierClient(
            settings.verifier, timeout=settings.timeout_s, credentials=credentials, token=settings.verifier_token,
            channel_options=[("grpc.service_config", ROUND_ROBIN)], local_socket=settings.verifier_socket)
        self.created = int(time.time())
        self.metrics = GatewayMetrics()
        self.drain = Drain()
        self.app = self._build()

    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await self.client.close()

        app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        install_handlers(app)
        if self.settings.auth_token is not None:
            app.add_middleware(BearerAuth, token=self.settings.auth_token)

        @app.get("/health")
        async def health() -> Response:
            if self.drain.draining:
                return ApiError(503, "the gateway is shutting down", kind="server_error", code="shutdown").response()
            if await self.client.serving():
                return JSONResponse({"status": "ok"})
            return ApiError(503, "the verifier is not serving (loading, draining or unreachable)",
                            kind="server_error", code="unavailable").response()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                 "owned_by": "tandem"}]}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._measured("completions", self._handle(request, chat=False))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._measured("chat_completions", self._handle(request, chat=True))

        return app

    async def _measured(self, endpoint: str, handling) -> Response:
        """Count the response by status and time it to its last byte (a stream's end); the
        drain waits for the same span."""
        started = time.perf_counter()
        self.metrics.active.inc()
        self.drain.in_flight += 1
        finished = False

        def done(status: int) -> None:
            nonlocal finished
            if not finished:
                finished = True
                self.drain.in_flight -= 1
                self.metrics.active.dec()
                self.metrics.requests.labels(endpoint, str(status)).inc()
                self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)

        try:
            response = await handling
        except BaseException:
            done(500)
            raise
        if isinstance(response, StreamingResponse):
            chunks, previous = response.body_iterator, response.background

            async def counted():
                try:
                    async for chunk in chunks:
                        yield chunk
                finally:
                    done(response.status_code)

            async def after() -> None:  # runs after the stream, also when its body never started
                if previous is not None:
                    await previous()
                done(response.status_code)

            response.body_iterator, response.background = counted(), BackgroundTask(after)
        else:
            done(response.status_code)
        return response

    def _prepare(self, body: object, *, chat: bool, request_id: str) -> Prepared:
        """The request's fields, checked, and its prompt (the chat template rendered)."""
        body = openai_api.check_fields(body, "chat" if chat else "completions")
        names = openai_api.client_names(body, chat=chat)
        config, stream, include_usage = openai_api.parse(
            body, served_model=self.model_name, request_id=request_id, names=names,
            default_max_tokens=self.settings.default_max_tokens if chat else 16)
        if config.logprobs is not None and self.texts is None:
            raise bad("logprobs", "logprobs need the checkpoint's tokenizer (tokenizer.json in the gateway's --model directory)")
        if chat:
            try:
                prompt = self.template.render(openai_api.chat_messages(body))
            except ChatTemplateError as error:
                raise ApiError(400, str(error), param="messages") from None
        else:
            prompt = openai_api.completion_prompt(body)
        return Prepared(config, prompt, stream, include_usage, names)

    async def _handle(self, request: Request, *, chat: bool) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if self.drain.draining:
            return shutting_down().response(request_id)
        try:
            raw = await read_body(request, self.settings.max_body_bytes)
            prepared = await decoded(raw, lambda body: self._prepare(body, chat=chat, request_id=request_id))
        except ApiError as error:
            return error.response(request_id)
        except ClientDisconnect:  # gone while sending its body
            return Response(status_code=CLIENT_GONE)
        del raw
        reply = Reply(request_id, self.model_name, chat=chat, names=prepared.names, texts=self.texts,
                      num_top=prepared.config.logprobs)
        # A child of the framework's HTTP span where one exists, else of the caller's trace
        # (its traceparent header).
        parent = None if trace.get_current_span().get_span_context().is_valid else \
            telemetry.extract_context(dict(request.headers))
        span = telemetry.tracer("tandem.gateway").start_span(
            "chat completion" if chat else "completion", kind=SpanKind.SERVER, context=parent,
            attributes={"tandem.request_id": request_id, "tandem.stream": prepared.stream})
        events = self.drain.events(self._events(span, prepared.prompt, prepared.config))
        streaming = False
        try:
            # the verifier's verdict on the request, before any status
            first = await unless_client_leaves(request, anext(events, None))
            self.metrics.ttft_seconds.observe(time.perf_counter() - started)
            if prepared.stream:
                body_iter, streaming = reply.stream(first, events, prepared.include_usage), True
                # events.aclose() afterwards: a client gone before the body starts would otherwise
                # leave the verifier call open until the generator is collected
                return StreamingResponse(body_iter, media_type="text/event-stream",
                                         headers={"x-request-id": request_id}, background=BackgroundTask(events.aclose))
            generation = await unless_client_leaves(request, reply.collect(first, events))
            return JSONResponse(reply.response(generation), headers={"x-request-id": request_id})
        except VerifierError as error:  # (the events generator has ended, and its span with it)
            log.info("request refused", request_id=request_id, code=error.code.name)
            return ApiError.from_verifier(error, prepared.names).response(request_id)
        except ApiError as error:  # the server is stopping
            return error.response(request_id)
        except ClientGone:
            log.info("client left", request_id=request_id)
            return Response(status_code=CLIENT_GONE)  # nobody reads it; the metrics count it
        finally:
            if not streaming:  # (a stream's body closes them when it ends)
                await events.aclose()

    async def _events(self, span, prompt, config) -> AsyncIterator:
        """The verifier's events; the gRPC call starts with the request's span current (so it
        becomes the span's child). The span is current only around that start: the rest is
        read from other tasks, where a context entered here cannot be left."""
        try:
            async with contextlib.aclosing(self.client.stream(prompt, config)) as events:
                with telemetry.use_span(span):
                    first = await anext(events, None)
                if first is None:
                    return
                yield first
                async for event in events:
                    yield event
        finally:
            span.end()


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # The loop's own handlers (serve) instead: uvicorn re-raises the signal after its
            # drain, which would end the process with status -15 instead of 0 like the others.
            yield

    return Server


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything starts (a busy port is a StartupError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted connections only then;
    # without it Nagle held streamed chunks back for the client's delayed ACKs (~40 ms) on
    # every request after a connection's first (measured with bench/gateway_latency.py).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise StartupError(f"port = {port}, host = {host}: {error.strerror or error}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(settings: GatewaySettings) -> None:
    """`tandem gateway`: serve until SIGTERM/SIGINT, then let requests finish within grace_s."""
    import uvicorn

    from shared.logs import configure_logging
    from shared.model.registry import resolve_model

    configure_logging()
    telemetry.setup_tracing("tandem-gateway")
    try:
        model_dir = resolve_model(settings.model)
    except FileNotFoundError as error:
        raise StartupError(f"model = {settings.model}: {error}") from None
    try:
        gateway = Gateway(settings, model_dir=model_dir)
    except (OSError, ValueError) as error:  # TLS files, the chat template
        raise StartupError(str(error)) from None
    sock = bind(settings.host, settings.port)
    config = uvicorn.Config(gateway.app, log_config=None, access_log=False, lifespan="on")
    server = _uvicorn_server()(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gateway listening", host=settings.host, port=sock.getsockname()[1], verifier=settings.verifier,
             model=gateway.model_name)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not serving.done():
        log.info("draining", grace_s=settings.grace_s, in_flight=gateway.drain.in_flight)
        await stop_gateway(server, gateway, settings.grace_s)
    stopping.cancel()
    await serving
    log.info("gateway stopped")


async def stop_gateway(server, gateway: Gateway, grace: float) -> None:
    """Drain `gateway` (the port stays open meanwhile: /health says 503), then stop `server`.
    Every request has ended by then, so uvicorn's own shutdown has only idle connections to
    close; its timeout is what is left of the grace (at least a second) for a response still
    being written."""
    left = await gateway.drain.drain(grace)
    server.config.timeout_graceful_shutdown = max(1.0, left)
    server.should_exit = True


async def start_in_loop(gateway: Gateway, host: str = "127.0.0.1", port: int = 0):
    """Run `gateway` in the current event loop (tests, benchmarks); returns (server, task, port)."""
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(uvicorn.Config(gateway.app, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]
