"""A lane: a migration's KV frames on a socket of their own, beside its Transfer stream.

gRPC's Python stack copies each message several times holding the GIL, and on
loopback a bare gRPC stream of 4 MiB messages measured ~1.0 GB/s where a plain
socket between the same two processes moved 2.6-4.2 GB/s (``kvferry bench migrate
--transfer-only`` reports both). So the stream keeps everything but the frames:
Begin, the acks (the window and the resume point), commit, abort, Status. The
frames go on a lane:

- the source asks for one in its Begin; the target answers, on the authenticated
  stream, with its lane's port and a ticket (32 random bytes) good for one
  connection of that stream only: holding the ticket is the lane's authentication;
- the source dials the target's host at that port (TLS with the stream's
  certificates when the host serves TLS), sends ``MAGIC + ticket``, then records
  ``u64 seq | u64 length | frame``, which the target reads into the stream's
  :class:`Inbox` in order with its messages.

A lane that cannot be opened (a firewall, an older target) leaves the frames on the
stream, and one that breaks is a dropped link: the source reconnects and resends
from the target's last verified frame, as on the stream.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import ssl
import struct
import threading
from typing import Any, Callable, Iterator

from .checkpoint import host_blocks
from .checkpoint.frames import Parts, check_ahead
from .migration_wire import FrameView
from .transport import MAX_MESSAGE, TLSConfig

log = logging.getLogger("kvferry.migration")

MAGIC = b"KVFL"
TICKET_BYTES = 32
RECORD = struct.Struct("<QQ")  # seq, length
HELLO_S = 5.0  # s a dialler has for TLS and its ticket
IDLE_S = 600.0  # s a lane may stay silent (the Transfer call's own deadline)
CONNECT_S = 3.0  # s a source waits for the lane's connection before it keeps frames on the stream
MAX_HELLOS = 16  # connections not yet past their ticket: more are closed at once
INBOX_ITEMS = 64  # frames and messages a stream holds unread (a lane's reader waits beyond)
POOL_BUFFERS = 4  # frame buffers a lane keeps for reuse: a fresh one costs its page faults each time
JOIN_BELOW = 64 << 10  # a frame this small goes out in one send with its record head
IOV_BATCH = 512  # buffers one sendmsg takes (Linux allows 1024)


class LaneFrame(FrameView):
    """A frame read from a lane, in a buffer of the lane's pool or of the host's kept
    blocks: the handler lets go of it once it has landed the frame (what it keeps,
    it copied out)."""

    def __init__(self, seq: int, data: memoryview, pool: "queue.SimpleQueue[bytearray]", buf: Any):
        # hashed here, on the lane's thread, while the handler lands the frame before
        super().__init__(seq, data, check_ahead(data))
        self.pool, self.buf = pool, buf

    def release(self) -> None:
        self.data.release()
        buf, self.buf = self.buf, None  # a kept block is free again once no view of it lives
        if isinstance(buf, bytearray) and self.pool.qsize() < POOL_BUFFERS:
            self.pool.put(buf)


class LaneBroken:
    """Put in a stream's inbox when its lane fails: the source reconnects."""

    def __init__(self, why: str):
        self.why = why


class _End:
    pass


_END = _End()


def _blocking(conn: socket.socket, idle_s: float) -> None:
    """A blocking socket with the kernel's own timeouts. Python's timeout makes the
    descriptor non-blocking, and then a frame of megabytes takes dozens of calls,
    each waiting for the GIL that the other threads of a host hold (up to the 5 ms
    switch interval each); blocking, it takes one call that lets go of the GIL."""
    conn.settimeout(None)
    tv = struct.pack("ll", int(idle_s), int(idle_s % 1 * 1e6))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv_exact(conn: socket.socket, n: int, buf: bytearray | None = None) -> bytearray | None:
    """``n`` bytes (into ``buf`` when given, at least that long), or None on a
    clean end of stream before the first of them."""
    buf = bytearray(n) if buf is None else buf
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            if got == 0:
                return None
            raise ConnectionError(f"the lane ended inside a record ({got} of {n} bytes)")
        got += k
    return buf


