"""The gRPC face of a model host: client sessions and host-to-host migration.

One :class:`HostServer` wraps a :class:`kvferry.host.ModelHost` and serves
``kvferry.v1.Sessions`` and ``kvferry.v1.Migration`` on one port. Inside a Ray
cluster the server runs in a ``SessionHost`` actor and reports to the
controller's session directory; it also runs standalone.

The rooms: transport and auth (:mod:`kvferry.transport`), turn driving and step
boundaries (:mod:`kvferry.slots`), migration out (:mod:`kvferry.migration_out`)
and in (:mod:`kvferry.migration_in`). This module only relays requests to them.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from . import addresses
from .checkpoint import host_blocks
from .checkpoint.snapshot import snapshot
from .drain import DRAIN_TIMEOUT, Drainer
from .errors import (ConfigError, ForbiddenError, GuestError, HostDrainingError, InternalError, KvferryError,
                     ModelMismatchError, SessionBusyError, UnknownSessionError)
from .handoff_trace import mark
from .keys import NOBODY, CallQuota, Key, Keyring
from .host import ModelHost
from .migration_in import Incoming, MigrationTarget, expire
from .migration_lane import LaneListener
from .migration_out import MigrationSource, MigrationTicket
from .params import MIGRATE_DEFAULTS, MIGRATE_MODES, SAMPLING, SamplingParams, SessionOptions
from .paths import home
from .policy import HostPolicy
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .slots import Slot, TurnDriver, TurnFeed
from .stream_chunks import coalesce
from .transport import AuthInterceptor, TLSConfig, abort, grpc_options, is_loopback

JANITOR_S = 5.0  # s between sweeps of idle sessions, idle incoming migrations and old redirects
log = logging.getLogger("kvferry.server")
MAX_GUEST_WASM = 16 << 20  # bytes of an uploaded guest module (the bundled chat guest is ~40 KB)


def _params(r: pb.CreateRequest, policy: HostPolicy) -> tuple[SamplingParams, SessionOptions]:
    """A CreateRequest's sampling and options; proto3 zeros mean "the default" (never
    over the host's limits); what a client asks for explicitly is checked against them."""
    sp, o = r.sampling, r.options
    max_tokens = sp.max_tokens or min(SAMPLING.max_tokens, policy.max_tokens)
    sampling = SamplingParams(temperature=sp.temperature, top_p=sp.top_p or SAMPLING.top_p, top_k=sp.top_k,
                              max_tokens=max_tokens, seed=sp.seed, stop=tuple(sp.stop),
                              ignore_eos=sp.ignore_eos) if r.HasField("sampling") else \
        SamplingParams(max_tokens=max_tokens)
    d = SessionOptions()
    options = SessionOptions(ctx=o.ctx or d.ctx, prefill_step=o.prefill_step or d.prefill_step,
                             kv_bits=o.kv_bits or d.kv_bits,
                             deadline_ms=o.deadline_ms or min(d.deadline_ms, policy.max_deadline_ms))
    policy.check(sampling, options)
    return sampling, options


