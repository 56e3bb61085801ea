"""The gRPC face of a model host: client sessions and host-to-host migration.

One :class:`HostServer` wraps a :class:`runtime.host.ModelHost` and serves
``kvferry.v1.Sessions`` and ``kvferry.v1.Migration`` on one port. Inside a
Ray cluster the server runs in a ``SessionHost`` actor and reports to the
controller's session directory; it also runs standalone.

Concurrency: a session is driven by one thread at a time (its slot lock). A
migration of a session that is generating runs in the generating thread at the
next step boundary, so the turn is cut between two steps, moved whole, and the
client's stream ends with ``moved_to`` — the SDK continues it on the target
from the next token index: nothing lost, nothing repeated.
"""

from __future__ import annotations

import hmac
import ipaddress
import queue
import socket
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import grpc

from checkpoint import snapshot as ck
from checkpoint.errors import CheckpointError, OutOfMemoryError
from checkpoint.frames import FrameDecoder
from proto import kvferry_pb2 as pb
from proto import kvferry_pb2_grpc as pbg

from .errors import ConfigError, KvferryError, ModelMismatchError
from .guest import GuestError, GuestTrap
from .host import ModelHost, UnknownSessionError
from .session import SamplingParams, SessionError, SessionOptions

MAX_MESSAGE = 64 << 20
WINDOW_FRAMES = 256  # unacknowledged checkpoint frames in flight ...
WINDOW_BYTES = 32 << 20  # ... and bytes: big KV frames are paced, small final ones are not
RUNNING_WAIT = 5.0  # s: how long a source keeps a moved session's memory for the target's first token
PRECOPY_STEP_BYTES = 3 << 20  # live pre-copy default: ~3 MB of KV per step of the generating session
PRECOPY_RATE = 40e6  # ... and 40 MB/s while it is not generating
PRECOPY_CHUNK = 3 << 19  # pre-copy frames carry ~1.5 MB of one layer's KV (a token range)
ACK_EVERY_FRAMES, ACK_EVERY_BYTES = 16, 4 << 20  # the target acks this often (< the window)
PREPARED_TTL = 120.0


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 20000)]


@dataclass
class TLSConfig:
    cert: str | None = None  # server (or client) certificate chain, PEM path
    key: str | None = None
    ca: str | None = None  # CA to verify the peer; on a server it makes TLS mutual

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key), _read(self.cert))]
        if self.ca:
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def channel(address: str, tls: TLSConfig | None = None, *, aio: bool = False) -> Any:
    """A client channel (``aio``: a grpc.aio one), TLS when ``tls`` has a CA or cert."""
    g = grpc.aio if aio else grpc
    if tls is not None and (tls.ca or tls.cert):
        return g.secure_channel(address, tls.channel_credentials(), options=grpc_options())
    return g.insecure_channel(address, options=grpc_options())


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


# ----------------------------------------------------------------------------- auth

class AuthInterceptor(grpc.ServerInterceptor):
    """Every call must carry the shared secret; compared in constant time."""

    def __init__(self, token: str | None):
        self.expected = f"Bearer {token}".encode() if token else None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if self.expected is None or handler is None:
            return handler
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self.expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "auth failed: missing or wrong token")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


# ----------------------------------------------------------------------------- slots

def precopy_rate(s) -> float:
    """Live pre-copy pace when the caller set none: about PRECOPY_STEP_BYTES per
    decode step of the session, so each step is disturbed alike at any context
    (measured on a shared 2-core machine: at 8k tokens, ~3 MB per step left the
    worst pre-copy gap under the handoff's; ~6 MB per step, i.e. 40 MB/s, made
    it 47-95 ms), within 5-80 MB/s; PRECOPY_RATE while it is not generating."""
    if s.turn is None or not s.step_seconds:
        return PRECOPY_RATE
    return min(max(PRECOPY_STEP_BYTES / s.step_seconds, 5e6), 80e6)