class Inbox:
    """What one Transfer stream handler reads: its gRPC messages, read directly
    until a lane opens, then merged in order of arrival with the lane's frames. A
    frame and the control message that depends on it never race (the source sends
    commit only after the target said it restored every frame), but frames race
    each other: a live pause's few go on the stream and may pass the lane's last
    ones, which the handler puts back in order (``Incoming.ahead``)."""

    def __init__(self, requests: Iterator[Any]):
        self.requests = iter(requests)
        self.q: "queue.Queue[Any]" = queue.Queue(INBOX_ITEMS)
        self.closed = threading.Event()
        self.merged = False
        self.conn: socket.socket | None = None

    def __iter__(self) -> Iterator[Any]:
        while not self.merged:  # merge() comes from our consumer, between two items
            m = next(self.requests, _END)
            if m is _END:
                return
            yield m
        while (m := self.q.get()) is not _END:
            yield m

    def merge(self) -> None:
        """(In the handler, right after a message) read the stream on a thread of
        its own from now on, so that lane frames can come in between."""
        self.merged = True

        def pump() -> None:
            try:
                for m in self.requests:
                    if not self.put(m):
                        return
            except Exception:
                pass  # the call ended (cancelled, reset): the handler is told by _END
            self.put(_END)
        threading.Thread(target=pump, daemon=True, name="kvferry-transfer-pump").start()

    def put(self, item: Any) -> bool:
        """Queue ``item``, waiting while the handler is behind; False once closed."""
        while not self.closed.is_set():
            try:
                self.q.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self.closed.set()
        conn, self.conn = self.conn, None
        if conn is not None:
            _shut(conn)


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


