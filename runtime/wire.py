"""The SDK's side of the wire, shared by the sync and asyncio clients: requests
built from keyword arguments (defaults from :mod:`kvferry.params`), replies read
into plain dicts, one reply followed across migrations, redirects followed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import RemoteError, SessionMovedError
from .params import OPTIONS, SAMPLING
from .proto import kvferry_pb2 as pb
from .stream_chunks import CLIENT_CHUNK_TOKENS

CHUNK = 4 << 20  # checkpoint bytes per message on Restore


def sampling_message(kw: dict) -> pb.Sampling:
    d = SAMPLING
    return pb.Sampling(temperature=kw.pop("temperature", d.temperature), top_p=kw.pop("top_p", d.top_p),
                       top_k=kw.pop("top_k", d.top_k), max_tokens=kw.pop("max_tokens", 0),  # 0: the host's default
                       seed=kw.pop("seed", d.seed), stop=list(kw.pop("stop", d.stop)),
                       ignore_eos=kw.pop("ignore_eos", d.ignore_eos))


def options_message(kw: dict) -> pb.Options:
    d = OPTIONS
    return pb.Options(ctx=kw.pop("ctx", d.ctx) or 0, prefill_step=kw.pop("prefill_step", d.prefill_step),
                      kv_bits=kw.pop("kv_bits", d.kv_bits) or 0,
                      deadline_ms=kw.pop("deadline_ms", 0.0))  # 0: the host's default (never over its limit)


def create_request(model, guest, system, session_id, kw: dict) -> pb.CreateRequest:
    kw = dict(kw)
    req = pb.CreateRequest(guest_wasm=guest_bytes(guest), sampling=sampling_message(kw), options=options_message(kw),
                           model=model or "", system=system or "", session_id=session_id or "")
    if kw:
        raise TypeError(f"unknown session options: {', '.join(kw)}")
    return req


def guest_bytes(guest: str | os.PathLike | bytes | None) -> bytes:
    if guest is None:
        return b""
    if isinstance(guest, bytes):
        return guest
    return Path(guest).read_bytes()


def read_health(r: pb.HealthReply) -> dict:
    return {"status": r.status, "address": r.address, "model": r.model, "sessions": r.sessions,
            "version": r.version, "node": r.node, "fingerprint": r.fingerprint, "device": r.device,
            "dtype": r.dtype, "weights": r.weights}


def read_hosts(r: pb.HostList) -> list[dict]:
    return [{"address": h.address, "model": h.model, "sessions": h.sessions, "healthy": h.healthy,
             "node": h.node, "last_seen": h.last_seen} for h in r.hosts]


def read_drain(r: pb.DrainReply) -> list[dict]:
    return [{"session": o.session_id, "outcome": o.outcome, "where": o.where, "error": o.error} for o in r.sessions]


def read_info(s: pb.SessionInfo) -> dict:
    return {"id": s.id, "host": s.host, "tokens": s.tokens, "guest": s.guest, "kv_bytes": s.kv_bytes,
            "arena_bytes": s.arena_bytes, "model": s.model, "in_turn": s.in_turn}


HOPS = 8  # redirects followed per call: a session moves a few times at most meanwhile


def follow_moves(handle: Any, call: Callable[[str], Any]) -> Any:
    """``call(host)`` at the handle's host; where that host answers session_moved,
    again at the host the session went to (the handle then points there)."""
    for _ in range(HOPS):
        try:
            return call(handle.host)
        except SessionMovedError as e:
            if not getattr(e, "moved_to", ""):
                raise
            handle.host = e.moved_to
    raise RemoteError(f"session {handle.id} kept moving; giving up")


async def afollow_moves(handle: Any, call: Callable[[str], Any]) -> Any:
    for _ in range(HOPS):
        try:
            return await call(handle.host)
        except SessionMovedError as e:
            if not getattr(e, "moved_to", ""):
                raise
            handle.host = e.moved_to
    raise RemoteError(f"session {handle.id} kept moving; giving up")


def migrate_request(sid: str, to: str, to_token, mode, live, rate_mb_s, allow_lossy=False,
                    lane=True) -> pb.MigrateRequest:
    return pb.MigrateRequest(session_id=sid, target=to, target_token=to_token or "", mode=mode,
                             live=live, rate_mb_s=rate_mb_s, allow_lossy=allow_lossy, stream_only=not lane)


def file_chunks(path: str | os.PathLike) -> Iterator[pb.CheckpointChunk]:
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
    mode: str = ""  # how the KV travelled (what auto chose)
    phases_ms: dict = field(default_factory=dict)  # where the time went (see MigrateProgress)
    transfer_mb_s: float = 0.0  # raw KV MB/s of a stop-and-copy transfer (0 for live)
    transport: str = ""  # how the KV frames went: lane (a socket beside the stream) or stream

    @property
    def ratio(self) -> float:
        return self.raw_kv_bytes / self.bytes if self.bytes else 0.0

    @classmethod
    def from_progress(cls, session_id: str, to: str, last: pb.MigrateProgress | None) -> "Migration":
        if last is None or not last.done:
            raise RemoteError(f"migration of {session_id} to {to} did not complete")
        return cls(to, last.bytes_sent, last.seconds, last.raw_kv_bytes, last.tokens, last.pause_ms, last.mode,
                   {k: round(v, 2) for k, v in last.phases_ms.items()}, round(last.transfer_mb_s, 1),
                   last.transport)


class TurnFollower:
    """One turn's token stream across migrations: deliver each token once, in
    order; after ``moved_to``, resend the request (nothing ran at the old host)
    or continue the turn from the next index (it moved mid-reply)."""

    HOPS = HOPS

    def __init__(self, session_id: str, text: str, role: str, max_tokens: int = 0):
        self.session_id = session_id
        self.request = pb.SendRequest(session_id=session_id, text=text, role=role, max_tokens=max_tokens,
                                      chunk_tokens=CLIENT_CHUNK_TOKENS)
        self.next_index = 0
        self.moved: str | None = None
        self._mid_turn = False
        self.last: dict = {}

    @classmethod
    def resuming(cls, session_id: str, from_index: int) -> "TurnFollower":
        f = cls(session_id, "", "user")
        f.request = pb.SendRequest(session_id=session_id, continue_turn=True, from_index=from_index,
                                   chunk_tokens=CLIENT_CHUNK_TOKENS)
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
                                          from_index=self.next_index, chunk_tokens=CLIENT_CHUNK_TOKENS)
        return moved

    def gave_up(self) -> RemoteError:
        return RemoteError(f"session {self.session_id} kept moving; giving up")