@dataclass
class MigrationTicket:
    target: str
    token: str | None
    mode: str
    live: bool = False
    max_stages: int = 8
    final_delta: int = 4  # pause once fewer tokens than this remain to send
    rate: float = 0.0  # pre-copy: bytes of KV per second at most (0: see precopy_rate)
    progress: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    error: str | None = None
    pause_ms: float = 0.0


@dataclass
class Pause:
    """Holds a session still between two steps while a migration finishes it."""
    paused: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)
    idle: bool = False  # the session was not generating: we hold its slot lock instead
    committed: bool = False
    target: str = ""


@dataclass
class TurnFeed:
    """A turn the host drives itself (a migration landed mid-reply): generation
    resumes at commit, not when the client reconnects, and every chunk is kept
    so the client gets them from any index."""
    chunks: list = field(default_factory=list)
    done: bool = False
    cancel: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)
    # (token, text) the turn had when it landed: re-sent only to a client asking
    # from an earlier index, so generation resumes without replaying them first
    earlier: list = field(default_factory=list)

    def put(self, c: Any = None, done: bool = False) -> None:
        with self.cond:
            if c is not None:
                self.chunks.append(c)
            self.done = self.done or done
            self.cond.notify_all()

    def wait_started(self, timeout: float) -> None:
        """Until the first chunk (or the end) is out, at most ``timeout`` seconds."""
        with self.cond:
            self.cond.wait_for(lambda: self.chunks or self.done, timeout)


@dataclass
class Slot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pause_req: Pause | None = None
    migrating: bool = False


class MigrationError(KvferryError):
    pass


@dataclass
class Incoming:
    session_id: str
    restorer: ck.Restorer
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    next_seq: int = 0
    prepared: Any = None
    started: float = field(default_factory=time.monotonic)


