"""The kvferry Python SDK: talk to session hosts over gRPC.

    from kvferry import Client
    client = Client("127.0.0.1:50051", token="...")
    s = client.create_session(temperature=0.0, max_tokens=64)
    for piece in s.send("Hello!"):
        print(piece, end="")
    s.migrate(to="127.0.0.1:50052")     # the conversation moves (live); keep chatting
    for piece in s.send("And then?"):
        ...

:class:`AsyncClient` offers the same with ``async``/``await``. Errors are the
classes of :mod:`kvferry.errors`, mapped from the code the host sent (never from
its message text), each also a :class:`RemoteError`.

Only grpcio and protobuf load here: no MLX, wasmtime, numpy or Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import grpc

from .errors import RemoteError, UnknownSessionError
from .params import MIGRATE_DEFAULTS, OPTIONS, SAMPLING
from .paths import default_token
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .transport import TLSConfig, auth_metadata, channel, translate

CHUNK = 4 << 20  # checkpoint bytes per message on Restore


def _sampling(kw: dict) -> pb.Sampling:
    d = SAMPLING
    return pb.Sampling(temperature=kw.pop("temperature", d.temperature), top_p=kw.pop("top_p", d.top_p),
                       top_k=kw.pop("top_k", d.top_k), max_tokens=kw.pop("max_tokens", d.max_tokens),
                       seed=kw.pop("seed", d.seed), stop=list(kw.pop("stop", d.stop)),
                       ignore_eos=kw.pop("ignore_eos", d.ignore_eos))


def _options(kw: dict) -> pb.Options:
    d = OPTIONS
    return pb.Options(ctx=kw.pop("ctx", d.ctx) or 0, prefill_step=kw.pop("prefill_step", d.prefill_step),
                      kv_bits=kw.pop("kv_bits", d.kv_bits) or 0,
                      deadline_ms=kw.pop("deadline_ms", d.deadline_ms))


def _create_request(model, guest, system, session_id, kw: dict) -> pb.CreateRequest:
    kw = dict(kw)
    req = pb.CreateRequest(guest_wasm=_guest_bytes(guest), sampling=_sampling(kw), options=_options(kw),
                           model=model or "", system=system or "", session_id=session_id or "")
    if kw:
        raise TypeError(f"unknown session options: {', '.join(kw)}")
    return req


def _guest_bytes(guest: str | os.PathLike | bytes | None) -> bytes:
    if guest is None:
        return b""
    if isinstance(guest, bytes):
        return guest
    return Path(guest).read_bytes()


def _health(r: pb.HealthReply) -> dict:
    return {"status": r.status, "address": r.address, "model": r.model, "sessions": r.sessions,
            "version": r.version, "node": r.node, "fingerprint": r.fingerprint}


def _hosts(r: pb.HostList) -> list[dict]:
    return [{"address": h.address, "model": h.model, "sessions": h.sessions, "healthy": h.healthy,
             "node": h.node, "last_seen": h.last_seen} for h in r.hosts]


def _info(s: pb.SessionInfo) -> dict:
    return {"id": s.id, "host": s.host, "tokens": s.tokens, "guest": s.guest, "kv_bytes": s.kv_bytes,
            "arena_bytes": s.arena_bytes, "model": s.model, "in_turn": s.in_turn}


def _find(sessions: pb.SessionList, sid: str, host: str) -> dict:
    for s in sessions.sessions:
        if s.id == sid:
            return _info(s)
    raise UnknownSessionError(f"{host}: unknown session '{sid}'")


def _migrate_request(sid: str, to: str, to_token, mode, live, rate_mb_s) -> pb.MigrateRequest:
    return pb.MigrateRequest(session_id=sid, target=to, target_token=to_token or "", mode=mode,
                             live=live, rate_mb_s=rate_mb_s)


def _file_chunks(path: str | os.PathLike) -> Iterator[pb.CheckpointChunk]:
    with open(path, "rb") as f:
        while data := f.read(CHUNK):
            yield pb.CheckpointChunk(data=data)


@dataclass
class Migration:
    target: str
    bytes: int
    seconds: float
    raw_kv_bytes: int
    tokens: int
    pause_ms: float = 0.0

    @property
    def ratio(self) -> float:
        return self.raw_kv_bytes / self.bytes if self.bytes else 0.0

    @classmethod
    def from_progress(cls, session_id: str, to: str, last: pb.MigrateProgress | None) -> "Migration":
        if last is None or not last.done:
            raise RemoteError(f"migration of {session_id} to {to} did not complete")
        return cls(to, last.bytes_sent, last.seconds, last.raw_kv_bytes, last.tokens, last.pause_ms)


class _TurnFollower:
    """One turn's token stream across migrations: deliver each token once, in
    order; after ``moved_to``, resend the request (nothing ran at the old host)
    or continue the turn from the next index (it moved mid-reply)."""

    HOPS = 8  # at most a few hops per turn

    def __init__(self, session_id: str, text: str, role: str, max_tokens: int = 0):
        self.session_id = session_id
        self.request = pb.SendRequest(session_id=session_id, text=text, role=role, max_tokens=max_tokens)
        self.next_index = 0
        self.moved: str | None = None
        self._mid_turn = False
        self.last: dict = {}

    @classmethod
    def resuming(cls, session_id: str, from_index: int) -> "_TurnFollower":
        f = cls(session_id, "", "user")
        f.request = pb.SendRequest(session_id=session_id, continue_turn=True, from_index=from_index)
        f.next_index = from_index
        return f

    def accept(self, c: pb.TokenChunk) -> bool:
        """True if ``c`` is to be delivered; a ``moved_to`` chunk ends this stream."""
        if c.moved_to:
            self.moved, self._mid_turn = c.moved_to, c.index >= 0
            return False
        if c.finish_reason == "error":
            raise RemoteError(f"session {self.session_id}: {c.text}")
        if c.token >= 0:
            if c.index < self.next_index:
                return False  # never repeat a token
            self.next_index = c.index + 1
        elif c.finish_reason:
            self.last = {"finish_reason": c.finish_reason, "tokens": self.next_index,
                         "prompt_tokens": c.stats.prompt_tokens, "generation_tps": c.stats.generation_tps,
                         "prompt_tps": c.stats.prompt_tps}
        return True

    def hop(self) -> str | None:
        """After a stream ends: the host to continue at, or None when the turn is done."""
        moved, self.moved = self.moved, None
        if moved and self._mid_turn:
            self.request = pb.SendRequest(session_id=self.session_id, continue_turn=True,
                                          from_index=self.next_index)
        return moved

    def gave_up(self) -> RemoteError:
        return RemoteError(f"session {self.session_id} kept moving; giving up")


class _Connection:
    """Address, token, TLS and one channel per host the session visits."""

    AIO = False

    def __init__(self, address: str, token: str | None = None, *, tls: TLSConfig | None = None,
                 timeout: float = 600.0):
        self.address = address
        self.token = token if token is not None else default_token()
        self.tls = tls
        self.timeout = timeout
        self._channels: dict[str, Any] = {}

    def _stub(self, address: str | None = None) -> pbg.SessionsStub:
        address = address or self.address
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address, self.tls, aio=self.AIO)
        return pbg.SessionsStub(ch)

    def _meta(self, extra: list | None = None) -> list[tuple[str, str]]:
        return auth_metadata(self.token) + (extra or [])


class Client(_Connection):
    """A connection to one session host (any host of a cluster can list the others)."""

    def _call(self, name: str, request: Any, address: str | None = None, **kw) -> Any:
        try:
            return getattr(self._stub(address), name)(request, metadata=self._meta(kw.pop("metadata", None)),
                                                      timeout=kw.pop("timeout", self.timeout), **kw)
        except grpc.RpcError as e:
            raise translate(e, address or self.address) from None

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- cluster -----------------------------------------------------------------
    def health(self) -> dict:
        return _health(self._call("Health", pb.Empty(), timeout=10))

    def hosts(self) -> list[dict]:
        return _hosts(self._call("ListHosts", pb.Empty()))

    def sessions(self) -> list[dict]:
        return [_info(s) for s in self._call("ListSessions", pb.Empty()).sessions]

    # -- sessions ----------------------------------------------------------------
    def create_session(self, model: str | None = None, guest: str | os.PathLike | bytes | None = None,
                       *, system: str | None = None, session_id: str | None = None,
                       **sampling_and_options) -> "RemoteSession":
        """``sampling_and_options``: temperature, top_p, top_k, max_tokens, seed, stop,
        ignore_eos, ctx, prefill_step, kv_bits, deadline_ms (defaults: kvferry.params)."""
        info = self._call("CreateSession", _create_request(model, guest, system, session_id,
                                                           sampling_and_options))
        return RemoteSession(self, info.id, info.host or self.address)

    def session(self, session_id: str, host: str | None = None) -> "RemoteSession":
        return RemoteSession(self, session_id, host or self.address)

    def restore(self, path: str | os.PathLike, host: str | None = None,
                session_id: str | None = None) -> "RemoteSession":
        """Restore a checkpoint file as a live session (``session_id``: a new id, to
        restore a copy next to the original)."""
        extra = [("kvferry-session-id", session_id)] if session_id else []
        info = self._call("Restore", _file_chunks(path), address=host, metadata=extra)
        return RemoteSession(self, info.id, info.host or host or self.address)


class RemoteSession:
    """A handle on a session; follows it when it migrates."""

    def __init__(self, client: Client, session_id: str, host: str):
        self.client, self.id, self.host = client, session_id, host
        self.last: dict = {}

    def __repr__(self) -> str:
        return f"RemoteSession({self.id!r} on {self.host})"

    def events(self, text: str, role: str = "user", max_tokens: int = 0) -> Iterator[pb.TokenChunk]:
        """Token chunks as they arrive, continuing across migrations (``max_tokens``:
        this reply's limit, at most the session's)."""
        return self._follow(_TurnFollower(self.id, text, role, max_tokens))

    def resume(self, from_index: int = 0) -> Iterator[pb.TokenChunk]:
        """Re-attach to the reply in progress (after a dropped connection, or when
        the host that streamed it died after a migration): chunks from ``from_index``."""
        return self._follow(_TurnFollower.resuming(self.id, from_index))

    def _follow(self, f: _TurnFollower) -> Iterator[pb.TokenChunk]:
        c = self.client
        for _ in range(f.HOPS):
            try:
                for chunk in c._stub(self.host).Send(f.request, metadata=c._meta(), timeout=c.timeout):
                    if f.accept(chunk):
                        self.last = f.last
                        yield chunk
                    elif f.moved:
                        break
            except grpc.RpcError as e:
                raise translate(e, self.host) from None
            if (host := f.hop()) is None:
                return
            self.host = host
        raise f.gave_up()

    def send(self, text: str, role: str = "user", max_tokens: int = 0) -> Iterator[str]:
        """Yield the reply's text pieces as they arrive."""
        for c in self.events(text, role, max_tokens):
            if c.text:
                yield c.text

    def migrate(self, to: str, *, to_token: str | None = None, mode: str = MIGRATE_DEFAULTS["mode"],
                live: bool = MIGRATE_DEFAULTS["live"], rate_mb_s: float = MIGRATE_DEFAULTS["rate_mb_s"],
                progress: Callable[[pb.MigrateProgress], None] | None = None) -> Migration:
        """Move this session to host ``to``. ``live`` (default): pre-copy while the
        reply keeps generating, at most ``rate_mb_s`` MB/s (0: the host paces it at
        about 3 MB per decode step); ``live=False``: stop-and-copy. ``mode``: how KV
        travels (``raw``: uncompressed, right for LAN/loopback; ``lossless``: ~1.2x
        fewer bytes for slow links; ``int8``/``int4``: lossy)."""
        c, last = self.client, None
        try:
            for p in c._stub(self.host).Migrate(_migrate_request(self.id, to, to_token, mode, live, rate_mb_s),
                                                metadata=c._meta(), timeout=c.timeout):
                last = p
                if progress:
                    progress(p)
        except grpc.RpcError as e:
            raise translate(e, self.host) from None
        m = Migration.from_progress(self.id, to, last)
        self.host = to
        return m

    def snapshot(self, path: str | os.PathLike, mode: str = "lossless") -> dict:
        """Write a checkpoint file of this session (atomically)."""
        c, tmp, n = self.client, f"{path}.part", 0
        try:
            with open(tmp, "wb") as f:
                for chunk in c._stub(self.host).Snapshot(pb.SnapshotRequest(session_id=self.id, mode=mode),
                                                         metadata=c._meta(), timeout=c.timeout):
                    f.write(chunk.data)
                    n += len(chunk.data)
        except grpc.RpcError as e:
            os.unlink(tmp)
            raise translate(e, self.host) from None
        os.replace(tmp, path)
        return {"path": str(path), "bytes": n}

    def info(self) -> dict:
        return _find(self.client._call("ListSessions", pb.Empty(), address=self.host), self.id, self.host)

    def close(self) -> None:
        self.client._call("Close", pb.SessionRef(session_id=self.id), address=self.host)


