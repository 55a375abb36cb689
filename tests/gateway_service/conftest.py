"""A real verifier (embedded model and tokenizer) on a gRPC port and a real gateway on an
HTTP port, both in the test's process and event loop; and raw HTTP for what the `openai`
client would never send."""

import asyncio
import json

import openai
import pytest

from gateway_service.server import Gateway, start_in_loop
from gateway_service.settings import GatewaySettings
from shared.model import load_model
from shared.model.registry import resolve_model
from shared.tokenizer import load_tokenizer
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

MODEL = "tandem-demo-moe"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def embedded():
    path = resolve_model(None)
    return path, load_model(path), load_tokenizer(path)


class Edge:
    def __init__(self):
        self.verifier = self.server = self.task = None

    async def start(self, embedded, *, verifier=None, **gateway_settings):
        path, model, tokenizer = embedded
        self.verifier = VerifierServer(VerifierSettings(port=0, **(verifier or {})), model=model, tokenizer=tokenizer)
        vport = await self.verifier.start()
        await self.verifier.wait_loaded()
        self.address = f"127.0.0.1:{vport}"
        self.gateway = gateway = Gateway(GatewaySettings(verifier=self.address, port=0, **gateway_settings),
                                         model_dir=path)
        self.server, self.task, port = await start_in_loop(gateway)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=gateway_settings.get("auth_token") or "none",
                                  max_retries=0)

    async def stop(self):
        if self.server is not None:
            self.server.should_exit = True
            await self.task
        if self.verifier is not None:
            await self.verifier.stop(0)


@pytest.fixture
async def edge():
    e = Edge()
    yield e
    await e.stop()



async def raw_http(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict, bytes]:
    """One HTTP/1.1 exchange on a fresh connection: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            content = await reader.readexactly(int(headers["content-length"]))
        else:
            content = await reader.read()
        return int(status_line.split()[1]), headers, content
    finally:
        writer.close()


async def post(port: int, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    """POST a body as given (bytes: not even valid JSON); returns (status, JSON answer)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n{extra}"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    status, _, content = await raw_http(port, head, raw)
    return status, json.loads(content)


def assert_openai_error(answer: dict, param: str | None) -> dict:
    """OpenAI's error shape, naming `param`; returns the error."""
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["param"] == param, answer
    return answer["error"]


class EventStream:
    """A streamed completion read event by event off a raw connection (the `openai` client
    raises on an error event; these tests look at the events themselves)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int) -> None:
        self.reader, self.writer, self.status = reader, writer, status

    @classmethod
    async def open(cls, port: int, body: dict, path: str = "/v1/completions") -> "EventStream":
        raw = json.dumps({**body, "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                      f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw)
        status = int((await reader.readline()).split()[1])
        while await reader.readline() not in (b"\r\n", b""):  # headers
            pass
        return cls(reader, writer, status)

    async def next(self) -> dict | str | None:
        """The next event's data (parsed JSON, or "[DONE]"); None at the end of the stream."""
        while True:
            line = await self.reader.readline()
            if not line:
                return None
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[len(b"data: "):].decode()
                return data if data == "[DONE]" else json.loads(data)
            # (chunked-encoding size lines and blank separators carry no event)

    async def rest(self) -> list:
        events = []
        while (event := await self.next()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        self.writer.close()