class HostServer:
    """Serves one ModelHost over gRPC."""

    def __init__(self, host: ModelHost, bind: str = "127.0.0.1:0", *, token: str | None = None,
                 tls: TLSConfig | None = None, client_tls: TLSConfig | None = None,
                 directory: Any = None, node: str | None = None, allow_no_auth: bool = False):
        h, _, _ = bind.rpartition(":")
        if token is None and not (allow_no_auth and is_loopback(h)):
            raise ConfigError("refusing to serve without a token (set --token, or --no-auth on a "
                              "loopback address)")
        self.host = host
        self.token = token
        self.tls = tls
        self.client_tls = client_tls  # for outgoing migration connections
        self.directory = directory  # a Ray controller handle (or None)
        self.node = node or socket.gethostname()
        self.slots: dict[str, Slot] = {}
        self.moved: dict[str, str] = {}  # session id -> where it went
        self.incoming: dict[str, Incoming] = {}
        self.feeds: dict[str, TurnFeed] = {}
        self.committed: dict[str, float] = {}  # migration id -> when (answers a re-sent Begin)
        self._lock = threading.Lock()
        self.executor = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvferry-rpc")
        # accept the clients' 20 s keepalive pings during long calls (a prefill of
        # thousands of tokens on a CPU), instead of answering GOAWAY too_many_pings
        options = grpc_options() + [("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
                                    ("grpc.http2.max_ping_strikes", 0),
                                    ("grpc.keepalive_permit_without_calls", 1)]
        self.server = grpc.server(self.executor, options=options, interceptors=[AuthInterceptor(token)])
        pbg.add_SessionsServicer_to_server(_Sessions(self), self.server)
        pbg.add_MigrationServicer_to_server(_Migration(self), self.server)
        if tls is not None and tls.cert:
            port = self.server.add_secure_port(bind, tls.server_credentials())
        else:
            port = self.server.add_insecure_port(bind)
        if port == 0:
            raise ConfigError(f"cannot bind {bind}")
        self.address = f"{h or '127.0.0.1'}:{port}"
        if h in ("0.0.0.0", "[::]", ""):
            self.address = f"{socket.gethostbyname(socket.gethostname())}:{port}"

    def start(self) -> "HostServer":
        self.server.start()
        threading.Thread(target=self._janitor, daemon=True, name="kvferry-janitor").start()
        return self

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait()
        # join the RPC threads now: threads that ran MLX work must not be torn down
        # at interpreter exit (their thread-local MLX state would abort the process)
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _janitor(self) -> None:
        while True:
            time.sleep(5)
            now = time.monotonic()
            with self._lock:
                stale = [k for k, v in self.incoming.items() if now - v.started > PREPARED_TTL]
                for k in stale:
                    inc = self.incoming.pop(k)
                    if inc.prepared is not None:
                        inc.prepared.close()
                for k in [k for k, t in self.committed.items() if now - t > PREPARED_TTL]:
                    del self.committed[k]

    # -- directory ---------------------------------------------------------------
    def _dir(self, method: str, *args) -> Any:
        if self.directory is None:
            return None
        import ray

        try:
            return ray.get(getattr(self.directory, method).remote(*args), timeout=10)
        except Exception:  # the directory is advisory for routing; never fail a session on it
            return None

    def slot(self, sid: str) -> Slot:
        with self._lock:
            if sid not in self.host.sessions:
                raise UnknownSessionError(f"unknown session '{sid}'")
            return self.slots.setdefault(sid, Slot())

    def info(self, s) -> pb.SessionInfo:
        m = s.memory()
        return pb.SessionInfo(id=s.id, host=self.address, tokens=m["tokens"], guest=s.guest.module.label,
                              kv_bytes=m["kv_bytes"], arena_bytes=m["arena_bytes"], model=s.lm.name,
                              in_turn=s.turn is not None)

    # -- turns -----------------------------------------------------------------------
    def run_turn(self, s, slot: Slot, events: Iterator, alive: Callable[[], bool]) -> Iterator[pb.TokenChunk]:
        """A turn's chunks; between two steps, hold still for a migration and end
        with ``moved_to`` once it committed. Stops early when ``alive()`` turns
        false (the turn stays open for ``continue_turn``)."""
        for ev in events:
            yield pb.TokenChunk(index=ev.index, token=ev.token, text=ev.text,
                                finish_reason=ev.finish_reason or "",
                                stats=pb.TurnStats(prompt_tokens=s.last.prompt_tokens,
                                                   prompt_tps=s.last.prompt_tps,
                                                   generation_tokens=s.last.generation_tokens,
                                                   generation_tps=s.last.generation_tps)
                                if ev.finish_reason else None)
            p = slot.pause_req
            if p is not None and ev.finish_reason is None:  # a step boundary: hold still
                p.paused.set()
                p.resume.wait()
                if p.committed:
                    yield pb.TokenChunk(index=ev.index + 1, token=-1, moved_to=p.target)
                    return
            if not alive():
                return

    def drive(self, sid: str, slot: Slot, feed: TurnFeed) -> None:
        """Generate a landed turn into ``feed`` (holds the slot like a Send would)."""
        try:
            s = self.host.get(sid)
            for c in self.run_turn(s, slot, s.continue_turn(len(feed.earlier)), lambda: not feed.cancel):
                feed.put(c)
                time.sleep(0)  # hand the GIL to the follower now, not after the next step's graph
        except Exception as e:  # reported to whoever follows the feed; the session stays
            feed.put(pb.TokenChunk(index=-1, token=-1, finish_reason="error", text=str(e)))
        finally:
            slot.lock.release()
            feed.put(done=True)

    # -- migration (source side) ---------------------------------------------------
    def pause(self, sid: str, slot: Slot) -> Pause:
        """Stop the session between two steps (or, if idle, take its slot)."""
        p = Pause()
        slot.pause_req = p
        while True:
            if p.paused.wait(0.002):
                return p
            if slot.lock.acquire(blocking=False):
                slot.pause_req = None
                p.idle = True
                return p

    def unpause(self, slot: Slot, p: Pause) -> None:
        if p.idle:
            slot.lock.release()
        else:
            slot.pause_req = None
            p.resume.set()

    def migrate_out(self, sid: str, slot: Slot, t: MigrationTicket) -> None:
        """Move a session: pre-copy stages while it keeps generating (live), then a
        short pause for the last delta and the small state; or stop-and-copy."""
        s = self.host.get(sid)
        t0 = time.perf_counter()
        sn = ck.Snapshotter(s, t.mode)
        def progress() -> None:
            t.progress.put(pb.MigrateProgress(
                bytes_sent=link.bytes, frames_sent=link.acked, frames_total=len(link.frames),
                target=t.target, seconds=time.perf_counter() - t0, raw_kv_bytes=sn.raw_kv_bytes,
                tokens=len(s.history)))

        link = _Link(self, t, s, sid, on_ack=progress)
        pause = None
        try:
            link.send([sn.header()])
            if t.live and sn.incremental:
                chunk = max(16, PRECOPY_CHUNK // max(1, sn.kv_bytes_per_token() // len(s.cache)))
                for _ in range(t.max_stages):  # pre-copy: the session keeps generating
                    with self.host.compute:
                        upto = len(s.history)
                    sn.rate = t.rate or precopy_rate(s)
                    # short holds of the compute lock to copy, encoding outside them;
                    # each frame goes out as soon as it is encoded
                    link.send(sn.encode(sn.extract(upto, lock=self.host.compute, chunk=chunk)))
                    if len(s.history) - sn.sent_tokens < t.final_delta:
                        break
            sn.rate = 0.0
            pause = self.pause(sid, slot)  # stop-and-copy, or the live final stage
            t_pause = time.perf_counter()
            link.send(list(sn.finish()))
            link.wait_restored()
            link.commit()
            pause.committed, pause.target = True, t.target
            with self._lock:
                self.moved[sid] = t.target
                self.slots.pop(sid, None)
                self.feeds.pop(sid, None)
            t.pause_ms = (time.perf_counter() - t_pause) * 1000
            self.host.detach(sid)  # listed on the target only from now on
            self.unpause(slot, pause)  # the client's stream moves on to the target right away
            pause = None
            link.wait_running(RUNNING_WAIT)  # off the critical path: after the target's first token
            s.close()
            self._dir("move", sid, self.address, t.target)
        except grpc.RpcError as e:
            link.abort()
            raise MigrationError(f"migration to {t.target} failed: {e.details() or e.code().name}") from None
        except BaseException:
            link.abort()
            raise
        finally:
            link.close()
            if pause is not None:
                self.unpause(slot, pause)
        t.progress.put(pb.MigrateProgress(bytes_sent=link.bytes, frames_sent=len(link.frames),
                                          frames_total=len(link.frames), done=True, target=t.target,
                                          seconds=time.perf_counter() - t0, raw_kv_bytes=sn.raw_kv_bytes,
                                          tokens=len(s.history), pause_ms=t.pause_ms))

    def run_ticket(self, sid: str, slot: Slot, t: MigrationTicket) -> None:
        try:
            self.migrate_out(sid, slot, t)
        except (KvferryError, CheckpointError) as e:
            t.error = str(e)
        except Exception as e:  # report, keep serving: the session stays here
            t.error = f"{type(e).__name__}: {e}"
        finally:
            slot.migrating = False
            t.progress.put(None)


class _Link:
    """The source's side of one Transfer stream: windowed sends, acks, resume
    from the target's last verified frame after a reconnect (same migration id)."""

    def __init__(self, srv: HostServer, t: MigrationTicket, s, sid: str, on_ack: Callable | None = None):
        self.srv, self.t, self.s, self.sid = srv, t, s, sid
        self.on_ack = on_ack
        self.mid = uuid.uuid4().hex
        self.frames: list[bytes] = []
        self.ends: list[int] = []  # bytes sent up to and including each frame
        self.acked = 0
        self.state = ""
        self.reqs: "queue.Queue[Any] | None" = None
        self.acks = None
        self.ch = None
        self._connect()

    def _connect(self) -> None:
        self.close()
        self.reqs = q = queue.Queue()

        def gen():
            while (m := q.get()) is not None:
                yield m
        self.ch = channel(self.t.target, self.srv.client_tls)
        stub = pbg.MigrationStub(self.ch)
        self.acks = stub.Transfer(gen(), metadata=auth_metadata(self.t.token or self.srv.token), timeout=600)
        q.put(pb.MigrationMessage(begin=pb.Begin(migration_id=self.mid, session_id=self.sid,
                                                 fingerprint=self.s.lm.fingerprint, source=self.srv.address)))
        ack = next(self.acks)
        self.acked, self.state = ack.next_seq, ack.state
        for seq in range(self.acked, len(self.frames)):  # resume: resend what was not verified
            q.put(pb.MigrationMessage(frame=pb.FramePart(seq=seq, data=self.frames[seq])))

    @property
    def bytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _next_ack(self) -> None:
        """Read one ack. On a dropped link, reconnect instead: the target's answer to
        the new Begin (its last verified frame, or that it already committed) counts."""
        try:
            ack = next(self.acks)
        except StopIteration:
            raise MigrationError(f"migration to {self.t.target} failed: the target closed the stream") from None
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            self._reconnect()
            return
        self.acked, self.state = ack.next_seq, ack.state
        if self.on_ack is not None:
            self.on_ack()

    def _reconnect(self) -> None:
        for attempt in range(3):
            time.sleep(0.2 * (attempt + 1))
            try:
                self._connect()  # resumes from the last verified frame
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == 2:
                    raise

    def send(self, frames: Iterable[bytes]) -> None:
        for f in frames:
            while self.acked < len(self.frames) and (
                    len(self.frames) - self.acked >= WINDOW_FRAMES
                    or self.bytes - (self.ends[self.acked - 1] if self.acked else 0) >= WINDOW_BYTES):
                self._next_ack()
            self.reqs.put(pb.MigrationMessage(frame=pb.FramePart(seq=len(self.frames), data=f)))
            self.frames.append(f)
            self.ends.append(self.bytes + len(f))

    def wait_running(self, timeout: float) -> None:
        """Best effort: until the target reports the landed turn's first token, the
        stream ends, or ``timeout`` passes (the session is the target's already)."""
        done = threading.Event()

        def read() -> None:
            try:
                while self.state != "running":
                    ack = next(self.acks)
                    self.state = ack.state
            except Exception:
                pass
            finally:
                done.set()
        threading.Thread(target=read, daemon=True, name="kvferry-running").start()
        done.wait(timeout)

    def wait_restored(self) -> None:
        while self.state != "restored":
            self._next_ack()

    def commit(self) -> None:
        self.reqs.put(pb.MigrationMessage(commit=pb.Empty()))
        while True:
            link = self.reqs
            self._next_ack()
            if self.state == "committed":
                return
            if self.reqs is not link and self.state == "restored":  # reconnected before it committed
                self.reqs.put(pb.MigrationMessage(commit=pb.Empty()))
                continue
            raise MigrationError(f"target answered '{self.state}' to commit")

    def abort(self) -> None:
        try:
            if self.reqs is not None:
                self.reqs.put(pb.MigrationMessage(abort=pb.Empty()))
        except Exception:
            pass

    def close(self) -> None:
        if self.reqs is not None:
            self.reqs.put(None)
        if self.ch is not None:
            self.ch.close()
        self.reqs = self.ch = None


def _abort(context, e: Exception) -> None:
    if isinstance(e, OutOfMemoryError):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if isinstance(e, UnknownSessionError):
        context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    if isinstance(e, ModelMismatchError):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    if isinstance(e, CheckpointError) and "checkpoint is for model" in str(e):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"model mismatch: {e}")
    if isinstance(e, (ConfigError, GuestError, CheckpointError)):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, MigrationError):
        context.abort(grpc.StatusCode.ABORTED, str(e))
    context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))