# ----------------------------------------------------------------------------- asyncio

class AsyncClient(_Connection):
    """:class:`Client` for asyncio programs (grpc.aio): the same methods, awaited."""

    AIO = True

    async def _call(self, name: str, request: Any, address: str | None = None, **kw) -> Any:
        try:
            return await getattr(self._stub(address), name)(
                request, metadata=self._meta(kw.pop("metadata", None)), timeout=kw.pop("timeout", self.timeout))
        except grpc.RpcError as e:
            raise translate(e, address or self.address) from None

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def health(self) -> dict:
        return _health(await self._call("Health", pb.Empty(), timeout=10))

    async def hosts(self) -> list[dict]:
        return _hosts(await self._call("ListHosts", pb.Empty()))

    async def sessions(self) -> list[dict]:
        return [_info(s) for s in (await self._call("ListSessions", pb.Empty())).sessions]

    async def create_session(self, model: str | None = None, guest: str | os.PathLike | bytes | None = None,
                             *, system: str | None = None, session_id: str | None = None,
                             **sampling_and_options) -> "AsyncRemoteSession":
        info = await self._call("CreateSession", _create_request(model, guest, system, session_id,
                                                                 sampling_and_options))
        return AsyncRemoteSession(self, info.id, info.host or self.address)

    def session(self, session_id: str, host: str | None = None) -> "AsyncRemoteSession":
        return AsyncRemoteSession(self, session_id, host or self.address)

    async def restore(self, path: str | os.PathLike, host: str | None = None,
                      session_id: str | None = None) -> "AsyncRemoteSession":
        extra = [("kvferry-session-id", session_id)] if session_id else []

        async def chunks():
            for c in _file_chunks(path):
                yield c
        info = await self._call("Restore", chunks(), address=host, metadata=extra)
        return AsyncRemoteSession(self, info.id, info.host or host or self.address)