class HostServer(TurnDriver, MigrationSource, Drainer):
    """Serves one ModelHost over gRPC."""

    def __init__(self, host: ModelHost, bind: str = "127.0.0.1:0", *, token: str | None = None,
                 tls: TLSConfig | None = None, client_tls: TLSConfig | None = None,
                 directory: Any = None, node: str | None = None, allow_no_auth: bool = False,
                 advertise: str | None = None, peers: tuple[str, ...] = (), drain_dir: str | None = None,
                 drain_timeout: float = DRAIN_TIMEOUT, keys: Keyring | None = None, lane_port: int | None = 0):
        """``advertise``: the HOST:PORT clients and peers dial (default: see
        kvferry.addresses); ``peers``: the hosts this one may hand sessions to;
        ``drain_dir``: where a drain saves what no peer takes ("": under
        $KVFERRY_HOME/drain/, per address; None: nowhere); ``lane_port``: where
        incoming migrations' KV frames may come on a socket of their own
        (kvferry.migration_lane; 0: a free port; None: no lane, all on the stream)."""
        h, _, _ = bind.rpartition(":")
        if keys is None and token is not None:
            keys = Keyring({token: Key("admin", "admin")})
        if keys is None and not (allow_no_auth and is_loopback(h)):
            raise ConfigError("refusing to serve without a token (set --token, or --no-auth on a "
                              "loopback address)")
        self.host = host
        self.keys = keys
        self.token = keys.outgoing() if keys is not None else None  # what it dials its peers with
        self.tls = tls
        self.client_tls = client_tls  # for outgoing migration connections
        self.peers = tuple(peers)
        self.directory = directory  # a Ray controller handle (or None)
        self.node = node or socket.gethostname()
        self.slots: dict[str, Slot] = {}
        self.moved: dict[str, tuple[str, float]] = {}  # session id -> (where it went, when)
        self.incoming: dict[str, Incoming] = {}
        self.feeds: dict[str, TurnFeed] = {}
        self.committed: dict[str, float] = {}  # migration id -> when (answers a re-sent Begin or commit)
        self.aborted: dict[str, float] = {}  # migration id -> when it was abandoned (never committed after)
        self.registry_lock = threading.Lock()
        policy = host.policy
        self.quota = CallQuota(policy.calls_per_key)  # client keys' calls, gRPC and HTTP together
        self.executor = futures.ThreadPoolExecutor(max_workers=policy.max_concurrent_rpcs + 8,
                                                   thread_name_prefix="kvferry-rpc")
        # landed turns generate on their own threads: a flood of calls cannot starve them
        self.drivers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvferry-drive")
        # accept the clients' 20 s keepalive pings during long calls (a prefill of
        # thousands of tokens on a CPU), instead of answering GOAWAY too_many_pings
        options = grpc_options() + [("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
                                    ("grpc.http2.max_ping_strikes", 0),
                                    ("grpc.keepalive_permit_without_calls", 1)]
        self.server = grpc.server(self.executor, options=options, interceptors=[AuthInterceptor(keys, self.quota)],
                                  maximum_concurrent_rpcs=policy.max_concurrent_rpcs)
        pbg.add_SessionsServicer_to_server(_Sessions(self), self.server)
        MigrationTarget(self).add_to_server(self.server)
        # grpc.health.v1 for load balancers and probes (no token: it tells only the status)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            if tls is not None and tls.cert:
                port = self.server.add_secure_port(bind, tls.server_credentials())
            else:
                port = self.server.add_insecure_port(bind)
        except RuntimeError:  # newer grpcio raises where older ones answered port 0
            port = 0
        if port == 0:
            raise ConfigError(f"cannot bind {bind} (an address of this machine, and a port free to take?)")
        if advertise:
            addresses.split(advertise)  # HOST:PORT, or a one-line error
        self.address = advertise or addresses.advertise(h or "127.0.0.1", port, self.peers)
        try:
            self.lane = None if lane_port is None else LaneListener(h, lane_port, tls)
        except OSError as e:
            self.server.stop(0)
            raise ConfigError(f"cannot listen for migration lanes on {addresses.join(h or '0.0.0.0', lane_port)}: "
                              f"{e.strerror or e}") from None
        self.draining = False
        self.drain_timeout = drain_timeout
        self.finished = threading.Event()  # a drain asked the host to stop
        self.drain_dir = None if drain_dir is None else Path(drain_dir) if drain_dir else \
            home() / "drain" / self.address.replace(":", "_").replace("[", "").replace("]", "")
        self.restored: list[dict] = []

    def start(self) -> "HostServer":
        self.server.start()
        self.restored = self.restore_drained()  # sessions a drain of this host saved
        self.set_serving(True)
        threading.Thread(target=self._janitor, daemon=True, name="kvferry-janitor").start()
        threading.Thread(target=host_blocks.warm, daemon=True, name="kvferry-host-blocks").start()
        return self

    def caller(self, context) -> Key:
        """The key a call came with (the interceptor has let only known keys through)."""
        if self.keys is None:
            return NOBODY
        return self.keys.lookup(dict(context.invocation_metadata()).get("authorization", "")) or Key("?", "client")

    def check_owner(self, sid: str, key: Key) -> None:
        """A client key sees only its own sessions: another's answers as unknown."""
        s = self.host.sessions.get(sid)
        if s is not None and not key.admin and s.owner != key.name:
            raise UnknownSessionError(f"unknown session '{sid}'")

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise HostDrainingError(f"{self.address} is draining: it takes no new sessions")

    def set_serving(self, serving: bool) -> None:
        """What grpc.health.v1 answers, for the server and each kvferry service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "kvferry.v1.Sessions", "kvferry.v1.Migration"):
            self.health.set(service, status)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.lane is not None:
            self.lane.close()
        # join the RPC threads now: threads that ran MLX work must not be torn down
        # at interpreter exit (their thread-local MLX state would abort the process)
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.drivers.shutdown(wait=True, cancel_futures=True)

    def _janitor(self) -> None:
        while True:
            time.sleep(JANITOR_S)
            now = time.monotonic()
            expire(self, now)
            self.forget_moves(now)
            for sid in self.expire_idle(now):
                log.info("session %s: closed after %g s idle (serve --session-ttl)", sid,
                         self.host.policy.session_ttl_s)


def _aborted(context) -> bool:
    """Whether the call already has its status: grpc's ``context.abort`` sets it, then
    raises a bare Exception (read from grpc's servicer context, which keeps it there)."""
    return bool(getattr(getattr(context, "_state", None), "aborted", False))


def _internal(fn: Callable, e: Exception) -> InternalError:
    """A bug's exception, logged whole here; the caller gets one line."""
    log.error("internal error in %s", fn.__name__, exc_info=e)
    return InternalError(f"internal error in {fn.__name__} ({type(e).__name__}: {e}); the host's log has the "
                         "traceback")


def _end_call(fn: Callable, context, e: Exception) -> None:
    """A KvferryError ends the call with its status and code (one line); anything else
    is a bug: logged with its traceback, and reported as ``internal`` (unless the call
    already has its status: grpc's abort raises after setting it)."""
    if isinstance(e, KvferryError):
        abort(context, e)
    if _aborted(context):
        raise e
    abort(context, _internal(fn, e))


def _guarded(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001 (a bug too: the caller still gets one line)
            _end_call(fn, context, e)
    return wrapper


def _guarded_stream(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            yield from fn(self, request, context)
        except Exception as e:  # noqa: BLE001
            _end_call(fn, context, e)
    return wrapper


class _Sessions(pbg.SessionsServicer):
    def __init__(self, srv: HostServer):
        self.srv = srv

    @_guarded
    def Health(self, request, context):
        from . import __version__

        h = self.srv.host
        return pb.HealthReply(status="ok", address=self.srv.address, model=h.lm.name,
                              fingerprint=h.lm.fingerprint, sessions=len(h.sessions),
                              version=__version__, node=self.srv.node, device=str(h.device),
                              dtype=h.lm.dtype, weights=h.lm.weights)

    @_guarded
    def CreateSession(self, r, context):
        h = self.srv.host
        if r.model and r.model not in (h.lm.name, str(h.lm.path)):
            raise ModelMismatchError(f"model mismatch: this host serves '{h.lm.name}', not '{r.model}'")
        self.srv.refuse_if_draining()
        sampling, options = _params(r, h.policy)
        if len(r.guest_wasm) > MAX_GUEST_WASM:
            raise GuestError(f"client.wasm: {len(r.guest_wasm)} bytes, over the {MAX_GUEST_WASM >> 20} MiB a guest may be")
        guest = h.engine.compile(r.guest_wasm, "client.wasm") if r.guest_wasm else None
        if guest is not None and guest.kind != "chat":
            raise GuestError("client.wasm: not a chat guest")
        s = h.create_session(guest, sampling, options, r.session_id or None, owner=self.srv.caller(context).name)
        self.srv.arrived(s.id)
        log.info("session %s created (key %s, guest %s)", s.id, s.owner or "-", s.guest.module.label)
        if r.system:
            s.messages.append({"role": "system", "content": r.system})
        self.srv.tell_directory("register_session", s.id, self.srv.address)
        return self.srv.info(s)

    @_guarded_stream
    def Send(self, r, context):
        srv = self.srv
        srv.check_owner(r.session_id, srv.caller(context))
        if (to := srv.where(r.session_id)) is not None and r.session_id not in srv.host.sessions:
            yield pb.TokenChunk(index=-1, token=-1, moved_to=to)  # index -1: nothing ran here, resend there
            return
        per_message = min(srv.host.policy.stream_interval, max(1, r.chunk_tokens))  # kvferry.stream_chunks
        feed = srv.feeds.get(r.session_id)
        if r.continue_turn and feed is not None:
            mark("target_followed", r.session_id)
            yield from coalesce(self._follow(feed, r.from_index, context), per_message)
            return
        slot = srv.slot(r.session_id)
        if not slot.lock.acquire(timeout=60):
            raise SessionBusyError(f"session {r.session_id} is busy (a turn or migration is in progress)")
        try:
            if (to := srv.where(r.session_id)) is not None and r.session_id not in srv.host.sessions:
                yield pb.TokenChunk(index=-1, token=-1, moved_to=to)  # it left while we waited for the lock
                return
            srv.feeds.pop(r.session_id, None)  # a new request: a driven turn's chunks are history
            s = srv.host.get(r.session_id)
            events = s.continue_turn(r.from_index) if r.continue_turn else \
                s.send(r.text, r.role or "user", max_tokens=r.max_tokens)
            yield from coalesce(srv.run_turn(s, slot, events, context.is_active), per_message)
        finally:
            slot.lock.release()

    def _follow(self, feed: TurnFeed, from_index: int, context) -> Iterator[pb.TokenChunk]:
        for j in range(max(0, from_index), len(feed.earlier)):
            yield pb.TokenChunk(index=j, token=feed.earlier[j][0], text=feed.earlier[j][1])
        i = 0
        idle = self.srv.host.policy.stream_idle_s
        while True:
            with feed.cond:
                quiet = time.monotonic()
                while i >= len(feed.chunks) and not feed.done:
                    feed.read_at = time.monotonic()  # followed: the host keeps generating it
                    feed.cond.wait(0.5)
                    if not context.is_active() or time.monotonic() - quiet > idle:
                        return
                feed.read_at = time.monotonic()
                batch, done = feed.chunks[i:], feed.done
            i += len(batch)
            for c in batch:
                if c.token < 0 or c.index >= from_index:
                    yield c
            if done and i >= len(feed.chunks):
                return

    @_guarded_stream
    def Snapshot(self, r, context):
        self.srv.check_owner(r.session_id, self.srv.caller(context))
        slot = self.srv.slot(r.session_id)
        if not slot.lock.acquire(timeout=30):
            raise SessionBusyError(f"session {r.session_id} is busy")
        try:
            s = self.srv.host.get(r.session_id)
            for chunk in snapshot(s, r.mode or "lossless"):
                yield pb.CheckpointChunk(data=chunk)
        finally:
            slot.lock.release()

    @_guarded
    def Restore(self, request_iterator, context):
        self.srv.refuse_if_draining()
        new_id = dict(context.invocation_metadata()).get("kvferry-session-id") or None
        s = self.srv.host.restore((c.data for c in request_iterator), session_id=new_id,
                                  owner=self.srv.caller(context).name)  # the caller's, whatever the file says
        self.srv.arrived(s.id)
        self.srv.tell_directory("register_session", s.id, self.srv.address)
        return self.srv.info(s)

    @_guarded_stream
    def Migrate(self, r, context):
        srv = self.srv
        srv.check_owner(r.session_id, srv.caller(context))
        if not 0 <= r.rate_mb_s < 1e6:
            raise ConfigError(f"rate_mb_s must be between 0 and 1e6 MB/s, not {r.rate_mb_s}")
        slot = srv.slot(r.session_id)  # here, or a redirect to where it went
        if r.target == srv.address:
            raise ConfigError(f"session {r.session_id} is already on {r.target}")
        srv.check_target(r.target)
        with srv.registry_lock:
            if slot.migrating:
                raise SessionBusyError(f"session {r.session_id}: a migration is already in progress")
            slot.migrating = True
        mode = r.mode or MIGRATE_DEFAULTS["mode"]
        if mode not in MIGRATE_MODES:
            raise ConfigError(f"unknown migration mode '{mode}' (choose from {', '.join(MIGRATE_MODES)})")
        t = MigrationTicket(r.target, r.target_token or None, mode, live=r.live, allow_lossy=r.allow_lossy,
                            rate=r.rate_mb_s * 1e6, lane=not r.stream_only)
        threading.Thread(target=srv.run_ticket, args=(r.session_id, slot, t), daemon=True,
                         name=f"migrate-{r.session_id}").start()
        while (p := t.progress.get()) is not None:
            yield p
        if t.error:
            raise t.error

    @_guarded
    def Close(self, r, context):
        srv = self.srv
        srv.check_owner(r.session_id, srv.caller(context))
        slot = srv.slot(r.session_id)
        if (feed := srv.feeds.pop(r.session_id, None)) is not None:
            feed.cancel = True  # its follower hears why the reply ends here, not a silent cut
            feed.put(pb.TokenChunk(index=-1, token=-1, finish_reason="error",
                                   text=f"session {r.session_id} was closed while its reply was generated"))
        if not slot.lock.acquire(timeout=30):
            raise SessionBusyError(f"session {r.session_id} is busy")
        try:
            srv.host.close_session(r.session_id)
            with srv.registry_lock:
                srv.slots.pop(r.session_id, None)
        finally:
            slot.lock.release()
        srv.tell_directory("forget_session", r.session_id)
        return pb.Empty()

    @_guarded
    def Drain(self, r, context):
        srv = self.srv
        if not (key := srv.caller(context)).admin:
            raise ForbiddenError(f"key '{key.name}' may not drain this host (an admin key may)")
        out = srv.drain(r.timeout_s or srv.drain_timeout)
        if r.exit:
            srv.finished.set()
        return pb.DrainReply(sessions=[pb.DrainOutcome(session_id=o["session"], outcome=o["outcome"],
                                                       where=o["where"], error=o["error"]) for o in out])

    @_guarded
    def Info(self, r, context):
        self.srv.check_owner(r.session_id, self.srv.caller(context))
        self.srv.slot(r.session_id)  # unknown, or moved: a redirect
        return self.srv.info(self.srv.host.get(r.session_id))

    @_guarded
    def ListSessions(self, r, context):
        key = self.srv.caller(context)
        return pb.SessionList(sessions=[self.srv.info(s) for s in list(self.srv.host.sessions.values())
                                        if key.admin or s.owner == key.name])

    @_guarded
    def ListHosts(self, r, context):
        hosts = self.srv.tell_directory("hosts")
        if not hosts:
            h = self.srv.host
            return pb.HostList(hosts=[pb.HostInfo(address=self.srv.address, model=h.lm.name,
                                                  sessions=len(h.sessions), healthy=True,
                                                  node=self.srv.node, last_seen=time.time())])
        return pb.HostList(hosts=[pb.HostInfo(**x) for x in hosts])
