"""Transport security for both services: TLS, mutual TLS and a bearer token.

Server side (`tls_cert`, `tls_key`, `tls_client_ca` settings):

    credentials = server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    port = add_port(server, settings.address, credentials)      # insecure when credentials is None

Client side (the verifier towards the drafter: `drafter_tls_ca`, `drafter_tls_cert`,
`drafter_tls_key`):

    credentials = channel_credentials(settings.drafter_tls_ca, settings.drafter_tls_cert, settings.drafter_tls_key)
    channel = open_channel(target, credentials, options)        # insecure when credentials is None

Bearer token (`auth_token`): `BearerTokenInterceptor(token)` on the server rejects calls to
the protected methods (by default `Verifier.Generate`) that lack `authorization: Bearer
<token>` with UNAUTHENTICATED; health checks and reflection stay open. Callers send
`metadata=bearer_metadata(token)`. Send a token only over TLS (or loopback): it travels in
clear text on an insecure channel.

`make_test_pki(directory)` writes a throwaway CA, server and client certificates for tests
and local trials; it needs the `cryptography` package (a test dependency), imported only
when it is called.
"""

from __future__ import annotations

import errno
import hmac
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "BearerTokenInterceptor",
    "add_port",
    "bearer_metadata",
    "channel_credentials",
    "make_test_pki",
    "open_channel",
    "server_credentials",
]

AUTHORIZATION = "authorization"
BEARER = "bearer"
GENERATE_METHOD = "/tandem.v1.Verifier/Generate"


