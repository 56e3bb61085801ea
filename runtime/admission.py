"""Admission to a host's running batch (``serve --max-batch``, ``--max-queue``,
``--max-kv-mb``): who generates now and who waits, first come first served."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from .errors import HostFullError, SessionError


class Admission:
    """At most ``max_batch`` turns generate at once, and their KV growth fits the host's
    KV budget; more wait here, first come first served, up to ``max_queue`` of them
    (beyond: HostFullError, RESOURCE_EXHAUSTED)."""

    def __init__(self, max_batch: int, max_queue: int, kv_budget: int = 0, kv_used=lambda: 0) -> None:
        self.max_batch, self.max_queue = max_batch, max_queue
        self.kv_budget, self.kv_used = kv_budget, kv_used
        self.cv = threading.Condition()
        self.running: dict = {}  # session -> KV bytes its turn may still add
        self.queue: deque = deque()

    def position(self, session: Any) -> int:
        """0: running or idle; k: k-th in the queue."""
        with self.cv:
            return self.queue.index(session) + 1 if session in self.queue else 0

    def _fits(self, need: int) -> bool:
        if len(self.running) >= self.max_batch:
            return False
        return not self.kv_budget or not self.running or \
            self.kv_used() + sum(self.running.values()) + need <= self.kv_budget

    def enter(self, session: Any, need: int = 0) -> None:
        """Wait for a place for ``session``'s turn, which may add ``need`` KV bytes."""
        with self.cv:
            if session in self.running:
                return
            if self.kv_budget and need + self.kv_used() > self.kv_budget:
                raise HostFullError(f"this reply may need {need / 1e6:.1f} MB of KV cache and the host holds "
                                    f"{self.kv_used() / 1e6:.1f} MB of its {self.kv_budget / 1e6:.1f} MB "
                                    "(serve --max-kv-mb); ask for fewer max_tokens or use another host")
            if not self.queue and self._fits(need):
                self.running[session] = need
                return
            if len(self.queue) >= self.max_queue:
                raise HostFullError(f"this host is busy: {len(self.running)} replies generating (serve "
                                    f"--max-batch {self.max_batch}) and {len(self.queue)} waiting "
                                    f"(--max-queue {self.max_queue}); retry later")
            self.queue.append(session)
            try:
                while not (self.queue[0] is session and self._fits(need)):
                    if session.closed:
                        raise SessionError(f"session {session.id} was closed while it waited for a place")
                    self.cv.wait(1.0)
            finally:
                self.queue.remove(session)
                self.cv.notify_all()
            self.running[session] = need

    def leave(self, session: Any) -> None:
        with self.cv:
            if self.running.pop(session, None) is not None:
                self.cv.notify_all()
