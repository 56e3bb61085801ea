"""Python's garbage collector on a host: the start-up heap frozen, pauses timed.

A full (generation 2) collection stops every Python thread while it walks every
object the collector tracks. A served host holds ~130,000 of them once Ray, gRPC,
mlx-lm and the tokenizer are loaded. On this 2-core CPU its start-up collections
took 35-156 ms, and with 200 sessions held one took 106 ms: a decode step that
meets one waits for it, and so does every stream (docs/performance.md).

Those objects live as long as the host. :func:`freeze`, once the host has started
and warmed up, moves them to the permanent generation that collections skip (as
vLLM and SGLang do after their warm-up), so a later collection walks only what
sessions made since. :class:`PauseClock` times every collection for the host's
metrics (``kvferry_gc_pause_seconds``), so an operator can see what is left, and
:func:`gc_cpu_seconds` keeps each thread's collecting out of a guest's step budget.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("kvferry.collector")
LONG_PAUSE_S = 0.02  # a collection longer than this is logged: it shows in some reply's token times


_thread = threading.local()  # CPU seconds this thread spent collecting garbage


def _count_cpu(phase: str, info: dict) -> None:
    """A collection runs on whichever thread allocates: its CPU is nobody's guest's."""
    if phase == "start":
        _thread.start = time.thread_time()
    elif (t := getattr(_thread, "start", None)) is not None:
        _thread.spent = getattr(_thread, "spent", 0.0) + time.thread_time() - t
        _thread.start = None


gc.callbacks.append(_count_cpu)


def gc_cpu_seconds() -> float:
    """CPU seconds the calling thread has spent in collections (kvferry.guest
    subtracts them from a guest's own time)."""
    return getattr(_thread, "spent", 0.0)


def paused_seconds() -> float:
    """Wall seconds all of this process's collections have taken so far (every
    thread stops for each): the step trace's ``gc_ms`` is its growth over a step."""
    return _paused.seconds


def freeze() -> int:
    """Collect once, then freeze what survives (process-wide); returns how many
    objects the collector now skips."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseClock:
    """A ``gc.callbacks`` entry: ``observe(generation, seconds)`` after every
    collection, and with ``warn`` (a served host, whose log is set up) a warning
    for one over LONG_PAUSE_S. A CLI keeps it off: its stderr carries one-line
    errors. Collections run one at a time (under the GIL), so one start time does."""

    def __init__(self, observe: Callable[[int, float], None], warn: bool = False) -> None:
        self.observe = observe
        self.warn = warn
        self._t0: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            seconds, self._t0 = time.perf_counter() - self._t0, None
            self.observe(info["generation"], seconds)
            if self.warn and seconds >= LONG_PAUSE_S and not sys.is_finalizing():
                log.warning("a garbage collection (generation %d) paused every thread for %.0f ms",
                            info["generation"], seconds * 1e3)

    def install(self) -> "PauseClock":
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)


class _Total:  # every collection's wall time in this process, for paused_seconds
    seconds = 0.0

    def __call__(self, generation: int, seconds: float) -> None:
        self.seconds += seconds


_paused = _Total()
PauseClock(_paused).install()
