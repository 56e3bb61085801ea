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
from typing import Any, AsyncIterator, Callable, Iterator

import grpc

from .errors import (AuthError, HostDownError, ModelMismatchError, RemoteError,  # noqa: F401  (the SDK's errors)
                     UnknownSessionError)
from .params import MIGRATE_DEFAULTS
from .paths import default_token
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .stream_chunks import expand
from .transport import TLSConfig, auth_metadata, channel, translate
from .wire import (Migration, TurnFollower, afollow_moves, create_request, file_chunks, follow_moves, migrate_request,
                   read_drain, read_health, read_hosts, read_info)

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
        return read_health(self._call("Health", pb.Empty(), timeout=10))

    def hosts(self) -> list[dict]:
        return read_hosts(self._call("ListHosts", pb.Empty()))

    def sessions(self) -> list[dict]:
        return [read_info(s) for s in self._call("ListSessions", pb.Empty()).sessions]

    def drain(self, timeout: float = 0.0, exit: bool = True) -> list[dict]:
        """Drain this host: every session to a peer (live) or saved; then it stops
        (``exit``). One outcome per session: moved, saved or failed."""
        return read_drain(self._call("Drain", pb.DrainRequest(timeout_s=timeout, exit=exit)))

    # -- sessions ----------------------------------------------------------------
    def create_session(self, model: str | None = None, guest: str | os.PathLike | bytes | None = None,
                       *, system: str | None = None, session_id: str | None = None,
                       **sampling_and_options) -> "RemoteSession":
        """``sampling_and_options``: temperature, top_p, top_k, max_tokens, seed, stop,
        ignore_eos, ctx, prefill_step, kv_bits, deadline_ms (defaults: kvferry.params)."""
        info = self._call("CreateSession", create_request(model, guest, system, session_id,
                                                           sampling_and_options))
        return RemoteSession(self, info.id, info.host or self.address)

    def session(self, session_id: str, host: str | None = None) -> "RemoteSession":
        return RemoteSession(self, session_id, host or self.address)

    def restore(self, path: str | os.PathLike, host: str | None = None,
                session_id: str | None = None) -> "RemoteSession":
        """Restore a checkpoint file as a live session (``session_id``: a new id, to
        restore a copy next to the original)."""
        extra = [("kvferry-session-id", session_id)] if session_id else []
        info = self._call("Restore", file_chunks(path), address=host, metadata=extra)
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
        return self._follow(TurnFollower(self.id, text, role, max_tokens))

    def resume(self, from_index: int = 0) -> Iterator[pb.TokenChunk]:
        """Re-attach to the reply in progress (after a dropped connection, or when
        the host that streamed it died after a migration): chunks from ``from_index``."""
        return self._follow(TurnFollower.resuming(self.id, from_index))

    def _follow(self, f: TurnFollower) -> Iterator[pb.TokenChunk]:
        c = self.client
        for _ in range(f.HOPS):
            try:
                for message in c._stub(self.host).Send(f.request, metadata=c._meta(), timeout=c.timeout):
                    for chunk in expand(message):  # one a token, however many a message carries
                        if f.accept(chunk):
                            self.last = f.last
                            yield chunk
                    if f.moved:
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
                allow_lossy: bool = MIGRATE_DEFAULTS["allow_lossy"], lane: bool = MIGRATE_DEFAULTS["lane"],
                progress: Callable[[pb.MigrateProgress], None] | None = None) -> Migration:
        """Move this session to host ``to``. ``live`` (default): pre-copy while the
        reply keeps generating, at most ``rate_mb_s`` MB/s (0: the host paces it at
        about 3 MB per decode step); ``live=False``: stop-and-copy. ``mode``: how KV
        travels: ``auto`` (default) times this link and these CPUs on the first KV
        and picks the fastest of raw and lossless (and int8 with ``allow_lossy``);
        or ``raw``, ``lossless`` (~1.2x fewer bytes), ``int8``/``int4`` (lossy). ``lane``
        (default): the KV frames go on a socket of their own beside the gRPC stream when
        the target offers one; False keeps them on the stream."""
        c = self.client

        def attempt(host: str) -> pb.MigrateProgress | None:
            last = None
            try:
                req = migrate_request(self.id, to, to_token, mode, live, rate_mb_s, allow_lossy, lane)
                for p in c._stub(host).Migrate(req, metadata=c._meta(), timeout=c.timeout):
                    last = p
                    if progress:
                        progress(p)
            except grpc.RpcError as e:
                raise translate(e, host) from None
            return last
        m = Migration.from_progress(self.id, to, follow_moves(self, attempt))
        self.host = to
        return m

    def snapshot(self, path: str | os.PathLike, mode: str = "lossless") -> dict:
        """Write a checkpoint file of this session (atomically)."""
        c, tmp = self.client, f"{path}.part"

        def attempt(host: str) -> int:
            n = 0
            try:
                with open(tmp, "wb") as f:
                    for chunk in c._stub(host).Snapshot(pb.SnapshotRequest(session_id=self.id, mode=mode),
                                                        metadata=c._meta(), timeout=c.timeout):
                        f.write(chunk.data)
                        n += len(chunk.data)
            except grpc.RpcError as e:
                os.unlink(tmp)
                raise translate(e, host) from None
            return n
        n = follow_moves(self, attempt)
        os.replace(tmp, path)
        return {"path": str(path), "bytes": n}

    def info(self) -> dict:
        ref = pb.SessionRef(session_id=self.id)
        return read_info(follow_moves(self, lambda host: self.client._call("Info", ref, address=host)))

    def close(self) -> None:
        ref = pb.SessionRef(session_id=self.id)
        follow_moves(self, lambda host: self.client._call("Close", ref, address=host))


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
        return read_health(await self._call("Health", pb.Empty(), timeout=10))

    async def hosts(self) -> list[dict]:
        return read_hosts(await self._call("ListHosts", pb.Empty()))

    async def sessions(self) -> list[dict]:
        return [read_info(s) for s in (await self._call("ListSessions", pb.Empty())).sessions]

    async def drain(self, timeout: float = 0.0, exit: bool = True) -> list[dict]:
        return read_drain(await self._call("Drain", pb.DrainRequest(timeout_s=timeout, exit=exit)))

    async def create_session(self, model: str | None = None, guest: str | os.PathLike | bytes | None = None,
                             *, system: str | None = None, session_id: str | None = None,
                             **sampling_and_options) -> "AsyncRemoteSession":
        info = await self._call("CreateSession", create_request(model, guest, system, session_id,
                                                                 sampling_and_options))
        return AsyncRemoteSession(self, info.id, info.host or self.address)

    def session(self, session_id: str, host: str | None = None) -> "AsyncRemoteSession":
        return AsyncRemoteSession(self, session_id, host or self.address)

    async def restore(self, path: str | os.PathLike, host: str | None = None,
                      session_id: str | None = None) -> "AsyncRemoteSession":
        extra = [("kvferry-session-id", session_id)] if session_id else []

        async def chunks():
            for c in file_chunks(path):
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
        return self._follow(TurnFollower(self.id, text, role, max_tokens))

    def resume(self, from_index: int = 0) -> AsyncIterator[pb.TokenChunk]:
        return self._follow(TurnFollower.resuming(self.id, from_index))

    async def _follow(self, f: TurnFollower) -> AsyncIterator[pb.TokenChunk]:
        c = self.client
        for _ in range(f.HOPS):
            try:
                async for message in c._stub(self.host).Send(f.request, metadata=c._meta(), timeout=c.timeout):
                    for chunk in expand(message):  # one a token, however many a message carries
                        if f.accept(chunk):
                            self.last = f.last
                            yield chunk
                    if f.moved:
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
                      allow_lossy: bool = MIGRATE_DEFAULTS["allow_lossy"], lane: bool = MIGRATE_DEFAULTS["lane"],
                      progress: Callable[[pb.MigrateProgress], None] | None = None) -> Migration:
        c = self.client

        async def attempt(host: str) -> pb.MigrateProgress | None:
            last = None
            try:
                req = migrate_request(self.id, to, to_token, mode, live, rate_mb_s, allow_lossy, lane)
                async for p in c._stub(host).Migrate(req, metadata=c._meta(), timeout=c.timeout):
                    last = p
                    if progress:
                        progress(p)
            except grpc.RpcError as e:
                raise translate(e, host) from None
            return last
        m = Migration.from_progress(self.id, to, await afollow_moves(self, attempt))
        self.host = to
        return m

    async def snapshot(self, path: str | os.PathLike, mode: str = "lossless") -> dict:
        c, tmp = self.client, f"{path}.part"

        async def attempt(host: str) -> int:
            n = 0
            try:
                with open(tmp, "wb") as f:
                    async for chunk in c._stub(host).Snapshot(
                            pb.SnapshotRequest(session_id=self.id, mode=mode), metadata=c._meta(), timeout=c.timeout):
                        f.write(chunk.data)
                        n += len(chunk.data)
            except grpc.RpcError as e:
                os.unlink(tmp)
                raise translate(e, host) from None
            return n
        n = await afollow_moves(self, attempt)
        os.replace(tmp, path)
        return {"path": str(path), "bytes": n}

    async def info(self) -> dict:
        ref = pb.SessionRef(session_id=self.id)
        return read_info(await afollow_moves(self, lambda host: self.client._call("Info", ref, address=host)))

    async def close(self) -> None:
        ref = pb.SessionRef(session_id=self.id)
        await afollow_moves(self, lambda host: self.client._call("Close", ref, address=host))
