"""gRPC plumbing both ends share: channels, TLS, the token, and errors on the wire.

An error crosses the wire as a gRPC status and, in the trailing metadata key
``kvferry-error``, the :class:`~kvferry.errors.KvferryError` code that names it:
:func:`abort` sends it, :func:`translate` maps it back to the same class. Only
grpcio is needed here, so the SDK stays a thin client.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from .errors import (CODES, ERROR_KEY, AuthError, ConfigError, ForbiddenError, HostDownError, KvferryError,
                     RemoteError, TooManyCallsError, remote)

MAX_MESSAGE = (256 << 20) + (1 << 20)  # a checkpoint frame (checkpoint.bodies.MAX_BODY) plus its envelope
HEALTH_SERVICE = "/grpc.health.v1.Health/"
MIGRATION_SERVICE = "/kvferry.v1.Migration/"


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 20000)]


@dataclass
class TLSConfig:
    cert: str | None = None  # server (or client) certificate chain, PEM path
    key: str | None = None
    ca: str | None = None  # CA to verify the peer; on a server it makes TLS mutual

    def check(self, server: bool = False) -> None:
        """One line for a file that cannot be read, or a server certificate without its
        key, before anything starts (a host would die of it in its actor)."""
        for path in (self.cert, self.key, self.ca):
            _read(path)
        if server and self.cert and not self.key:
            raise ConfigError(f"{self.cert}: a TLS certificate needs its private key (--tls-key)")

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key), _read(self.cert))]
        if self.ca:
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def ssl_server_context(self):
        """The same server certificate (and, with ``ca``, the same client-certificate
        requirement) for a non-gRPC server of the host (its HTTP front)."""
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the TLS file ({e.strerror or e})") from None


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
    """Every call must carry a key of the host's keyring (kvferry.keys), whose role
    allows the service: peers only the host-to-host Migration service, clients only
    the Sessions service, admins both. ``keys`` None: no auth (loopback only)."""

    def __init__(self, keys: Any, quota: Any = None):
        """``quota``: a kvferry.keys.CallQuota counting the client keys' calls (None: no limit)."""
        self.keys = keys
        self.quota = quota

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if self.keys is None or handler is None or details.method.startswith(HEALTH_SERVICE):
            return handler  # probes carry no token; the health service reveals only the status
        key = self.keys.lookup(dict(details.invocation_metadata).get("authorization", ""))
        migration = details.method.startswith(MIGRATION_SERVICE)
        if key is None:
            error: KvferryError = AuthError("auth failed: missing or wrong token")
        elif migration and key.role not in ("peer", "admin"):
            error = ForbiddenError(f"key '{key.name}' is a {key.role} key: the migration service takes "
                                   "only hosts (a peer key)")
        elif not migration and key.role == "peer":
            error = ForbiddenError(f"key '{key.name}' is a peer key: it may only migrate sessions between hosts")
        elif self.quota is None or not self.quota.rationed(key):
            return handler  # admins and peer hosts are not rationed
        else:
            try:
                self.quota.enter(key)
                return self._counted(handler, key)
            except TooManyCallsError as e:
                error = e

        def deny(request, context):
            abort(context, error)

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)

    def _counted(self, handler, key: Any):
        """``handler``, counting one call of ``key`` until it ends (taken by the quota's enter)."""
        behavior = (handler.stream_stream or handler.stream_unary or handler.unary_stream
                    or handler.unary_unary)
        if handler.response_streaming:
            def run(request, context):
                try:
                    yield from behavior(request, context)
                finally:
                    self.quota.leave(key)
        else:
            def run(request, context):
                try:
                    return behavior(request, context)
                finally:
                    self.quota.leave(key)
        make = {(True, True): grpc.stream_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (False, False): grpc.unary_unary_rpc_method_handler}[(handler.request_streaming,
                                                                       handler.response_streaming)]
        return make(run, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
