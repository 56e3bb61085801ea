"""The host's side of its stream front (``serve --stream-front``, :mod:`kvferry.stream_front`).

Under load a host's largest cost a token besides the step is sending it: gRPC's
sync server sends each message as a batch of its own and its RPC thread waits for
the completion, hand-offs of the GIL that the step thread also wants (at 64
sessions on an H100 the 64 RPC threads held the GIL about as long as the step
thread did, docs/performance.md). vLLM keeps its API server in a process apart
from its engine loop for the same reason. Here a Send the front took runs on this
host as before, on a thread of :class:`EgressHub`'s pool, but its chunks go to the
front in one stream, a batch at a time: one message a step for all sessions
instead of one a token each, and the front does the sending to each client under
its own GIL.

Only the host's own front may open that stream or cancel a Send (``front_key``,
a secret the host hands it). A Send keeps the client's token: the host's auth
checks it as for a direct Send, and a client key's call counts until its stream ends.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import threading
from concurrent import futures
from typing import Any

import grpc

from .errors import ERROR_KEY, AuthError, KvferryError, TooManyCallsError
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .transport import MOVED_KEY, abort

log = logging.getLogger("kvferry.egress")


class _Ended(Exception):
    """A relayed Send's status was set (grpc's abort raises likewise)."""


class _SendContext:
    """What ``_Sessions.Send`` reads of a gRPC context, for a Send the front relays."""

    def __init__(self, metadata: tuple, cancelled: threading.Event):
        self.metadata = metadata
        self.cancelled = cancelled
        self.trailing: dict = {}
        self.code, self.details = grpc.StatusCode.OK, ""

    def invocation_metadata(self) -> tuple:
        return self.metadata

    def is_active(self) -> bool:
        return not self.cancelled.is_set()

    def set_trailing_metadata(self, meta: tuple) -> None:
        self.trailing = dict(meta)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Ended(details)


class EgressHub(pbg.EgressServicer):
    """Runs the Sends a front relays and batches their chunks onto its one stream."""

    def __init__(self, srv: Any, sessions: Any):
        """``sessions``: the host's Sessions servicer (its Send does the work)."""
        self.srv, self.sessions = srv, sessions
        self.key = secrets.token_urlsafe(32)
        self.limit = srv.host.policy.max_concurrent_rpcs
        self.pool = futures.ThreadPoolExecutor(max_workers=self.limit, thread_name_prefix="kvferry-egress")
        self.cv = threading.Condition()
        self.items: list[pb.EgressItem] = []
        self.streams: dict[int, threading.Event] = {}  # live Sends -> set when their client left
        self.opened = itertools.count(1)
        self.current = 0  # the front's open stream (a newer one replaces it)
        self.stats = {"sends": 0, "batches": 0, "items": 0}

    def _check(self, key: str) -> None:
        if not hmac.compare_digest(key.encode(), self.key.encode()):
            raise AuthError("auth failed: not this host's stream front")

    def Open(self, r, context):
        try:
            self._check(r.front_key)
        except KvferryError as e:
            abort(context, e)
        me = next(self.opened)
        with self.cv:
            self.current = me
            self.cv.notify_all()
        log.info("stream front connected")
        try:
            while context.is_active():
                with self.cv:
                    while not self.items and self.current == me and context.is_active():
                        self.cv.wait(0.5)
                    if self.current != me:
                        return
                    batch, self.items = self.items, []
                if batch:
                    self.stats["batches"] += 1
                    self.stats["items"] += len(batch)
                    yield pb.EgressBatch(items=batch)
        finally:
            with self.cv:
                if self.current == me:  # the front is gone: so are its clients
                    self.current = 0
                    self.items = []
                    for ev in self.streams.values():
                        ev.set()

    def Start(self, r, context):
        try:
            self._check(r.front_key)
            key = self.srv.caller(context)
            with self.cv:
                if len(self.streams) >= self.limit:
                    raise TooManyCallsError(f"{len(self.streams)} streams in flight, this host's limit; retry when "
                                            "one ends")
                if r.stream in self.streams:
                    raise AuthError(f"stream {r.stream} is already running")
                self.srv.quota.enter(key)  # (key NOBODY without auth: never rationed)
                self.streams[r.stream] = cancelled = threading.Event()
        except KvferryError as e:
            abort(context, e)
        self.stats["sends"] += 1
        self.pool.submit(self._run, r.stream, r.send, tuple(context.invocation_metadata()), cancelled, key)
        return pb.Empty()

    def Cancel(self, r, context):
        try:
            self._check(r.front_key)
        except KvferryError as e:
            abort(context, e)
        with self.cv:
            ev = self.streams.get(r.stream)
        if ev is not None:
            ev.set()
        return pb.Empty()

    def _run(self, stream: int, send: pb.SendRequest, metadata: tuple, cancelled: threading.Event, key: Any) -> None:
        ctx = _SendContext(metadata, cancelled)
        try:
            for chunk in self.sessions.Send(send, ctx):  # (a cancelled one returns by itself, its turn open
                self._put(pb.EgressItem(stream=stream, chunk=chunk))  # for a resume, as a direct Send's)
        except _Ended:
            pass
        except Exception:  # noqa: BLE001 (Send's guard answers every error; this would be a bug here)
            log.exception("stream %d", stream)
            ctx.code, ctx.details = grpc.StatusCode.INTERNAL, "internal error relaying a stream"
        finally:
            self.srv.quota.leave(key)
            with self.cv:
                self.streams.pop(stream, None)
            self._put(pb.EgressItem(stream=stream, end=True, code=ctx.code.value[0], details=ctx.details,
                                    error=ctx.trailing.get(ERROR_KEY, ""), moved_to=ctx.trailing.get(MOVED_KEY, "")))

    def _put(self, item: pb.EgressItem) -> None:
        with self.cv:
            if self.current:
                self.items.append(item)
                self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.current = 0
            for ev in self.streams.values():
                ev.set()
            self.cv.notify_all()
        self.pool.shutdown(wait=True, cancel_futures=True)
