"""Who may call a host: its keys, each with a name and a role.

- ``admin``: everything, every session (a single ``serve --token`` is the one admin key);
- ``client``: the Sessions service; sees and touches only the sessions it created;
- ``peer``: only the host-to-host Migration service (what hosts dial each other with).

``serve --tokens FILE`` reads one key per line, ``NAME ROLE TOKEN`` (``#`` starts a
comment); see docs/security.md. Tokens are compared in constant time. Pure Python.
"""

from __future__ import annotations

import hmac
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, TooManyCallsError

ROLES = ("admin", "client", "peer")
MIN_TOKEN = 16  # characters: shorter keys are refused (a guessable key is no key)


@dataclass(frozen=True)
class Key:
    name: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


NOBODY = Key("", "admin")  # a host serving without auth (--no-auth, loopback only)


class CallQuota:
    """Calls each client key has in flight on a host, against one limit (``limit``;
    0: none) shared by every protocol the host serves, gRPC and HTTP, so one key
    cannot take every worker thread. Admin and peer keys are not rationed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight: dict[str, int] = {}
        self.lock = threading.Lock()

    def rationed(self, key: Key) -> bool:
        return key.role == "client" and self.limit > 0

    def enter(self, key: Key) -> None:
        """Count one more call of ``key``; TooManyCallsError at its limit."""
        if not self.rationed(key):
            return
        with self.lock:
            if self.in_flight.get(key.name, 0) >= self.limit:
                raise TooManyCallsError(f"key '{key.name}' has {self.limit} calls in flight, its limit; "
                                        "retry when one ends")
            self.in_flight[key.name] = self.in_flight.get(key.name, 0) + 1

    def leave(self, key: Key) -> None:
        if self.rationed(key):
            with self.lock:
                self.in_flight[key.name] -= 1


class Keyring:
    def __init__(self, keys: dict[str, Key]):
        if not keys:
            raise ConfigError("no keys: give --token, --token-file or --tokens")
        self._keys = {f"Bearer {t}".encode(): k for t, k in keys.items()}
        self._tokens = dict(keys)

    @classmethod
    def build(cls, token: str | None = None, tokens_file: str | os.PathLike | None = None,
              peer_token: str | None = None) -> "Keyring":
        keys: dict[str, Key] = {}
        if token:
            keys[token] = Key("admin", "admin")
        if peer_token:
            keys[peer_token] = Key("peer", "peer")
        if tokens_file:
            for t, k in parse_file(tokens_file).items():
                if t in keys:
                    raise ConfigError(f"{tokens_file}: key '{k.name}' repeats another key's token")
                keys[t] = k
        return cls(keys)

    def lookup(self, authorization: str | bytes) -> Key | None:
        """The key an ``authorization`` header carries (every key compared, in constant time)."""
        got = authorization.encode() if isinstance(authorization, str) else authorization
        found = None
        for expected, key in self._keys.items():
            if hmac.compare_digest(got, expected):
                found = key
        return found

    def outgoing(self) -> str | None:
        """The token this host dials its peers with: a peer key, else the admin key."""
        by_role = {k.role: t for t, k in self._tokens.items()}
        return by_role.get("peer") or by_role.get("admin")

    def to_text(self) -> str:
        return "".join(f"{k.name} {k.role} {t}\n" for t, k in self._tokens.items())

    def __len__(self) -> int:
        return len(self._keys)


def parse(text: str, where: str, min_len: int = MIN_TOKEN) -> dict[str, Key]:
    keys: dict[str, Key] = {}
    names: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ConfigError(f"{where}:{n}: expected 'NAME ROLE TOKEN', got {len(parts)} fields")
        name, role, token = parts
        if role not in ROLES:
            raise ConfigError(f"{where}:{n}: role '{role}' is not one of {', '.join(ROLES)}")
        if len(token) < min_len:
            raise ConfigError(f"{where}:{n}: the token of '{name}' is shorter than {min_len} characters")
        if name in names or token in keys:
            raise ConfigError(f"{where}:{n}: key '{name}' repeats a name or a token")
        names.add(name)
        keys[token] = Key(name, role)
    return keys


def parse_file(path: str | os.PathLike, min_len: int = MIN_TOKEN) -> dict[str, Key]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the keys file: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the keys file is not UTF-8 text") from None
    return parse(text, str(path), min_len)


def hand_over(keys: Keyring) -> str:
    """Write ``keys`` to a new private file (mode 0600, never an existing path) for a
    host process on this machine to read: tokens stay out of argv and Ray's actor arguments."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="kvferry-keys-")
    with os.fdopen(fd, "w") as f:
        f.write(keys.to_text())
    return path


def take_over(path: str) -> Keyring:
    """Read (and delete) a file written by :func:`hand_over`."""
    try:
        return Keyring(parse_file(path, min_len=1))
    finally:
        Path(path).unlink(missing_ok=True)


def read_token_file(path: str | os.PathLike) -> str:
    """A token kept in a file (``--token-file``): its first line."""
    try:
        token = Path(path).read_text().strip().splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError):
        raise ConfigError(f"{path}: cannot read a token from it") from None
    if not token:
        raise ConfigError(f"{path}: the token file is empty")
    return token
