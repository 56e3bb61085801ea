"""kvferry's logs: stdlib ``logging`` under the ``kvferry`` logger, one line per
event that matters (session created, moved, trapped, drained; host up and down).

``kvferry serve --log-format json`` prints one JSON object per line. A host
actor keeps its recent lines in a ring (:class:`Ring`); ``kvferry serve`` reads
them from the actor and writes them to its own stderr, hence journald or launchd.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        out = {"ts": round(r.created, 3), "level": r.levelname.lower(), "logger": r.name, "msg": r.getMessage()}
        if r.exc_info:
            out["error"] = self.formatException(r.exc_info).splitlines()[-1]
        return json.dumps(out)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    f = logging.Formatter("%(asctime)s kvferry %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
    f.converter = time.gmtime
    return f


class Ring(logging.Handler):
    """The last ``size`` formatted lines, numbered, for a reader in another process."""

    def __init__(self, size: int = 10000) -> None:
        super().__init__()
        self.lines: deque[tuple[int, str]] = deque(maxlen=size)
        self.seq = 0
        self.lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        with self.lock_:
            self.seq += 1
            self.lines.append((self.seq, line))

    def after(self, seq: int) -> tuple[int, list[str]]:
        with self.lock_:
            return self.seq, [line for n, line in self.lines if n > seq]


RING: Ring | None = None


def setup(fmt: str = "text", stream=None, ring: bool = True) -> None:
    """Configure the ``kvferry`` logger once per process: to ``stream`` (default
    stderr) and, in a host actor, to the ring its ``kvferry serve`` reads."""
    global RING
    if fmt not in FORMATS:
        from .errors import ConfigError

        raise ConfigError(f"--log-format {fmt}: choose from {', '.join(FORMATS)}")
    logger = logging.getLogger("kvferry")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
    if ring:
        RING = Ring()
        RING.setFormatter(formatter(fmt))
        logger.addHandler(RING)
    else:
        h = logging.StreamHandler(stream or sys.stderr)
        h.setFormatter(formatter(fmt))
        logger.addHandler(h)
