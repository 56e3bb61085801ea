"""One HTTP request's turn, on a worker thread: which session it continues, the
turn itself through the host's turn driver, and the relay when the session
migrates mid-reply. Items go to the request's asyncio queue:
("session", id) first, then ("token", text)…, then ("end", finish_reason, tail
text, prompt tokens, completion tokens) or ("error", exception)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from . import openai_api as oa
from .errors import SessionBusyError, SessionError
from .guests import GUESTS_DIR
from .stream_chunks import coalesce

log = logging.getLogger("kvferry.http")
LOCK_WAIT_S = 30.0  # a request naming a busy session waits this long for it


class Turn:
    def __init__(self, srv: Any, key: Any, req: oa.Request, chat: bool, sampling: Any, session_id: str | None,
                 authorization: str, loop: asyncio.AbstractEventLoop) -> None:
        self.srv, self.key, self.req, self.chat, self.sampling = srv, key, req, chat, sampling
        self.session_id, self.authorization, self.loop = session_id, authorization, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.cached = 0  # prompt tokens whose KV a reused session already held
        self.end: tuple | None = None  # the turn's last event, sent once its session is free again

    def put(self, *item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    # -- which session -------------------------------------------------------------------
    def _guest(self) -> str | None:
        if self.req.guest is None:
            return None
        path = GUESTS_DIR / f"{self.req.guest}.wasm"
        if not path.is_file():
            raise oa.bad(f"no guest '{self.req.guest}' is installed on this host", "guest")
        return str(path)

    def _named(self, sid: str):
        srv = self.srv
        srv.check_owner(sid, self.key)
        if sid not in srv.host.sessions and (to := srv.where(sid)) is not None:
            raise oa.HttpError(404, f"session {sid} moved to {to}: send it there", "not_found_error",
                               code="session_moved", headers={"X-Kvferry-Moved-To": to})
        s = srv.host.get(sid)
        slot = srv.slot(sid)
        if not slot.lock.acquire(timeout=LOCK_WAIT_S):
            raise SessionBusyError(f"session {sid} is busy with another request")
        return s, slot

    def _reuse(self, guest: str | None):
        """The idle HTTP session of this key whose messages are the longest prefix
        of the request's earlier messages; None when none shares one."""
        earlier = self.req.messages[:-1]
        label = str(guest or "")
        best, best_n = None, 0
        for s in list(self.srv.host.sessions.values()):
            if s.closed or s.turn is not None or s.owner != self.key.name or not getattr(s, "http", False):
                continue
            if getattr(s, "http_guest", "") != label:
                continue
            n = len(s.messages)
            if best_n < n <= len(earlier) and s.messages == earlier[:n]:
                best, best_n = s, n
        if best is None:
            return None
        slot = self.srv.slot(best.id)
        if not slot.lock.acquire(blocking=False):
            return None  # another request is on it: never share a session between two requests
        if best.turn is not None or best.closed or best.id not in self.srv.host.sessions:
            slot.lock.release()
            return None
        return best, slot

    def _session(self):
        if self.session_id:
            return self._named(self.session_id)
        guest = self._guest()
        if self.chat and (found := self._reuse(guest)) is not None:
            return found
        srv = self.srv
        s = srv.host.create_session(guest, self.sampling, owner=self.key.name)
        s.http, s.http_guest = True, str(guest or "")
        log.info("session %s created over HTTP (key %s)", s.id, s.owner or "-")
        srv.arrived(s.id)
        srv.tell_directory("register_session", s.id, srv.address)
        slot = srv.slot(s.id)
        slot.lock.acquire()
        return s, slot

    # -- the turn ---------------------------------------------------------------------------
    def drive(self) -> None:
        try:
            s, slot = self._session()
        except Exception as e:  # noqa: BLE001 - the request's answer
            self.put("error", e)
            return
        one_shot = not self.chat and not self.session_id  # a raw completion's session ends with it
        try:
            if s.sampling != self.sampling:
                s.configure(self.sampling)
            if self.chat:
                s.messages = list(self.req.messages[:-1])
                last = self.req.messages[-1]
                events = s.send(last["content"], last["role"])
            else:
                events = s.complete(self.req.prompt)
            cached = len(s.history)  # the KV kept from earlier turns: not prefilled again
            n_prompt, n_out = cached + s.turn.n_prompt, 0
            self.cached = cached
            self.put("session", s.id)
            moved = None
            chunks = self.srv.run_turn(s, slot, events, lambda: not self.cancel.is_set())
            for c in coalesce(chunks, self.srv.host.policy.stream_interval):  # one SSE event a chunk
                if c.moved_to:
                    moved = (c.moved_to, c.index)
                    break
                n_out = self._pass(c, n_prompt, n_out)
            if moved is not None:
                self._relay(s.id, *moved, n_prompt, n_out)
        except Exception as e:  # noqa: BLE001 - the request's answer (or the stream's last event)
            self.end = None
            self.put("error", e)
        finally:
            slot.lock.release()
            if one_shot and s.id in self.srv.host.sessions:
                try:
                    self.srv.host.close_session(s.id)
                except Exception:  # noqa: BLE001 - closed meanwhile
                    pass
            # Only now: a client that sends its next message as soon as this reply
            # ends must find the session idle, to continue it (not open another).
            if self.end is not None:
                self.put(*self.end)

    def _relay(self, sid: str, target: str, index: int, n_prompt: int, n_out: int) -> None:
        """The session moved mid-reply: follow the rest of the turn from its new host."""
        from .sdk import Client

        log.info("session %s moved to %s mid-reply: relaying its stream from index %d", sid, target, index)
        token = self.authorization[7:] if self.authorization.startswith("Bearer ") else None
        with Client(target, token) as c:
            for ch in c.session(sid, target).resume(from_index=index):
                if self.cancel.is_set():
                    return
                n_out = self._pass(ch, n_prompt, n_out)

    def _pass(self, c: Any, n_prompt: int, n_out: int) -> int:
        """One chunk of the turn to the request's queue; returns the tokens so far."""
        if c.token >= 0:
            self.put("token", c.text + "".join(c.more_texts))  # serve --stream-interval: several a chunk
            return n_out + 1 + len(c.more_tokens)
        if c.finish_reason == "error":
            raise SessionError(c.text or "the reply ended with an error")
        if c.finish_reason:
            self.end = ("end", c.finish_reason, c.text, n_prompt, n_out)
        return n_out
