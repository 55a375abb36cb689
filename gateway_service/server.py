"""The OpenAI-compatible HTTP edge (issue 19): a FastAPI app over the async verifier client.

One gateway fronts any number of verifiers (one gRPC channel, round-robin over the
addresses its target resolves to). Each HTTP request becomes one `Generate` call: the
verifier streams events, the gateway turns them into OpenAI chunks (server-sent events) or
one response. A streamed request's first event is awaited before the HTTP status is sent, so
a bad parameter is a 400 with the field named, in streaming mode too.
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

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from opentelemetry.trace import SpanKind

from gateway_service.chat import ChatTemplate, ChatTemplateError
from gateway_service.openai_api import ApiError, chat_messages, completion_prompt, finish_reason, parse, usage
from gateway_service.settings import GatewaySettings
from shared import security, telemetry
from shared.client import AsyncVerifierClient, GenerationAccumulator, VerifierError
from shared.metrics import GatewayMetrics
from shared.service import StartupError

log = structlog.get_logger("tandem")
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
OPEN_PATHS = ("/health", "/metrics")  # answered without the bearer token (probes, Prometheus)


def _error(error: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class BearerAuth:
    """Refuses HTTP requests without the bearer token (OPEN_PATHS excepted); plain ASGI, so a
    streamed response passes through untouched."""

    def __init__(self, app, token: str) -> None:
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                refusal = ApiError(401, "a valid bearer token is required (Authorization: Bearer ...)",
                                   kind="authentication_error", code="invalid_api_key")
                await _error(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Gateway:
    """The app and what it holds: the verifier client, the chat template, the model id."""

    def __init__(self, settings: GatewaySettings, *, model_dir, client: AsyncVerifierClient | None = None) -> None:
        self.settings = settings
        self.model_name = settings.served_model_name or model_dir.name
        self.template = ChatTemplate.for_checkpoint(model_dir)
        credentials = security.channel_credentials(settings.verifier_tls_ca, settings.verifier_tls_cert,
                                                   settings.verifier_tls_key, prefix="verifier_tls_")
        self.client = client or AsyncVerifierClient(
            settings.verifier, timeout=settings.timeout_s, credentials=credentials, token=settings.verifier_token,
            channel_options=[("grpc.service_config", ROUND_ROBIN)])
        self.created = int(time.time())
        self.metrics = GatewayMetrics()
        self.app = self._build()

    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await self.client.close()

        app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        if self.settings.auth_token is not None:
            app.add_middleware(BearerAuth, token=self.settings.auth_token)

        @app.get("/health")
        async def health():
            if await self.client.serving():
                return {"status": "ok"}
            return _error(ApiError(503, "the verifier is not serving (loading, draining or unreachable)",
                                   kind="server_error", code="unavailable"))

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                                 "owned_by": "tandem"}]}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._measured("completions", self._handle(request, chat=False))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._measured("chat_completions", self._handle(request, chat=True))

        return app

    async def _measured(self, endpoint: str, handling) -> Response:
        """Count the response by status and time it to its last byte (a stream's end)."""
        started = time.perf_counter()
        self.metrics.active.inc()
        try:
            response = await handling
        except BaseException:
            self.metrics.active.dec()
            raise

        finished = False

        def done() -> None:
            nonlocal finished
            if not finished:
                finished = True
                self.metrics.active.dec()
                self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
                self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - started)

        if isinstance(response, StreamingResponse):
            chunks, previous = response.body_iterator, response.background

            async def counted():
                try:
                    async for chunk in chunks:
                        yield chunk
                finally:
                    done()

            async def after() -> None:  # runs after the stream, also when its body never started
                if previous is not None:
                    await previous()
                done()

            response.body_iterator, response.background = counted(), BackgroundTask(after)
        else:
            done()
        return response

    async def _handle(self, request: Request, *, chat: bool):
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            try:
                body = await request.json()
            except ValueError:
                raise ApiError(400, "the request body is not valid JSON") from None
            config, stream, include_usage = parse(
                body, served_model=self.model_name, request_id=request_id,
                default_max_tokens=self.settings.default_max_tokens if chat else 16)
            if chat:
                try:
                    prompt = self.template.render(chat_messages(body))
                except ChatTemplateError as error:
                    raise ApiError(400, str(error), param="messages") from None
            else:
                prompt = completion_prompt(body)
        except ApiError as error:
            return _error(error, request_id)
        reply = Reply(request_id, self.model_name, chat=chat)
        # A child of the framework's HTTP span where one exists, else of the caller's trace
        # (its traceparent header).
        parent = None if trace.get_current_span().get_span_context().is_valid else \
            telemetry.extract_context(dict(request.headers))
        span = telemetry.tracer("tandem.gateway").start_span(
            "chat completion" if chat else "completion", kind=SpanKind.SERVER, context=parent,
            attributes={"tandem.request_id": request_id, "tandem.stream": stream})
        events = self._events(span, prompt, config)
        try:
            first = await anext(events)  # the verifier's verdict on the request, before any status
        except VerifierError as error:  # (the events generator has ended, and its span with it)
            log.info("request refused", request_id=request_id, code=error.code.name)
            return _error(ApiError.from_verifier(error, "messages" if chat else "prompt"), request_id)
        except StopAsyncIteration:
            first = None
        self.metrics.ttft_seconds.observe(time.perf_counter() - started)
        if stream:
            body_iter = reply.stream(first, events, include_usage)
            # events.aclose() afterwards: a client gone before the body starts would otherwise
            # leave the verifier call open until the generator is collected
            return StreamingResponse(body_iter, media_type="text/event-stream", headers={"x-request-id": request_id},
                                     background=BackgroundTask(events.aclose))
        try:
            generation = await reply.collect(first, events)
        except VerifierError as error:
            return _error(ApiError.from_verifier(error, "messages" if chat else "prompt"), request_id)
        return JSONResponse(reply.response(generation), headers={"x-request-id": request_id})

    async def _events(self, span, prompt, config) -> AsyncIterator:
        """The verifier's events; the gRPC call starts with the request's span current (so it
        becomes the span's child). The span is current only around that start: a streamed
        reply reads the rest from another task, where a context entered here cannot be left."""
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


