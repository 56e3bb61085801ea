"""gRPC plumbing both ends share: channels, TLS, the token, and errors on the wire.

An error crosses the wire as a gRPC status and, in the trailing metadata key
``kvferry-error``, the :class:`~kvferry.errors.KvferryError` code that names it:
:func:`abort` sends it, :func:`translate` maps it back to the same class. Only
grpcio is needed here, so the SDK stays a thin client.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from .errors import CODES, ERROR_KEY, AuthError, HostDownError, KvferryError, RemoteError, remote

MAX_MESSAGE = 64 << 20
HEALTH_SERVICE = "/grpc.health.v1.Health/"


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 20000)]


@dataclass
class TLSConfig:
    cert: str | None = None  # server (or client) certificate chain, PEM path
    key: str | None = None
    ca: str | None = None  # CA to verify the peer; on a server it makes TLS mutual

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key), _read(self.cert))]
        if self.ca:
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def channel(address: str, tls: TLSConfig | None = None, *, aio: bool = False) -> Any:
    """A client channel (``aio``: a grpc.aio one), TLS when ``tls`` has a CA or cert."""
    g = grpc.aio if aio else grpc
    if tls is not None and (tls.ca or tls.cert):
        return g.secure_channel(address, tls.channel_credentials(), options=grpc_options())
    return g.insecure_channel(address, options=grpc_options())


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


# ----------------------------------------------------------------------------- errors

MOVED_KEY = "kvferry-moved-to"  # with session_moved: the host the session went to


def abort(context: Any, e: KvferryError) -> NoReturn:
    """End the call with ``e``'s status, one-line message and code."""
    meta = [(ERROR_KEY, e.code)]
    if getattr(e, "moved_to", ""):
        meta.append((MOVED_KEY, e.moved_to))
    context.set_trailing_metadata(tuple(meta))
    context.abort(getattr(grpc.StatusCode, e.status, grpc.StatusCode.UNKNOWN), str(e))


def translate(e: grpc.RpcError, address: str) -> RemoteError:
    """The SDK's exception for a failed call: the class the host's code names,
    else one chosen by the status (auth, unreachable), else RemoteError."""
    code, details = e.code(), (e.details() or "")
    try:
        meta = dict(e.trailing_metadata() or ())
    except Exception:  # a call that never reached a server has no metadata
        meta = {}
    sent = meta.get(ERROR_KEY)
    if sent == AuthError.code or code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"{address}: auth failed (missing or wrong token)")
    if sent in CODES:
        r = remote(CODES[sent], f"{address}: {details or sent}")
        r.moved_to = meta.get(MOVED_KEY, "")
        return r
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return HostDownError(f"{address}: host down or unreachable ({code.name.lower()})")
    return RemoteError(f"{address}: {details or code.name.lower()}")


class AuthInterceptor(grpc.ServerInterceptor):
    """Every call must carry the shared secret; compared in constant time."""

    def __init__(self, token: str | None):
        self.expected = f"Bearer {token}".encode() if token else None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if self.expected is None or handler is None or details.method.startswith(HEALTH_SERVICE):
            return handler  # probes carry no token; the health service reveals only the status
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self.expected):
            return handler

        def deny(request, context):
            abort(context, AuthError("auth failed: missing or wrong token"))

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
