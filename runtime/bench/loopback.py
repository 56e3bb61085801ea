"""A ``kvferry serve`` on 127.0.0.1 (its own embedded Ray), as the benchmarks start it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from ..errors import KvferryError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackHost:
    """``kvferry serve --port PORT *args`` with ``token`` as its admin key; ready once
    it prints its address. ``stop()`` drains it (SIGTERM), then kills what is left."""

    def __init__(self, token: str, *args: str, port: int = 0, env: dict | None = None):
        # port 0: the host binds a free port itself and prints it (a port picked here could be
        # taken by another process before the host binds it: a CI run lost a bench that way)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvferry", "serve", "--port", str(port), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {}), "KVFERRY_TOKEN": token},
                                     start_new_session=True)
        self.http = None  # http://HOST:PORT/v1 with --http-port
        seen: list[str] = []
        for line in self.proc.stdout:
            if "kvferry serving on" in line:
                self.address = line.split("kvferry serving on ")[1].split(" ")[0]
                self.port = int(self.address.rsplit(":", 1)[1])
                if "OpenAI API on " in line:
                    self.http = line.split("OpenAI API on ")[1].split(")")[0]
                break
            seen = (seen + [line.rstrip()])[-3:]
        else:
            # the host's own one-line refusal (a wrong model, a bad flag), not a traceback of the bench's
            raise KvferryError("the served host did not start: " + (" | ".join(seen) or "no output"))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