class Reply:
    """OpenAI's response shapes for one request (completion or chat)."""

    def __init__(self, request_id: str, model: str, *, chat: bool) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self.accumulator = GenerationAccumulator()

    def _envelope(self, choices: list, **extra) -> dict:
        kind = ("chat.completion.chunk" if extra.pop("chunk", False) else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _choice(self, text: str | None, reason: str | None, *, chunk: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": None, "finish_reason": reason}

    async def collect(self, first, events) -> object:
        if first is not None:
            self.accumulator.add(first)
        async for event in events:
            self.accumulator.add(event)
        return self.accumulator.result()

    def response(self, generation) -> dict:
        choice = self._choice(generation.text, finish_reason(generation.finish_reason), chunk=False)
        return self._envelope([choice], usage=usage(generation))

    async def stream(self, first, events, include_usage: bool) -> AsyncIterator[str]:
        sent_first = False
        try:
            pending = [first] if first is not None else []
            while True:
                event = pending.pop() if pending else await anext(events, None)
                if event is None:
                    break
                self.accumulator.add(event)
                if event.HasField("final"):
                    continue
                text = event.text_delta if event.HasField("text_delta") else ""
                if text or (self.chat and not sent_first):
                    yield self._sse(self._envelope([self._choice(text, None, chunk=True, first=not sent_first)], chunk=True))
                    sent_first = True
            generation = self.accumulator.result()
            reason = finish_reason(generation.finish_reason)
            yield self._sse(self._envelope([self._choice(None, reason, chunk=True, first=not sent_first)], chunk=True))
            if include_usage:
                yield self._sse(self._envelope([], chunk=True, usage=usage(generation)))
        except VerifierError as error:  # after the status line: the error travels in the stream
            yield self._sse(ApiError.from_verifier(error).body())
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


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
    config = uvicorn.Config(gateway.app, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=settings.grace_s)
    server = _uvicorn_server()(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop taking connections, finish the open requests
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    log.info("gateway listening", host=settings.host, port=sock.getsockname()[1], verifier=settings.verifier,
             model=gateway.model_name)
    await server.serve(sockets=[sock])
    log.info("gateway stopped")


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
