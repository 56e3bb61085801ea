"""kvferry's exceptions: one base class, one line each, one machine-readable code.

The CLI prints ``kvferry: <message>`` and exits non-zero for these; anything
else is a bug and keeps its traceback.

Across the network an error travels as a gRPC status plus its ``code`` in the
trailing metadata key ``kvferry-error`` (see :mod:`kvferry.transport`); the SDK
maps the code back to the same class, mixed with :class:`RemoteError`, so
``except UnknownSessionError`` catches it on either side of the wire and
``except RemoteError`` catches everything a host refused. The codes are listed
in docs/sdk.md; they are an API: never rename one.

This module imports nothing: a client must be able to load it for free.
"""

from __future__ import annotations

ERROR_KEY = "kvferry-error"  # gRPC trailing-metadata key carrying ``code``


class KvferryError(Exception):
    """Base class for errors caused by input or environment, not by a bug."""

    code = "failed"  # machine-readable, stable
    status = "FAILED_PRECONDITION"  # the gRPC status it travels with


class ConfigError(KvferryError):
    """An option value is unknown, out of range or contradicts another."""
    code, status = "invalid_argument", "INVALID_ARGUMENT"


class ModelFormatError(KvferryError):
    """A model file (GGUF, config, weights) is malformed or unsupported."""
    code, status = "model_format", "INVALID_ARGUMENT"


class ModelNotFoundError(KvferryError):
    """A model name or path does not resolve to an installed model."""
    code, status = "model_not_found", "NOT_FOUND"


class ModelMismatchError(KvferryError):
    """A session or checkpoint belongs to another model than the host serves."""
    code, status = "model_mismatch", "FAILED_PRECONDITION"


class SessionError(KvferryError):
    """A session cannot continue (bad guest output, context exhausted, …)."""
    code, status = "session_failed", "FAILED_PRECONDITION"


class PromptTooLongError(SessionError):
    """The prompt does not fit the session's context."""
    code, status = "prompt_too_long", "INVALID_ARGUMENT"


class UnknownSessionError(SessionError):
    """No session of that id on that host."""
    code, status = "unknown_session", "NOT_FOUND"


class SessionMovedError(UnknownSessionError):
    """The session migrated away from this host; ``moved_to`` says where (the SDK
    follows it; a client that does not know the code sees an unknown session)."""
    code, status = "session_moved", "NOT_FOUND"

    def __init__(self, message: str, moved_to: str = ""):
        super().__init__(message)
        self.moved_to = moved_to


class SessionExistsError(SessionError):
    """A session of that id is already on that host."""
    code, status = "session_exists", "ALREADY_EXISTS"


class SessionBusyError(SessionError):
    """Another turn, snapshot or migration holds the session; try again later."""
    code, status = "session_busy", "ABORTED"


class GuestError(KvferryError):
    """A guest module cannot be loaded or does not fit the ABI."""
    code, status = "guest_invalid", "INVALID_ARGUMENT"


class GuestTrap(KvferryError):
    """A running guest trapped or hit a limit. The guest is unusable afterwards."""
    code, status = "guest_trap", "FAILED_PRECONDITION"


class GuestAbiError(Exception):
    """Raised inside a host function when the guest passed a bad argument
    (becomes a :class:`GuestTrap` at the call boundary; never seen by users)."""


class CheckpointError(KvferryError):
    """A checkpoint is corrupt, truncated, hostile or does not fit this host."""
    code, status = "checkpoint_invalid", "INVALID_ARGUMENT"


class CheckpointModelError(CheckpointError, ModelMismatchError):
    """A checkpoint made with another model than this host serves."""
    code, status = "model_mismatch", "FAILED_PRECONDITION"


class OutOfMemoryError(CheckpointError):
    """The session's KV does not fit the memory this host may use."""
    code, status = "out_of_memory", "RESOURCE_EXHAUSTED"


class MigrationError(KvferryError):
    """A migration did not complete; the session stays where it was."""
    code, status = "migration_failed", "ABORTED"


class HostDrainingError(KvferryError):
    """The host is draining (stopping): it takes no new sessions; use another."""
    code, status = "host_draining", "UNAVAILABLE"


class HostFullError(KvferryError):
    """The host holds as many sessions as it may (``serve --max-sessions``); use another."""
    code, status = "host_full", "RESOURCE_EXHAUSTED"


class TooManyCallsError(KvferryError):
    """The caller's key has as many calls in flight as it may; retry when one ends."""
    code, status = "too_many_calls", "RESOURCE_EXHAUSTED"


class ForbiddenError(KvferryError):
    """The caller's key may not do this (a client key on the host-to-host service, a
    migration to a host that is not a peer)."""
    code, status = "permission_denied", "PERMISSION_DENIED"


class InternalError(KvferryError):
    """A fault inside the host (a bug, not the caller's input): the host logged its
    traceback, and a session it hit keeps its state from before the call."""
    code, status = "internal", "INTERNAL"


class RemoteError(KvferryError):
    """The host refused or failed the call; the message says why. Raised by the
    SDK only, mixed into the class the host's ``code`` names."""
    code, status = "remote", "UNKNOWN"


class AuthError(RemoteError):
    """Missing or wrong token."""
    code, status = "unauthenticated", "UNAUTHENTICATED"


class HostDownError(RemoteError):
    """The host is unreachable or did not answer in time."""
    code, status = "host_unavailable", "UNAVAILABLE"


def _all(cls: type) -> list[type]:
    return [cls] + [d for c in cls.__subclasses__() for d in _all(c)]


# code -> the class that defines it (a subclass only inherits a code it does not redefine)
CODES: dict[str, type[KvferryError]] = {}
for _c in _all(KvferryError):
    if "code" in _c.__dict__:
        CODES.setdefault(_c.code, _c)
CODES["model_mismatch"] = ModelMismatchError  # a client needs no checkpoint to catch it

_remote: dict[type, type] = {}


def remote(cls: type[KvferryError], message: str) -> RemoteError:
    """The exception the SDK raises for a host's ``cls``: both ``cls`` and RemoteError."""
    if issubclass(cls, RemoteError):
        return cls(message)
    if cls is SessionMovedError or issubclass(cls, SessionMovedError):
        cls = SessionMovedError
    r = _remote.get(cls)
    if r is None:
        r = _remote[cls] = type(cls.__name__, (RemoteError, cls), {"__module__": __name__, "remote_of": cls,
                                                                   "code": cls.code, "status": cls.status})
    return r(message)