class LaneListener:
    """The target's lane: one listening socket on the host's bind address, serving
    the tickets its Transfer streams hand out."""

    def __init__(self, host: str, port: int = 0, tls: TLSConfig | None = None):
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=MAX_HELLOS)
        self.port = self.sock.getsockname()[1]
        self.ssl = tls.ssl_server_context() if tls is not None and tls.cert else None
        self.tickets: dict[bytes, Inbox] = {}
        self.lock = threading.Lock()
        self.hellos = threading.BoundedSemaphore(MAX_HELLOS)
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="kvferry-lane").start()

    def issue(self, inbox: Inbox) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self.lock:
            self.tickets[ticket] = inbox
        return ticket

    def revoke(self, ticket: bytes) -> None:
        with self.lock:
            self.tickets.pop(ticket, None)

    def close(self) -> None:
        self.closed = True
        _shut(self.sock)

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                continue
            if not self.hellos.acquire(blocking=False):  # a flood of silent dialers: no thread each
                _shut(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kvferry-lane-in").start()

    def _hello(self, conn: socket.socket) -> tuple[socket.socket, Inbox | None]:
        try:
            conn.settimeout(HELLO_S)
            if self.ssl is not None:
                conn = self.ssl.wrap_socket(conn, server_side=True)
            hello = _recv_exact(conn, len(MAGIC) + TICKET_BYTES)
        finally:
            self.hellos.release()
        if hello is None or hello[:len(MAGIC)] != MAGIC:
            return conn, None
        with self.lock:
            return conn, self.tickets.pop(bytes(hello[len(MAGIC):]), None)

    def _serve(self, conn: socket.socket) -> None:
        inbox = None
        try:
            conn, inbox = self._hello(conn)
            if inbox is None:
                return  # not a lane of ours, or a ticket used or revoked: nothing said
            _blocking(conn, IDLE_S)
            inbox.conn = conn
            pool: "queue.SimpleQueue[bytearray]" = queue.SimpleQueue()
            while not inbox.closed.is_set():
                head = _recv_exact(conn, RECORD.size)
                if head is None:
                    return
                seq, n = RECORD.unpack(head)
                if n > MAX_MESSAGE:
                    raise ConnectionError(f"a {n}-byte frame, over the {MAX_MESSAGE >> 20} MiB limit")
                buf = _room(pool, n)
                if n and _recv_exact(conn, n, buf) is None:
                    raise ConnectionError("the lane ended inside a record")
                if not inbox.put(LaneFrame(seq, memoryview(buf)[:n], pool, buf)):
                    return
        except (OSError, ssl.SSLError, ValueError) as e:
            if inbox is not None and not inbox.closed.is_set():
                inbox.put(LaneBroken(f"{type(e).__name__}: {e}"))
        finally:
            _shut(conn)


def _room(pool: "queue.SimpleQueue[bytearray]", n: int) -> Any:
    """A buffer of at least ``n`` bytes for a frame: on a GPU host from its kept,
    page-locked blocks, which the landing's copy engine reads without staging;
    elsewhere a released one of the lane's when one is long enough."""
    kept = host_blocks.frame(n)
    if kept is not None:
        return kept
    for _ in range(pool.qsize()):
        buf = pool.get_nowait()
        if len(buf) >= n:
            return buf
    return bytearray(n)


def client_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """The source's TLS for a lane: the stream's own (its CA, and its certificate
    for a mutual-TLS target), or None for a plaintext stream."""
    if tls is None or not (tls.ca or tls.cert):
        return None
    ctx = ssl.create_default_context(cafile=tls.ca)
    if tls.cert:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def _send(conn: socket.socket, buffers: list) -> None:
    """``buffers`` in order, never joined: on a plain socket by ``sendmsg``
    (scatter-gather, IOV_BATCH at a time); over TLS, which has no sendmsg, by one
    ``sendall`` a buffer, the small ones (msgpack's heads) joined first."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    if isinstance(conn, ssl.SSLSocket):
        small: list = []
        for v in views + [None]:
            if v is not None and v.nbytes < JOIN_BELOW:
                small.append(v)
                continue
            if small:
                conn.sendall(b"".join(small))
                small = []
            if v is not None:
                conn.sendall(v)
        return
    i = 0
    while i < len(views):
        n = conn.sendmsg(views[i:i + IOV_BATCH])
        while n and i < len(views):  # past what went, and into a buffer cut short
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i], n = views[i][n:], 0


class LaneWriter:
    """The source's end of a lane: frames go out in order on a thread of their own,
    so that the next frame is encoded while this one is on the wire."""

    def __init__(self, host: str, port: int, ticket: bytes, tls: TLSConfig | None,
                 on_broken: Callable[["LaneWriter"], None]):
        conn = socket.create_connection((host, port), timeout=CONNECT_S)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ctx = client_context(tls)
            if ctx is not None:
                conn = ctx.wrap_socket(conn, server_hostname=host)
            conn.sendall(MAGIC + ticket)
            _blocking(conn, IDLE_S)
        except BaseException:
            _shut(conn)
            raise
        self.conn = conn
        self.on_broken = on_broken
        self.q: "queue.Queue[Any]" = queue.Queue()
        self.closed = False
        threading.Thread(target=self._run, daemon=True, name="kvferry-lane-out").start()

    def put(self, seq: int, frame: bytes | Parts) -> None:
        self.q.put((seq, frame))

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            seq, frame = item
            try:
                head = RECORD.pack(seq, len(frame))
                if isinstance(frame, Parts):
                    _send(self.conn, [head, *frame.buffers])
                elif len(frame) < JOIN_BELOW:
                    self.conn.sendall(head + frame)
                else:
                    self.conn.sendall(head)
                    self.conn.sendall(frame)
            except (OSError, ValueError) as e:
                if not self.closed:
                    log.warning("migration lane broke: %s: %s", type(e).__name__, e)
                    self.on_broken(self)
                return

    def close(self) -> None:
        """Stop now: frames still queued are dropped (a resume resends what the
        target did not verify; after a commit nothing is left)."""
        self.closed = True
        self.q.put(None)
        _shut(self.conn)
