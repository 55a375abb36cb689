"""shared.security against real grpc.aio servers on 127.0.0.1: TLS, mutual TLS, the bearer
token interceptor (on a server-streaming method, like Generate), and file errors."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.security import (
    BearerTokenInterceptor,
    add_port,
    bearer_metadata,
    channel_credentials,
    make_test_pki,
    open_channel,
    server_credentials,
)

pytest.importorskip("cryptography")

GENERATE = "/tandem.v1.Verifier/Generate"
TOKEN = "s3cret-token"
TIMEOUT = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return {name: str(path) for name, path in make_test_pki(tmp_path_factory.mktemp("pki")).items()}


# -- a tiny server: health + raw-bytes methods of all four shapes --------------------------


async def _generate(request: bytes, context):  # unary -> stream, like Verifier.Generate
    for chunk in (b"one:", request, b":three"):
        yield chunk


async def _unary(request: bytes, context) -> bytes:
    return b"unary:" + request


async def _client_stream(requests, context) -> bytes:
    return b"+".join([r async for r in requests])


async def _bidi(requests, context):
    async for request in requests:
        yield b"echo:" + request


HANDLERS = {
    "Generate": grpc.unary_stream_rpc_method_handler(_generate),
    "Unary": grpc.unary_unary_rpc_method_handler(_unary),
    "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream),
    "Bidi": grpc.stream_stream_rpc_method_handler(_bidi),
}
ALL_METHODS = tuple(f"/tandem.v1.Verifier/{name}" for name in HANDLERS)


@contextlib.asynccontextmanager
async def serving(credentials: grpc.ServerCredentials | None = None, interceptors=()):
    server = grpc.aio.server(interceptors=list(interceptors))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tandem.v1.Verifier", HANDLERS),))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = add_port(server, "127.0.0.1:0", credentials)
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


async def generate(channel: grpc.aio.Channel, metadata=()) -> list[bytes]:
    call = channel.unary_stream(GENERATE)  # no (de)serializers: raw bytes
    return [chunk async for chunk in call(b"two", metadata=metadata, timeout=TIMEOUT)]


async def check_health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    return reply.status


async def expect_code(awaitable, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    assert caught.value.code() == code, caught.value
    return caught.value


# -- TLS ------------------------------------------------------------------------------------


async def test_tls_with_the_right_ca_by_ip_and_by_name(pki):
    async with serving(server_credentials(pki["server_cert"], pki["server_key"], None)) as port:
        credentials = channel_credentials(pki["ca"])
        async with open_channel(f"127.0.0.1:{port}", credentials, []) as channel:  # IP SAN
            assert await generate(channel) == [b"one:", b"two", b":three"]
            assert await check_health(channel) == health_pb2.HealthCheckResponse.SERVING
        override = [("grpc.ssl_target_name_override", "localhost")]  # DNS SAN
        async with open_channel(f"127.0.0.1:{port}", credentials, override) as channel:
            assert await generate(channel) == [b"one:", b"two", b":three"]


async def test_tls_fails_with_the_wrong_ca_or_the_wrong_name(pki):
    async with serving(server_credentials(pki["server_cert"], pki["server_key"], None)) as port:
        async with open_channel(f"127.0.0.1:{port}", channel_credentials(pki["other_ca"]), []) as channel:
            await expect_code(check_health(channel), grpc.StatusCode.UNAVAILABLE)
        wrong_name = [("grpc.ssl_target_name_override", "drafter.example.com")]
        async with open_channel(f"127.0.0.1:{port}", channel_credentials(pki["ca"]), wrong_name) as channel:
            await expect_code(check_health(channel), grpc.StatusCode.UNAVAILABLE)


async def test_insecure_client_against_a_tls_server_fails(pki):
    async with (
        serving(server_credentials(pki["server_cert"], pki["server_key"], None)) as port,
        open_channel(f"127.0.0.1:{port}", None, []) as channel,
    ):
        await expect_code(check_health(channel), grpc.StatusCode.UNAVAILABLE)


async def test_insecure_server_and_channel_when_nothing_is_configured():
    assert server_credentials(None, None, None) is None
    assert channel_credentials(None) is None
    async with (
        serving(None) as port,
        open_channel(f"127.0.0.1:{port}", None, []) as channel,
    ):
        assert await generate(channel) == [b"one:", b"two", b":three"]


async def test_mutual_tls(pki):
    credentials = server_credentials(pki["server_cert"], pki["server_key"], pki["ca"])
    async with serving(credentials) as port:
        target = f"127.0.0.1:{port}"
        good = channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        async with open_channel(target, good, []) as channel:
            assert await generate(channel) == [b"one:", b"two", b":three"]
        async with open_channel(target, channel_credentials(pki["ca"]), []) as channel:  # no client cert
            await expect_code(check_health(channel), grpc.StatusCode.UNAVAILABLE)
        foreign = channel_credentials(pki["ca"], pki["other_client_cert"], pki["other_client_key"])
        async with open_channel(target, foreign, []) as channel:  # client cert from the other CA
            await expect_code(check_health(channel), grpc.StatusCode.UNAVAILABLE)


def test_channel_credentials_with_system_roots_and_a_client_cert(pki):
    assert isinstance(channel_credentials(None, pki["client_cert"], pki["client_key"]), grpc.ChannelCredentials)
    assert isinstance(channel_credentials(pki["ca"]), grpc.ChannelCredentials)


# -- file and argument errors ---------------------------------------------------------------


def test_missing_files_name_the_setting_and_path(pki, tmp_path):
    missing = str(tmp_path / "nope" / "server.pem")
    with pytest.raises(FileNotFoundError) as caught:
        server_credentials(missing, pki["server_key"], None)
    assert caught.value.errno == errno.ENOENT and caught.value.filename == missing
    assert "tls_cert" in str(caught.value) and missing in str(caught.value)
    with pytest.raises(FileNotFoundError, match="tls_client_ca"):
        server_credentials(pki["server_cert"], pki["server_key"], missing)
    with pytest.raises(FileNotFoundError, match="drafter_tls_key") as caught:
        channel_credentials(pki["ca"], pki["client_cert"], missing)
    assert missing in str(caught.value)


def test_unreadable_or_wrong_files_raise_value_error(pki, tmp_path):
    with pytest.raises(ValueError, match=r"tls_cert: cannot read"):
        server_credentials(str(tmp_path), pki["server_key"], None)  # a directory
    not_pem = tmp_path / "garbage.pem"
    not_pem.write_text("hello\n")
    with pytest.raises(ValueError, match=r"tls_key: .*garbage\.pem.* holds no PEM private key"):
        server_credentials(pki["server_cert"], str(not_pem), None)
    with pytest.raises(ValueError, match=r"drafter_tls_ca: .* holds no PEM certificate"):
        channel_credentials(pki["server_key"])  # a key where a certificate belongs


def test_incomplete_settings_raise_value_error(pki):
    with pytest.raises(ValueError, match="tls_cert needs tls_key"):
        server_credentials(pki["server_cert"], None, None)
    with pytest.raises(ValueError, match="tls_key needs tls_cert"):
        server_credentials(None, pki["server_key"], None)
    with pytest.raises(ValueError, match="tls_client_ca needs tls_cert"):
        server_credentials(None, None, pki["ca"])
    with pytest.raises(ValueError, match="drafter_tls_cert and drafter_tls_key"):
        channel_credentials(pki["ca"], pki["client_cert"])


async def test_mismatched_key_fails_to_bind(pki):
    server = grpc.aio.server()
    credentials = server_credentials(pki["server_cert"], pki["client_key"], None)
    with pytest.raises(RuntimeError, match="could not bind 127.0.0.1:0 .*tls_cert and tls_key"):
        add_port(server, "127.0.0.1:0", credentials)


# -- bearer token ---------------------------------------------------------------------------


def test_bearer_metadata():
    assert bearer_metadata(None) == ()
    assert bearer_metadata("abc") == (("authorization", "Bearer abc"),)


async def test_bearer_token_on_a_streaming_method():
    async with (
        serving(interceptors=[BearerTokenInterceptor(TOKEN)]) as port,
        open_channel(f"127.0.0.1:{port}", None, []) as channel,
    ):
        error = await expect_code(generate(channel), grpc.StatusCode.UNAUTHENTICATED)
        assert error.details() == "missing bearer token"
        for wrong in (bearer_metadata("nope"), bearer_metadata(TOKEN + "x"), (("authorization", f"Basic {TOKEN}"),)):
            error = await expect_code(generate(channel, wrong), grpc.StatusCode.UNAUTHENTICATED)
            assert error.details() == "invalid bearer token"
        assert await generate(channel, bearer_metadata(TOKEN)) == [b"one:", b"two", b":three"]
        assert await generate(channel, (("authorization", f"bearer {TOKEN}"),)) == [b"one:", b"two", b":three"]
        # health stays open without a token
        assert await check_health(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_bearer_token_only_guards_the_protected_methods():
    async with (
        serving(interceptors=[BearerTokenInterceptor(TOKEN)]) as port,
        open_channel(f"127.0.0.1:{port}", None, []) as channel,
    ):
        assert await channel.unary_unary("/tandem.v1.Verifier/Unary")(b"x", timeout=TIMEOUT) == b"unary:x"
        # an unknown method is still UNIMPLEMENTED, not UNAUTHENTICATED
        await expect_code(channel.unary_unary("/tandem.v1.Verifier/Nope")(b"x", timeout=TIMEOUT),
                          grpc.StatusCode.UNIMPLEMENTED)


async def test_bearer_token_rejects_every_handler_shape():
    async def requests():
        yield b"a"
        yield b"b"

    async def no_requests():
        # A rejected streaming-request call gets no messages: a client write racing the
        # server's abort surfaces as INTERNAL on the client, which is not what is tested here.
        return
        yield

    async with (
        serving(interceptors=[BearerTokenInterceptor(TOKEN, ALL_METHODS)]) as port,
        open_channel(f"127.0.0.1:{port}", None, []) as channel,
    ):
        unary = channel.unary_unary("/tandem.v1.Verifier/Unary")
        client_stream = channel.stream_unary("/tandem.v1.Verifier/ClientStream")
        bidi = channel.stream_stream("/tandem.v1.Verifier/Bidi")

        async def bidi_all(metadata, messages=requests):
            return [r async for r in bidi(messages(), metadata=metadata, timeout=TIMEOUT)]

        for call in (unary(b"x", timeout=TIMEOUT), client_stream(no_requests(), timeout=TIMEOUT),
                     bidi_all((), no_requests), generate(channel)):
            error = await expect_code(call, grpc.StatusCode.UNAUTHENTICATED)
            assert error.details() == "missing bearer token"
        token = bearer_metadata(TOKEN)
        assert await unary(b"x", metadata=token, timeout=TIMEOUT) == b"unary:x"
        assert await client_stream(requests(), metadata=token, timeout=TIMEOUT) == b"a+b"
        assert await bidi_all(token) == [b"echo:a", b"echo:b"]


async def test_tls_mtls_and_token_together(pki):
    credentials = server_credentials(pki["server_cert"], pki["server_key"], pki["ca"])
    async with serving(credentials, [BearerTokenInterceptor(TOKEN)]) as port:
        client = channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        async with open_channel(f"localhost:{port}", client, []) as channel:
            await expect_code(generate(channel), grpc.StatusCode.UNAUTHENTICATED)
            assert await generate(channel, bearer_metadata(TOKEN)) == [b"one:", b"two", b":three"]


@pytest.mark.parametrize("token", ["", " padded", "tab\there", "caf\u00e9"])
def test_bad_tokens_are_refused(token):
    with pytest.raises(ValueError, match="auth_token"):
        BearerTokenInterceptor(token)


def test_make_test_pki_files(tmp_path):
    paths = make_test_pki(tmp_path)
    assert sorted(p.name for p in paths.values()) == sorted([
        "ca.pem", "server.pem", "server.key", "client.pem", "client.key",
        "other-ca.pem", "other-client.pem", "other-client.key",
    ])
    assert all(Path(p).parent == tmp_path for p in paths.values())
    assert paths["server_key"].stat().st_mode & 0o077 == 0