def _read_pem(path: str, setting: str, kind: str) -> bytes:
    """The bytes of a PEM file holding a `kind` ("certificate" or "private key") block;
    FileNotFoundError / ValueError naming the setting and the path."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{setting}: no such file", path) from None
    except OSError as exc:
        raise ValueError(f"{setting}: cannot read {path!r}: {exc.strerror or exc}") from None
    marker = b"-----BEGIN CERTIFICATE-----" if kind == "certificate" else b"PRIVATE KEY-----"
    if marker not in data:
        raise ValueError(f"{setting}: {path!r} holds no PEM {kind}")
    return data


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None, *, prefix: str = "tls_"
) -> grpc.ServerCredentials | None:
    """TLS server credentials from PEM files, or None (serve insecure) when `cert` is None.

    With `client_ca`, clients must present a certificate signed by it (mutual TLS). `prefix`
    names the settings in error messages (`tls_cert`, `tls_key`, `tls_client_ca`).
    """
    if cert is None:
        if key is not None or client_ca is not None:
            given = f"{prefix}key" if key is not None else f"{prefix}client_ca"
            raise ValueError(f"{given} needs {prefix}cert (serving TLS)")
        return None
    if key is None:
        raise ValueError(f"{prefix}cert needs {prefix}key")
    chain = _read_pem(cert, f"{prefix}cert", "certificate")
    private_key = _read_pem(key, f"{prefix}key", "private key")
    roots = None if client_ca is None else _read_pem(client_ca, f"{prefix}client_ca", "certificate")
    return grpc.ssl_server_credentials(
        [(private_key, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None, *, prefix: str = "drafter_tls_"
) -> grpc.ChannelCredentials | None:
    """TLS channel credentials from PEM files, or None (insecure channel) when all are None.

    `ca` verifies the server's certificate (None: the system's roots); `cert` and `key` (both
    or neither) are the client certificate for mutual TLS. `prefix` names the settings in
    error messages (`drafter_tls_ca`, `drafter_tls_cert`, `drafter_tls_key`).
    """
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise ValueError(f"{prefix}cert and {prefix}key must be given together")
    roots = None if ca is None else _read_pem(ca, f"{prefix}ca", "certificate")
    chain = None if cert is None else _read_pem(cert, f"{prefix}cert", "certificate")
    private_key = None if key is None else _read_pem(key, f"{prefix}key", "private key")
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=private_key, certificate_chain=chain)


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `address` with TLS when `credentials` is given, else insecure; the bound port.

    RuntimeError when the address cannot be bound (in use, bad address) or, with TLS, when
    the certificate and key do not load (mismatched pair, corrupt PEM).
    """
    busy = _port_in_use(address)
    if busy:  # (gRPC's core would log a raw error line before raising: say it once, plainly)
        raise RuntimeError(f"could not bind {address}: {busy}")
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        hint = " (with TLS: check that tls_cert and tls_key are a matching, valid PEM pair)" if credentials else ""
        raise RuntimeError(f"could not bind {address}{hint}: {exc}") from None
    if port == 0:  # older grpcio returned 0 instead of raising
        hint = " (with TLS: check that tls_cert and tls_key are a matching, valid PEM pair)" if credentials else ""
        raise RuntimeError(f"could not bind {address}{hint}")
    return port


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`: TLS when `credentials` is given, else insecure.

    Looked up on `grpc.aio` at call time, so instrumentation that wraps those functions
    (OpenTelemetry) still applies.
    """
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, credentials, options=list(options))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (`authorization: Bearer <token>`), or () without one."""
    return () if token is None else ((AUTHORIZATION, f"Bearer {token}"),)


def _rejecting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `code` and reads nothing.

    Requests stay raw bytes (no deserializer) so that a rejected call never reaches the
    method's message parsing.
    """

    async def reject(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def reject_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext):
        # An async generator, like the handlers it stands in for: wrappers such as the
        # OpenTelemetry server instrumentation iterate a response-streaming handler.
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(reject_stream)
    return grpc.unary_unary_rpc_method_handler(reject)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on the protected methods (full names,
    `/package.Service/Method`); others (health, reflection) pass untouched.

    A call without the header ends with UNAUTHENTICATED "missing bearer token", one with a
    wrong token or scheme with UNAUTHENTICATED "invalid bearer token". Tokens are compared in
    constant time; the scheme name is case-insensitive (RFC 6750).
    """

    def __init__(self, token: str, protected_methods: tuple[str, ...] = (GENERATE_METHOD,)) -> None:
        if not token:
            raise ValueError("auth_token must not be empty")
        if token != token.strip() or not all(" " <= ch <= "~" for ch in token):
            raise ValueError("auth_token must be printable ASCII without leading or trailing whitespace")
        if isinstance(protected_methods, str):
            raise TypeError("protected_methods must be a tuple of method names, not a string")
        self._token = token.encode("ascii")
        self.protected_methods = frozenset(protected_methods)

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """None when `metadata` carries the token, else the rejection message."""
        values = [value for key, value in (metadata or ()) if key.lower() == AUTHORIZATION]
        if not values:
            return "missing bearer token"
        valid = False
        for value in values:
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
            scheme, _, credential = raw.strip().partition(b" ")
            if scheme.lower() == BEARER.encode():
                # compare every value (no early exit) so timing says nothing about which matched
                valid |= hmac.compare_digest(credential.strip(), self._token)
        return None if valid else "invalid bearer token"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.protected_methods:
            return handler
        problem = self.check(handler_call_details.invocation_metadata)
        if problem is None:
            return handler
        return _rejecting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, problem)


def make_test_pki(directory: Path, *, days: int = 30) -> dict[str, Path]:
    """Write a throwaway PKI for tests and local trials (never for production) into `directory`.

    Files (keys unencrypted, mode 0600):
      ca.pem                                    the CA
      server.pem, server.key                    "localhost", SAN DNS:localhost and IP:127.0.0.1, signed by the CA
      client.pem, client.key                    a client certificate signed by the CA
      other-ca.pem                              an unrelated second CA
      other-client.pem, other-client.key        a client certificate signed by the other CA

    Returns {"ca", "server_cert", "server_key", "client_cert", "client_key", "other_ca",
    "other_client_cert", "other_client_key"} -> path. Needs `cryptography` (test dependency):

        python -c "from pathlib import Path; from shared.security import make_test_pki; make_test_pki(Path('pki'))"
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)

    def name(common_name: str) -> x509.Name:
        return x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem test PKI"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ])

    def build(subject: str, key, issuer_name: x509.Name, issuer_key, issuer_cert, *, ca: bool = False,
              usage=None, san=None) -> x509.Certificate:
        public = key.public_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer_name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
        else:
            builder = builder.add_extension(
                x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            ).add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if issuer_cert is not None:
            ski = issuer_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
            )
        if san is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write_cert(filename: str, cert: x509.Certificate) -> Path:
        path = directory / filename
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    def write_key(filename: str, key) -> Path:
        path = directory / filename
        path.write_bytes(b"")
        path.chmod(0o600)
        path.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ))
        return path

    def new_key():
        return ec.generate_private_key(ec.SECP256R1())

    def new_ca(common_name: str):
        key = new_key()
        return key, build(common_name, key, name(common_name), key, None, ca=True)

    ca_key, ca_cert = new_ca("tandem test CA")
    other_ca_key, other_ca_cert = new_ca("tandem other test CA")
    server_key, client_key, other_client_key = new_key(), new_key(), new_key()
    server_cert = build(
        "localhost", server_key, ca_cert.subject, ca_key, ca_cert, usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_cert = build("tandem-client", client_key, ca_cert.subject, ca_key, ca_cert,
                        usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other_client_cert = build("tandem-other-client", other_client_key, other_ca_cert.subject, other_ca_key,
                              other_ca_cert, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {
        "ca": write_cert("ca.pem", ca_cert),
        "server_cert": write_cert("server.pem", server_cert),
        "server_key": write_key("server.key", server_key),
        "client_cert": write_cert("client.pem", client_cert),
        "client_key": write_key("client.key", client_key),
        "other_ca": write_cert("other-ca.pem", other_ca_cert),
        "other_client_cert": write_cert("other-client.pem", other_client_cert),
        "other_client_key": write_key("other-client.key", other_client_key),
    }


def _port_in_use(address: str) -> str | None:
    """Why `address` (host:port) cannot be bound because something listens there (None: it can,
    or the check cannot tell and gRPC's bind will say). SO_REUSEADDR as gRPC's own bind sets it:
    a port held only by connections closing (TIME_WAIT) is not in use."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or None
    if not port.isdigit() or int(port) == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return "the port is in use (another process listens on it)"
    return None