def _guarded(fn: Callable) -> Callable:
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except (KvferryError, CheckpointError, GuestTrap) as e:
            _abort(context, e)
    return wrapper


def _guarded_stream(fn: Callable) -> Callable:
    def wrapper(self, request, context):
        try:
            yield from fn(self, request, context)
        except (KvferryError, CheckpointError, GuestTrap) as e:
            _abort(context, e)
    return wrapper


class _Sessions(pbg.SessionsServicer):
    def __init__(self, srv: HostServer):
        self.srv = srv

    @_guarded
    def Health(self, request, context):
        import runtime

        h = self.srv.host
        return pb.HealthReply(status="ok", address=self.srv.address, model=h.lm.name,
                              fingerprint=h.lm.fingerprint, sessions=len(h.sessions),
                              version=runtime.__version__, node=self.srv.node)

    @_guarded
    def CreateSession(self, r, context):
        h = self.srv.host
        if r.model and r.model not in (h.lm.name, str(h.lm.path)):
            raise ModelMismatchError(f"model mismatch: this host serves '{h.lm.name}', not '{r.model}'")
        sp = r.sampling
        sampling = SamplingParams(temperature=sp.temperature, top_p=sp.top_p or 1.0, top_k=sp.top_k,
                                  max_tokens=sp.max_tokens or 256, seed=sp.seed, stop=tuple(sp.stop),
                                  ignore_eos=sp.ignore_eos) if r.HasField("sampling") else SamplingParams()
        o = r.options
        options = SessionOptions(ctx=o.ctx or None, prefill_step=o.prefill_step or 512,
                                 kv_bits=o.kv_bits or None, deadline_ms=o.deadline_ms or 5000.0)
        guest = h.engine.compile(r.guest_wasm, "client.wasm") if r.guest_wasm else None
        if guest is not None and guest.kind != "chat":
            raise GuestError("client.wasm: not a chat guest")
        s = h.create_session(guest, sampling, options, r.session_id or None)
        if r.system:
            s.messages.append({"role": "system", "content": r.system})
        self.srv._dir("register_session", s.id, self.srv.address)
        return self.srv.info(s)

    @_guarded_stream
    def Send(self, r, context):
        srv = self.srv
        if r.session_id in srv.moved:  # index -1: nothing ran here, send the same request there
            yield pb.TokenChunk(index=-1, token=-1, moved_to=srv.moved[r.session_id])
            return
        feed = srv.feeds.get(r.session_id)
        if r.continue_turn and feed is not None:
            yield from self._follow(feed, r.from_index, context)
            return
        slot = srv.slot(r.session_id)
        if not slot.lock.acquire(timeout=60):
            raise SessionError(f"session {r.session_id} is busy (a turn or migration is in progress)")
        try:
            if r.session_id in srv.moved:  # it left while we waited for the lock
                yield pb.TokenChunk(index=-1, token=-1, moved_to=srv.moved[r.session_id])
                return
            srv.feeds.pop(r.session_id, None)  # a new request: a driven turn's chunks are history
            s = srv.host.get(r.session_id)
            events = s.continue_turn(r.from_index) if r.continue_turn else \
                s.send(r.text, r.role or "user", max_tokens=r.max_tokens)
            yield from srv.run_turn(s, slot, events, context.is_active)
        finally:
            slot.lock.release()

    @staticmethod
    def _follow(feed: TurnFeed, from_index: int, context) -> Iterator[pb.TokenChunk]:
        for j in range(max(0, from_index), len(feed.earlier)):
            yield pb.TokenChunk(index=j, token=feed.earlier[j][0], text=feed.earlier[j][1])
        i = 0
        while True:
            with feed.cond:
                while i >= len(feed.chunks) and not feed.done:
                    feed.cond.wait(0.5)
                    if not context.is_active():
                        return
                batch, done = feed.chunks[i:], feed.done
            i += len(batch)
            for c in batch:
                if c.token < 0 or c.index >= from_index:
                    yield c
            if done and i >= len(feed.chunks):
                return

    @_guarded_stream
    def Snapshot(self, r, context):
        slot = self.srv.slot(r.session_id)
        if not slot.lock.acquire(timeout=30):
            raise SessionError(f"session {r.session_id} is busy")
        try:
            s = self.srv.host.get(r.session_id)
            for chunk in ck.snapshot(s, r.mode or "lossless"):
                yield pb.CheckpointChunk(data=chunk)
        finally:
            slot.lock.release()

    def Restore(self, request_iterator, context):
        try:
            new_id = dict(context.invocation_metadata()).get("kvferry-session-id") or None
            s = ck.restore(self.srv.host, (c.data for c in request_iterator), session_id=new_id)
            self.srv._dir("register_session", s.id, self.srv.address)
            return self.srv.info(s)
        except (KvferryError, CheckpointError) as e:
            _abort(context, e)

    @_guarded_stream
    def Migrate(self, r, context):
        srv = self.srv
        if r.target == srv.address:
            raise ConfigError(f"session {r.session_id} is already on {r.target}")
        if not 0 <= r.rate_mb_s < 1e6:
            raise ConfigError(f"rate_mb_s must be between 0 and 1e6 MB/s, not {r.rate_mb_s}")
        slot = srv.slot(r.session_id)
        with srv._lock:
            if slot.migrating:
                raise SessionError(f"session {r.session_id}: a migration is already in progress")
            slot.migrating = True
        t = MigrationTicket(r.target, r.target_token or None, r.mode or "raw", live=r.live,
                            rate=r.rate_mb_s * 1e6)
        threading.Thread(target=srv.run_ticket, args=(r.session_id, slot, t), daemon=True,
                         name=f"migrate-{r.session_id}").start()
        while (p := t.progress.get()) is not None:
            yield p
        if t.error:
            raise MigrationError(t.error)

    @_guarded
    def Close(self, r, context):
        srv = self.srv
        slot = srv.slot(r.session_id)
        if (feed := srv.feeds.pop(r.session_id, None)) is not None:
            feed.cancel = True
        if not slot.lock.acquire(timeout=30):
            raise SessionError(f"session {r.session_id} is busy")
        try:
            srv.host.close_session(r.session_id)
            with srv._lock:
                srv.slots.pop(r.session_id, None)
        finally:
            slot.lock.release()
        srv._dir("forget_session", r.session_id)
        return pb.Empty()

    @_guarded
    def ListSessions(self, r, context):
        return pb.SessionList(sessions=[self.srv.info(s) for s in list(self.srv.host.sessions.values())])

    @_guarded
    def ListHosts(self, r, context):
        hosts = self.srv._dir("hosts")
        if not hosts:
            h = self.srv.host
            return pb.HostList(hosts=[pb.HostInfo(address=self.srv.address, model=h.lm.name,
                                                  sessions=len(h.sessions), healthy=True,
                                                  node=self.srv.node, last_seen=time.time())])
        return pb.HostList(hosts=[pb.HostInfo(**x) for x in hosts])