class AsyncRemoteSession:
    """:class:`RemoteSession` for asyncio."""

    def __init__(self, client: AsyncClient, session_id: str, host: str):
        self.client, self.id, self.host = client, session_id, host
        self.last: dict = {}

    def __repr__(self) -> str:
        return f"AsyncRemoteSession({self.id!r} on {self.host})"

    def events(self, text: str, role: str = "user", max_tokens: int = 0) -> AsyncIterator[pb.TokenChunk]:
        return self._follow(_TurnFollower(self.id, text, role, max_tokens))

    def resume(self, from_index: int = 0) -> AsyncIterator[pb.TokenChunk]:
        return self._follow(_TurnFollower.resuming(self.id, from_index))

    async def _follow(self, f: _TurnFollower) -> AsyncIterator[pb.TokenChunk]:
        c = self.client
        for _ in range(f.HOPS):
            try:
                async for chunk in c._stub(self.host).Send(f.request, metadata=c._meta(), timeout=c.timeout):
                    if f.accept(chunk):
                        self.last = f.last
                        yield chunk
                    elif f.moved:
                        break
            except grpc.RpcError as e:
                raise translate(e, self.host) from None
            if (host := f.hop()) is None:
                return
            self.host = host
        raise f.gave_up()

    async def send(self, text: str, role: str = "user", max_tokens: int = 0) -> AsyncIterator[str]:
        async for c in self.events(text, role, max_tokens):
            if c.text:
                yield c.text

    async def migrate(self, to: str, *, to_token: str | None = None, mode: str = MIGRATE_DEFAULTS["mode"],
                      live: bool = MIGRATE_DEFAULTS["live"], rate_mb_s: float = MIGRATE_DEFAULTS["rate_mb_s"],
                      progress: Callable[[pb.MigrateProgress], None] | None = None) -> Migration:
        c, last = self.client, None
        try:
            async for p in c._stub(self.host).Migrate(
                    _migrate_request(self.id, to, to_token, mode, live, rate_mb_s),
                    metadata=c._meta(), timeout=c.timeout):
                last = p
                if progress:
                    progress(p)
        except grpc.RpcError as e:
            raise translate(e, self.host) from None
        m = Migration.from_progress(self.id, to, last)
        self.host = to
        return m

    async def snapshot(self, path: str | os.PathLike, mode: str = "lossless") -> dict:
        c, tmp, n = self.client, f"{path}.part", 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in c._stub(self.host).Snapshot(
                        pb.SnapshotRequest(session_id=self.id, mode=mode), metadata=c._meta(), timeout=c.timeout):
                    f.write(chunk.data)
                    n += len(chunk.data)
        except grpc.RpcError as e:
            os.unlink(tmp)
            raise translate(e, self.host) from None
        os.replace(tmp, path)
        return {"path": str(path), "bytes": n}

    async def info(self) -> dict:
        return _find(await self.client._call("ListSessions", pb.Empty(), address=self.host), self.id, self.host)

    async def close(self) -> None:
        await self.client._call("Close", pb.SessionRef(session_id=self.id), address=self.host)
