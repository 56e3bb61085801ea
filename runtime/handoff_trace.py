"""KVFERRY_STEP_TRACE=DIR also records each migration's handoff: one JSON line an
event in DIR/handoff-PID.jsonl, ``{"t", "event", "session"}``. ``t`` is
``time.perf_counter()``, CLOCK_MONOTONIC on Linux, one clock for every process of a
machine: so the source's pause, the target's first step (the step trace's lines, same
clock) and the client's token times line up on one axis (docs/performance.md)."""

from __future__ import annotations

import json
import os
import threading
import time

_lock = threading.Lock()
_file = None
_opened = False


def mark(event: str, session: str = "", t: float | None = None) -> None:
    """Record ``event`` at ``t`` (a perf_counter time; now by default); nothing when
    the trace is off (one global read)."""
    global _file, _opened
    if not _opened:
        with _lock:
            if not _opened:
                folder = os.environ.get("KVFERRY_STEP_TRACE")
                if folder:
                    try:
                        os.makedirs(folder, exist_ok=True)
                        _file = open(os.path.join(folder, f"handoff-{os.getpid()}.jsonl"), "a", buffering=1)
                    except OSError:
                        _file = None  # the step trace reports an unwritable folder itself
                _opened = True
    if _file is None:
        return
    line = json.dumps({"t": round(time.perf_counter() if t is None else t, 6), "event": event, "session": session})
    with _lock:
        _file.write(line + "\n")