class _Migration(pbg.MigrationServicer):
    """Target side: verify frames as they come, restore, commit on request."""

    def __init__(self, srv: HostServer):
        self.srv = srv

    def Transfer(self, request_iterator, context):
        srv = self.srv
        inc: Incoming | None = None
        acked_seq, unacked = 0, 0
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "begin":
                    b = msg.begin
                    if b.fingerprint != srv.host.lm.fingerprint:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"model mismatch: the target serves '{srv.host.lm.name}' "
                                      f"({srv.host.lm.fingerprint[:12]}…), the session's model differs")
                    if b.migration_id in srv.committed:  # the link dropped after our commit ack
                        yield pb.MigrationAck(state="committed", next_seq=0, session_id=b.session_id)
                        yield pb.MigrationAck(state="running", next_seq=0, session_id=b.session_id)
                        continue
                    with srv._lock:
                        inc = srv.incoming.get(b.migration_id)
                        if inc is None:
                            if b.session_id in srv.host.sessions:
                                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                              f"session {b.session_id} already exists on the target")
                            inc = Incoming(b.session_id, ck.Restorer(srv.host, session_id=b.session_id))
                            srv.incoming[b.migration_id] = inc
                        mid = b.migration_id
                    acked_seq, unacked = inc.next_seq, 0
                    yield pb.MigrationAck(state="ready" if inc.prepared is None else "restored",
                                          next_seq=inc.next_seq, session_id=inc.session_id)
                elif kind == "frame":
                    if inc is None:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "frame before begin")
                    f = msg.frame
                    if f.seq < inc.next_seq:
                        continue  # a resend after reconnect: already verified
                    if f.seq > inc.next_seq:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"frame {f.seq} arrived, expected {inc.next_seq}")
                    for fr in inc.decoder.feed(f.data):
                        inc.restorer.apply(fr)
                    inc.next_seq += 1
                    unacked += len(f.data)
                    if inc.decoder.done and inc.prepared is None:
                        inc.prepared = inc.restorer.commit(register=False)
                        yield pb.MigrationAck(state="restored", next_seq=inc.next_seq,
                                              session_id=inc.session_id)
                    elif inc.next_seq - acked_seq >= ACK_EVERY_FRAMES or unacked >= ACK_EVERY_BYTES:
                        # coalesced acks (below the source's window, so it never starves)
                        yield pb.MigrationAck(state="ack", next_seq=inc.next_seq, session_id=inc.session_id)
                    else:
                        continue
                    acked_seq, unacked = inc.next_seq, 0
                elif kind == "commit":
                    if inc is None or inc.prepared is None:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "commit before a verified restore")
                    with srv.host.lock:
                        if inc.session_id in srv.host.sessions:
                            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                          f"session {inc.session_id} already exists on the target")
                        srv.host.sessions[inc.session_id] = inc.prepared
                    with srv._lock:
                        srv.incoming.pop(mid, None)
                        srv.moved.pop(inc.session_id, None)
                        srv.committed[mid] = time.monotonic()
                        feed = None
                        if inc.prepared.turn is not None:  # it moved mid-reply: generate on now
                            slot = srv.slots.setdefault(inc.session_id, Slot())
                            slot.lock.acquire()
                            t = inc.prepared.turn
                            feed = srv.feeds[inc.session_id] = TurnFeed(earlier=list(zip(t.tokens, t.texts)))
                            srv.executor.submit(srv.drive, inc.session_id, slot, feed)
                    yield pb.MigrationAck(state="committed", next_seq=inc.next_seq, session_id=inc.session_id)
                    # Bookkeeping waits for the landed turn's first token: on a shared
                    # machine it would slow the step the client is waiting for.
                    if feed is not None:
                        feed.wait_started(RUNNING_WAIT)
                    srv._dir("register_session", inc.session_id, srv.address)
                    yield pb.MigrationAck(state="running", next_seq=inc.next_seq, session_id=inc.session_id)
                    inc = None
                elif kind == "abort":
                    with srv._lock:
                        srv.incoming.pop(mid, None)
                    if inc is not None and inc.prepared is not None:
                        inc.prepared.close()
                    inc = None
        except (CheckpointError, KvferryError) as e:
            if inc is not None:
                with srv._lock:
                    srv.incoming = {k: v for k, v in srv.incoming.items() if v is not inc}
            _abort(context, e)

