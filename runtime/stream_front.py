"""A host's stream front: its clients' Send streams, served by a process of their own.

``kvferry serve --stream-front`` starts one beside the host (``python -m
kvferry.stream_front``; it ends when the host does). The host answers ``Health``
with the front's address as ``stream_address``, and the SDK sends its Send calls
there; every other call, and a client that does not look, goes to the host as
before. For each Send the front asks the host to start it (``Egress.Start``, with
the client's own token, which the host checks), then relays the chunks the host
batches onto its one ``Egress.Open`` stream to that client (:mod:`kvferry.egress`
says why). A client that leaves is cancelled on the host, as a direct Send's is;
statuses and their kvferry error codes pass through unchanged.

Imports only gRPC, the stubs and :mod:`kvferry.transport`, so it starts in well
under a second.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import grpc

from .errors import ERROR_KEY, ConfigError
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .transport import MOVED_KEY, TLSConfig, grpc_options

log = logging.getLogger("kvferry.stream_front")
KEY_ENV = "KVFERRY_FRONT_KEY"  # the host's secret for its front: never on a command line
START_S = 30.0  # how long a host may take to say it started a Send
CODES = {c.value[0]: c for c in grpc.StatusCode}
HOST_GONE = "the host behind this stream front stopped"


class Front(pbg.SessionsServicer):
    """Serves Send by relaying it to the host; the Sessions service's other calls are the host's."""

    def __init__(self, engine: str, key: str):
        self.channel = grpc.insecure_channel(engine, options=grpc_options())
        self.stub = pbg.EgressStub(self.channel)
        self.key = key
        self.routes: dict[int, queue.SimpleQueue] = {}
        self.ids = itertools.count(1)
        self.down = threading.Event()
        self.relay = threading.Thread(target=self._relay, daemon=True, name="kvferry-front-relay")

    def _relay(self) -> None:
        """Hand each item of the host's batches to its Send."""
        try:
            for batch in self.stub.Open(pb.EgressOpen(front_key=self.key)):
                for item in batch.items:
                    q = self.routes.get(item.stream)
                    if q is not None:
                        q.put(item)
        except grpc.RpcError as e:
            log.warning("the host's egress stream ended: %s", e.details() or e.code().name)
        finally:
            self.shut()

    def shut(self) -> None:
        """The host is gone: every Send waiting on it ends."""
        self.down.set()
        for q in list(self.routes.values()):
            q.put(None)

    def Send(self, request, context):
        if self.down.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, HOST_GONE)
        n = next(self.ids)
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.routes[n] = q
        ended = threading.Event()
        try:
            token = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
            try:
                self.stub.Start(pb.EgressStart(front_key=self.key, stream=n, send=request), metadata=token,
                                timeout=START_S)
            except grpc.RpcError as e:
                context.set_trailing_metadata(tuple((k, v) for k, v in (e.trailing_metadata() or ())
                                                    if k in (ERROR_KEY, MOVED_KEY)))
                context.abort(e.code(), e.details() or "")

            def gone() -> None:  # the call ended; if its client left first, stop the turn on the host
                if not ended.is_set():
                    threading.Thread(target=self._cancel, args=(n,), daemon=True).start()
            context.add_callback(gone)
            while True:
                item = q.get()
                if item is None:
                    context.abort(grpc.StatusCode.UNAVAILABLE, HOST_GONE)
                if item.HasField("chunk"):
                    yield item.chunk
                if item.end:
                    ended.set()
                    if item.code:
                        meta = [(ERROR_KEY, item.error)] if item.error else []
                        if item.moved_to:
                            meta.append((MOVED_KEY, item.moved_to))
                        context.set_trailing_metadata(tuple(meta))
                        context.abort(CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.details)
                    return
        finally:
            self.routes.pop(n, None)


    def _cancel(self, n: int) -> None:
        try:
            self.stub.Cancel(pb.EgressCancel(front_key=self.key, stream=n), timeout=START_S)
        except grpc.RpcError as e:  # the host is gone too: nothing runs there to stop
            log.warning("could not cancel stream %d on the host: %s", n, e.details() or e.code().name)


class FrontProcess:
    """A running front (:func:`spawn`); it stops when :meth:`stop` closes its stdin, or its host exits."""

    def __init__(self, proc: subprocess.Popen, port: int, where: Path):
        self.proc, self.port, self.where = proc, port, where

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        for p in (self.where / "host.sock", self.where):
            try:
                p.rmdir() if p.is_dir() else p.unlink()
            except OSError:
                pass


def private_endpoint() -> tuple[str, Path]:
    """A Unix socket only this user can reach, for the host's end (``unix:PATH``, its folder)."""
    where = Path(tempfile.mkdtemp(prefix="kvferry-front-"))  # mode 0700
    return f"unix:{where / 'host.sock'}", where


def spawn(engine: str, where: Path, bind_host: str, key: str, tls: TLSConfig | None, threads: int) -> FrontProcess:
    """Start a front for the host at ``engine`` on ``bind_host`` (a free port); waits until it listens."""
    cmd = [sys.executable, "-m", "kvferry.stream_front", "--engine", engine, "--bind", f"{bind_host}:0",
           "--threads", str(threads)]
    if tls is not None and tls.cert:
        cmd += ["--tls-cert", tls.cert, "--tls-key", tls.key] + (["--tls-ca", tls.ca] if tls.ca else [])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, KEY_ENV: key},
                            text=True)
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        proc.wait()
        raise ConfigError(f"the stream front did not start ({line or 'no port'}); see the host's log")
    return FrontProcess(proc, int(line), where)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvferry.stream_front",
                                 description="Serve a kvferry host's Send streams (started by serve --stream-front).")
    ap.add_argument("--engine", required=True, help="the host's private address (unix:PATH)")
    ap.add_argument("--bind", required=True, help="HOST:PORT to serve clients on (port 0: a free one, printed)")
    ap.add_argument("--threads", type=int, default=72, help="Send streams served at once")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--tls-ca")
    a = ap.parse_args(argv)
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        print(f"error: no {KEY_ENV}: a front is started by its host (serve --stream-front)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvferry.stream_front %(message)s")
    front = Front(a.engine, key)
    options = grpc_options() + [("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
                                ("grpc.http2.max_ping_strikes", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(a.threads + 4, thread_name_prefix="kvferry-front"),
                         options=options, maximum_concurrent_rpcs=a.threads)
    pbg.add_SessionsServicer_to_server(front, server)
    tls = TLSConfig(a.tls_cert, a.tls_key, a.tls_ca)
    port = server.add_secure_port(a.bind, tls.server_credentials()) if a.tls_cert else server.add_insecure_port(a.bind)
    if port == 0:
        print(f"cannot bind {a.bind}", flush=True)
        return 1
    server.start()
    front.relay.start()
    print(port, flush=True)
    # live as long as the host: it holds our stdin, and closing it (or dying) says stop
    threading.Thread(target=lambda: (sys.stdin.read(), front.shut()), daemon=True).start()
    front.down.wait()
    server.stop(1).wait()
    os._exit(0)  # (its threads hold nothing worth waiting for)


if __name__ == "__main__":
    sys.exit(main())
