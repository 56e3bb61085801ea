"""Run on: a driven step queues each reply's next decode itself (a mixin of
:class:`kvferry.batching.StepScheduler`; on wherever guests run on the step
thread, ``KVFERRY_RUN_ON=0`` turns it off).

With guests on the step thread (``serve --guest-thread step``), the step thread
knows the decode each reply asks for next: the token its guest just chose. Here it
queues that decode for the next step at once, before the session's thread has
streamed the token and come back for it; that thread then attaches to the queued
decode (one that comes back after the step calls its guest itself, on the step's
logits). So a step waits for no session's thread, as vLLM's engine loop waits for
no API server. At 64 sessions on the H200 that wait was a third of a step.

Three rules keep a session existing exactly once, with its turn as its own thread
sees it:

- a decode is queued only where the turn will ask for it (:meth:`Session.will_decode`);
- a migration's pause holds only at a boundary with nothing queued (:meth:`still`),
  and a checkpoint between two steps takes a queued decode back first (:meth:`settle`);
- a turn that stops early (its client gone) takes its queued decode back (``leave``).

On an H100 at 64 sessions it served 1.29x the tokens/s (a step every ~27 ms
against ~35); on a 2-core CPU it is neutral, the sessions' threads taking the GIL
from the step thread instead (docs/sessions.md).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .errors import SessionError


class RunOn:
    """Reads the scheduler's ``cv``, ``decodes``, ``expect``, ``stats``, ``thread`` and ``request``."""

    def _init_run_on(self, drive: bool) -> None:
        self.run_on: dict = {}  # session -> the decode queued for it, not yet attached to
        self.held: set = set()  # sessions that must come to a still step boundary (a pause, a checkpoint)
        self.runs_on = drive and os.environ.get("KVFERRY_RUN_ON", "1") != "0"

    def _attach(self, session: Any, last: int) -> Any:
        """(The session's thread, back for the decode of ``last``) The decode queued for it,
        now attached (its step drives the guest), or None: it queues its own."""
        undo = None
        with self.cv:
            req = self.run_on.pop(session, None)
            if req is not None and req.tokens == [last]:
                req.attached = True  # this step already runs (or ran) its decode
            elif req is not None:  # (another token than it ran on: not this turn's next step)
                undo, req = self._retract(req), None
        self._undo(session, undo)
        return req

    def _drivable(self, reqs: list) -> list:
        """Of a step's driven rows, those whose guests this thread calls: a decode run on
        whose session's thread did not come back during the step is left ``ran`` (that
        thread calls its guest), and one retracted is left for its take-back."""
        with self.cv:
            late = [r for r in reqs if r.gone or (r.unattended and not r.attached)]
            for r in late:
                r.ran = True
                self.stats["run_on_late"] += not r.gone
            reqs = [r for r in reqs if not r.gone and (not r.unattended or r.attached)]
        for r in late:
            r.done.set()
        return reqs

    def _run_on(self, reqs: list) -> None:
        """Queue the decode of each token these guests chose, for the next step, before
        their sessions' threads come back for it (they attach to it then): the next step
        need not wait for them, as vLLM's engine loop waits for no API server. Only where
        the turn will ask for that decode next (run_reply's limits), and never for a
        session that must come to a still boundary (:meth:`still`)."""
        with self.cv:
            for r in reqs:
                s = r.session
                if (r.error is None and r.token is not None and s not in self.held and s not in self.run_on
                        and not s.closed and s.will_decode(r.token)):
                    nxt = self.request(s, [r.token], driven=True)
                    nxt.unattended = True
                    self.run_on[s] = nxt
                    self.decodes.append(nxt)
                    self.stats["run_on"] += 1
                    self.expect.discard(s)

    def _unhold(self, session: Any) -> Any:
        """(Under ``cv``; its turn has ended or stopped) No hold, and its queued decode
        retracted: returned for :meth:`_undo` where it is in a step."""
        self.held.discard(session)
        return self._dequeue(session)

    def _dequeue(self, session: Any) -> Any:
        """(Under ``cv``) The decode queued for ``session``, retracted (see :meth:`_retract`)."""
        req = self.run_on.pop(session, None)
        return self._retract(req) if req is not None else None

    def still(self, session: Any) -> bool:
        """(A migration's pause, at a step boundary of ``session``'s turn) Run none of its
        steps on from now; True when none is queued or running, so the boundary is still.
        False: one is, and its thread takes its token first (the next boundary is still)."""
        with self.cv:
            self.held.add(session)
            return session not in self.run_on

    def settle(self, session: Any) -> None:
        """Hold ``session`` at the boundary its own thread left it at: no step of it runs
        on from now, and a decode queued for it is taken back (a checkpoint between two
        steps, its generator suspended). :meth:`release` ends it."""
        with self.cv:
            self.held.add(session)
            undo = self._dequeue(session)
        self._undo(session, undo)

    def release(self, session: Any) -> None:
        """The pause is over and the turn goes on here: its steps run on again."""
        with self.cv:
            self.held.discard(session)

    def _retract(self, req: Any) -> Any:
        """(Under ``cv``) A decode run on that its session will not ask for: not run yet, it
        leaves the queue (None); in a step, it is marked to be left undriven, and returned
        for :meth:`_undo` (outside ``cv``)."""
        self.stats["run_on_retracted"] += 1
        if req in self.decodes:
            self.decodes.remove(req)
            return None
        req.gone = True
        return req

    def _undo(self, session: Any, req: Any) -> None:
        """Take back the token a retracted decode wrote, once its step is done: the cache
        and the history are then as the session's own thread left them."""
        if req is None:
            return
        if threading.current_thread() is self.thread:  # (it would wait for its own step)
            raise SessionError("a decode run on cannot be retracted by the step thread")
        req.done.wait()
        if req.error is None and req.ran:
            session._take_back()
