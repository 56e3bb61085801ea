"""Migration, source side: pre-copy while the session generates, pause it at a
step boundary for the last delta and the small state, commit, hand the client
over (or stop-and-copy). :class:`_Link` is one Transfer stream to the target:
windowed frames, coalesced acks, and a resume from the target's last verified
frame after a reconnect (same migration id)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import grpc

from . import addresses
from .checkpoint.snapshot import Snapshotter
from .errors import (CODES, AuthError, ForbiddenError, HostDownError, KvferryError, MigrationError, RemoteError,
                     UnknownSessionError)
from .linkaware import PROBE_BYTES, SAMPLE_BYTES, choose, codec_costs
from .migration_in import ACK_EVERY_BYTES, ACK_EVERY_FRAMES
from .migration_lane import LaneWriter
from .migration_wire import frame_message, write_message
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .slots import Slot
from .transport import ERROR_KEY, MIGRATION_SERVICE, auth_metadata, channel, translate

log = logging.getLogger("kvferry.migration")

WINDOW_FRAMES = 256  # unacknowledged checkpoint frames in flight ...
WINDOW_BYTES = 32 << 20  # ... and bytes: big KV frames are paced, small final ones are not
IN_DOUBT_S = 30.0  # s: how long a source asks a silent target about a sent commit before it says so
RUNNING_WAIT = 5.0  # s: how long a source keeps a moved session's memory for the target's first token
PRECOPY_STEP_BYTES = 3 << 20  # live pre-copy default: ~3 MB of KV per step of the generating session
PRECOPY_RATE = 40e6  # ... and 40 MB/s while it is not generating
PRECOPY_MAX = {"cpu": 80e6, "gpu": 1e9}  # pace cap: a CPU's generation shares its memory bandwidth
PRECOPY_CHUNK = 3 << 19  # pre-copy frames carry ~1.5 MB of one layer's KV (a token range)
LANE_TRIES = 2  # lanes a migration opens at most (a failed one, then the stream only)
LANE_GRACE_S = 1.0  # s a broken lane waits for the stream's own word before it counts as a dropped link


def precopy_rate(s, device: str = "cpu") -> float:
    """Live pre-copy pace when the caller set none: about PRECOPY_STEP_BYTES per
    decode step of the session, so each step is disturbed alike at any context
    (measured on a shared 2-core machine: at 8k tokens, ~3 MB per step left the
    worst pre-copy gap under the handoff's; ~6 MB per step, i.e. 40 MB/s, made
    it 47-95 ms), within 5-80 MB/s (on a GPU, whose steps do not share the CPU's
    memory bandwidth, up to 1 GB/s: a 6 ms step at 8k tokens would otherwise
    outlast a reply); PRECOPY_RATE while it is not generating."""
    if s.turn is None or not s.step_seconds:
        return PRECOPY_RATE
    return min(max(PRECOPY_STEP_BYTES / s.step_seconds, 5e6), PRECOPY_MAX.get(device, PRECOPY_MAX["cpu"]))


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
    error: KvferryError | None = None
    pause_ms: float = 0.0
    fenced: bool = False  # a commit in doubt: the session waits, paused, for the target's answer
    allow_lossy: bool = False  # mode auto may pick int8
    choice: Any = None  # mode auto: what it measured and chose (kvferry.linkaware.Choice)
    phases_ms: dict = field(default_factory=dict)  # where the migration's time went (MigrateProgress)
    transfer_mb_s: float = 0.0
    lane: bool = True  # ask the target for a lane for the KV frames (kvferry.migration_lane)


class InDoubt(Exception):
    """The commit was sent and neither "committed" nor a refusal came back."""


def _coded(e: grpc.RpcError) -> bool:
    """The target itself refused (its error code came back): a definite answer."""
    try:
        return any(k == ERROR_KEY for k, _ in (e.trailing_metadata() or ()))
    except Exception:
        return False


def target_refused(e: grpc.RpcError, target: str) -> KvferryError:
    """The target's refusal for our client: the class its code names (a model
    mismatch or a full host stays one), else MigrationError. Either way the
    session stays here."""
    cls = CODES.get(translate(e, target).code)
    if cls is None or cls in (KvferryError, RemoteError, AuthError, HostDownError):
        cls = MigrationError
    if not _coded(e):  # the transport's own words would map the network for the caller
        return cls(f"migration to {target} failed: the target did not answer ({e.code().name.lower()})")
    return cls(f"migration to {target} failed: {e.details() or e.code().name.lower()}")


class MigrationSource:
    """Mixin of :class:`kvferry.server.HostServer`: moving its sessions out."""

    def check_target(self, target: str) -> None:
        """A client may move a session only to this host's peers (``serve --peers``,
        else the cluster directory's hosts): the host dials out with its own
        credentials, so an arbitrary address would make it a probe of the network."""
        if target not in self.peer_hosts(healthy=False):
            raise ForbiddenError(f"migration to {target} refused: not a peer of this host "
                                 f"(serve --peers, or a host of its cluster)")
        if self.tls is not None and self.tls.cert and self.client_tls is None:
            raise ForbiddenError("migration refused: this host serves TLS, so it sends sessions only over "
                                 "TLS (serve --peer-tls-ca)")

    def migrate_out(self, sid: str, slot: Slot, t: MigrationTicket) -> None:
        """Move a session: pre-copy stages while it keeps generating (live), then a
        short pause for the last delta and the small state; or stop-and-copy."""
        s = self.host.get(sid)
        t0 = time.perf_counter()
        sn = Snapshotter(s, "raw" if t.mode == "auto" else t.mode)
        def progress() -> None:
            t.progress.put(pb.MigrateProgress(
                bytes_sent=link.bytes, frames_sent=link.acked, frames_total=len(link.frames),
                target=t.target, seconds=time.perf_counter() - t0, raw_kv_bytes=sn.raw_kv_bytes,
                tokens=len(s.history)))

        link = pause = None
        m = self.host.metrics
        m.migrations.labels("started").inc()
        try:
            link = _Link(self, t, s, sid, on_ack=progress)
            link.send([sn.header()])
            chunk = sn.chunk_tokens(PRECOPY_CHUNK)
            if t.mode == "auto":
                t.choice = self._probe_link(s, sn, link, t, chunk)
            if t.live and sn.incremental:
                for _ in range(t.max_stages):  # pre-copy: the session keeps generating
                    with self.host.compute:
                        upto = len(s.history)
                    sn.rate = t.rate or precopy_rate(s, self.host.device.kind)
                    # short holds of the compute lock to copy, encoding outside them;
                    # each frame goes out as soon as it is encoded
                    link.send(sn.encode(sn.extract(upto, lock=self.host.compute, chunk=chunk)))
                    # the target lands what it was sent before the pause, not in it: a
                    # backlog (up to the window) landed inside the pause lengthened it
                    link.settle()
                    if len(s.history) - sn.sent_tokens < t.final_delta:
                        break
            sn.rate = 0.0
            t_wait = time.perf_counter()
            pause = self.pause(sid, slot)  # stop-and-copy, or the live final stage
            t_pause = time.perf_counter()
            link.on_stream = t.live and sn.incremental  # a few tokens' KV and the small state
            link.send(sn.finish())  # streamed: the target verifies and lands while we encode
            t_sent = time.perf_counter()
            link.wait_restored()
            t_restored = time.perf_counter()
            try:
                link.commit()
            except InDoubt:
                # Neither host may run it now: keep it paused here until the target answers.
                self._fence(sid, slot, pause, link, t, s)
                pause = link = None
                raise MigrationError(f"migration to {t.target}: the commit's answer was lost; the session "
                                     "stays paused here until the target says whether it committed") from None
            t.pause_ms = (time.perf_counter() - t_pause) * 1000
            t.phases_ms = {"extract": sn.busy["extract"] * 1e3, "encode": sn.busy["encode"] * 1e3,
                           "wire": link.waited * 1e3, **link.target_phases,
                           "pause_wait": (t_pause - t_wait) * 1e3, "final": (t_sent - t_pause) * 1e3,
                           "restored": (t_restored - t_sent) * 1e3,
                           "commit": t.pause_ms - (t_restored - t_pause) * 1e3}
            if not t.live or not sn.incremental:  # the whole KV went while the session was held: its rate
                t.phases_ms["transfer"] = (t_restored - t_pause) * 1e3
                t.transfer_mb_s = sn.raw_kv_bytes / 1e6 / max(t_restored - t_pause, 1e-9)
            m.migrations.labels("committed").inc()
            m.pause.observe(t.pause_ms / 1000)
            log.info("session %s moved to %s (pause %.1f ms)", sid, t.target, t.pause_ms)
            self._handed_over(sid, slot, pause, t, s)
            pause = None
            link.wait_running(RUNNING_WAIT)  # off the critical path: after the target's first token
            s.close()
            self.tell_directory("move", sid, self.address, t.target)
        except grpc.RpcError as e:
            m.migrations.labels("failed").inc()
            if link is not None:
                link.abort()
            err = target_refused(e, t.target)
            log.warning("session %s: migration to %s failed: %s", sid, t.target, err)
            raise err from None
        except BaseException as e:
            m.migrations.labels("failed").inc()
            log.warning("session %s: migration to %s failed: %s", sid, t.target, e)
            if link is not None:
                link.abort()
            if isinstance(e, Exception) and s.closed and self.host.sessions.get(sid) is not s:
                # its client closed it between two stages (a close waits only for a turn): what
                # failed was reading a closed session, which is not the reason to report
                raise UnknownSessionError(f"session {sid} was closed during its migration to {t.target}; "
                                          "nothing moved") from None
            raise
        finally:
            if link is not None:
                link.close()
            if pause is not None:
                self.unpause(slot, pause)
        t.progress.put(pb.MigrateProgress(bytes_sent=link.bytes, frames_sent=len(link.frames),
                                          frames_total=len(link.frames), done=True, target=t.target,
                                          seconds=time.perf_counter() - t0, raw_kv_bytes=sn.raw_kv_bytes,
                                          tokens=len(s.history), pause_ms=t.pause_ms, mode=sn.mode,
                                          phases_ms=t.phases_ms, transfer_mb_s=t.transfer_mb_s,
                                          transport=link.transport))

    def _probe_link(self, s: Any, sn: Snapshotter, link: "_Link", t: MigrationTicket, chunk: int) -> Any:
        """Mode auto: send the first KV raw and unpaced, time the link by the target's
        acks and the codecs on that KV, and switch ``sn`` to the cheapest mode."""
        if not sn.incremental:
            return choose(0.0, {})  # a rotating cache goes whole at the end: raw
        with self.host.compute:
            n = len(s.history)
        upto = min(n, sn.sent_tokens + max(16, PROBE_BYTES // max(1, sn.kv_bytes_per_token())))
        sample: list = []

        def tap(pieces):
            for p in pieces:
                if p[5] is None and sum(u.nbytes for u, _ in sample) < SAMPLE_BYTES:
                    sample.extend([(p[3][0].copy(), p[3][1]), (p[4][0].copy(), p[4][1])])
                yield p
        t0, sent0 = time.perf_counter(), link.bytes
        link.send(sn.encode(tap(sn.extract(upto, lock=self.host.compute, chunk=chunk))))
        wire = link.wait_acked_bytes(sent0, t0)  # MB/s, or 0.0 when too little was sent to tell
        modes = ("lossless", "int8") if t.allow_lossy else ("lossless",)
        c = choose(wire, codec_costs(sample, modes) if sample and wire else {})
        sn.mode = c.mode
        return c

    def _handed_over(self, sid: str, slot: Slot, pause: Any, t: MigrationTicket, s: Any) -> None:
        """The target committed: unlist here, end the client's stream with moved_to."""
        pause.committed, pause.target = True, t.target
        with self.registry_lock:
            self.moved[sid] = (t.target, time.monotonic())
            self.slots.pop(sid, None)
            self.feeds.pop(sid, None)
        self.host.detach(sid)  # listed on the target only from now on
        self.unpause(slot, pause)  # the client's stream moves on to the target right away

    def _fence(self, sid: str, slot: Slot, pause: Any, link: "_Link", t: MigrationTicket, s: Any) -> None:
        """A commit in doubt: the session stays paused (fenced) and its slot busy
        while a thread asks the target until the answer is definite, then either
        hands it over or lets it run on here. Never on both hosts, never on none."""
        t.fenced = True

        def settle() -> None:
            while (committed := link.ask()) is None:
                time.sleep(1.0)
            if committed:
                self._handed_over(sid, slot, pause, t, s)
                s.close()
                self.tell_directory("move", sid, self.address, t.target)
            else:
                self.unpause(slot, pause)
            slot.migrating = False
        threading.Thread(target=settle, daemon=True, name=f"kvferry-fence-{sid}").start()

    def run_ticket(self, sid: str, slot: Slot, t: MigrationTicket) -> None:
        try:
            self.migrate_out(sid, slot, t)
        except KvferryError as e:
            t.error = e
        except Exception as e:  # report, keep serving: the session stays here
            t.error = MigrationError(f"migration to {t.target} failed: {type(e).__name__}: {e}")
        finally:
            if not t.fenced:
                slot.migrating = False
            t.progress.put(None)


class _Link:
    """The source's side of one Transfer stream: windowed sends, acks, resume
    from the target's last verified frame after a reconnect (same migration id)."""

    def __init__(self, srv: MigrationSource, t: MigrationTicket, s, sid: str, on_ack: Callable | None = None):
        self.srv, self.t, self.s, self.sid = srv, t, s, sid
        self.on_ack = on_ack
        self.mid = uuid.uuid4().hex
        self.frames: list[bytes] = []
        self.ends: list[int] = []  # bytes sent up to and including each frame
        self.acked = 0
        self.ack_times: list[tuple[float, int]] = []  # (when, bytes acknowledged): the link's rate
        self.state = ""
        self.waited = 0.0  # seconds blocked on acks: the wire and the target
        self.target_phases: dict[str, float] = {}  # the target's land/prepare ms (its "restored" ack)
        self.reqs: "queue.Queue[Any] | None" = None
        self.acks = None
        self.ch = None
        self.lane: LaneWriter | None = None
        self.lane_broken = False  # this stream's lane failed: the stream is cancelled to resume
        self.lane_failures = 0  # lanes that failed to open or broke: after LANE_TRIES, the stream only
        self.lane_frames = 0  # frames sent on a lane
        self.on_stream = False  # the live pause: its few small frames go on the stream (see _put)
        self._connect()

    def _connect(self) -> None:
        self.close()
        self.reqs = q = queue.Queue()

        def gen():
            while (m := q.get()) is not None:
                yield m
        self.ch = channel(self.t.target, self.srv.client_tls)
        transfer = self.ch.stream_stream(MIGRATION_SERVICE + "Transfer", request_serializer=write_message,
                                         response_deserializer=pb.MigrationAck.FromString)
        self.acks = transfer(gen(), metadata=auth_metadata(self.t.token or self.srv.token), timeout=600)
        q.put(pb.MigrationMessage(begin=pb.Begin(migration_id=self.mid, session_id=self.sid,
                                                 fingerprint=self.s.lm.fingerprint, source=self.srv.address,
                                                 lane=self.t.lane and self.lane_failures < LANE_TRIES)))
        ack = next(self.acks)
        if ack.state in ("ready", "restored") and ack.next_seq < self.acked:
            raise MigrationError(f"migration to {self.t.target} failed: the target lost the frames it had "
                                 "verified; nothing moved")
        for seq in range(self.acked, min(ack.next_seq, len(self.frames))):
            self.frames[seq] = b""  # verified by the target: never resent, so not kept
        self.acked, self.state = max(self.acked, ack.next_seq), ack.state
        if ack.lane_port:
            self._open_lane(ack.lane_port, ack.lane_ticket)
        for seq in range(self.acked, len(self.frames)):  # resume: resend what was not verified
            self._put(seq, self.frames[seq])

    def _open_lane(self, port: int, ticket: bytes) -> None:
        """Dial the target's lane; on failure the frames stay on the stream."""
        host, _ = addresses.split(self.t.target)
        try:
            self.lane = LaneWriter(host, port, ticket, self.srv.client_tls, self._lane_broke)
        except (OSError, ValueError) as e:
            self.lane_failures += 1
            log.warning("migration to %s: no lane (%s: %s); the KV goes on the stream", self.t.target,
                        type(e).__name__, e)

    def _lane_broke(self, lane: LaneWriter) -> None:
        """(The lane's thread) Cancel the stream, so the reader of acks reconnects;
        after LANE_GRACE_S, for a target that closed the lane because it refused the
        migration says so on the stream meanwhile (its error, not a reconnect)."""
        if lane is not self.lane:
            return
        self.lane_failures += 1
        acks = self.acks

        def cancel() -> None:
            if self.lane is lane and self.acks is acks and acks is not None:
                self.lane_broken = True
                acks.cancel()
        threading.Timer(LANE_GRACE_S, cancel).start()

    @property
    def transport(self) -> str:
        """How the KV went: ``lane`` (its frames, but for a live pause's few) or ``stream``."""
        return "lane" if self.lane_frames else "stream"

    def _put(self, seq: int, frame: bytes) -> None:
        """A frame on the lane, if one is open and this is not the live pause: there
        its few small frames reach the target's handler sooner on the stream, with
        one thread between them fewer (on an H100, the pause was 7 ms longer with
        them on the lane). The target puts frames of the two in order."""
        if self.lane is not None and not self.on_stream:
            self.lane.put(seq, frame)
            self.lane_frames += 1
        else:
            self.reqs.put(frame_message(seq, frame))

    @property
    def bytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def unacked_bytes(self) -> int:
        """Bytes sent and not yet acknowledged by the target."""
        return self.bytes - (self.ends[self.acked - 1] if self.acked else 0)

    def _next_ack(self) -> None:
        """Read one ack. On a dropped link, reconnect instead: the target's answer to
        the new Begin (its last verified frame, or that it already committed) counts."""
        began = time.perf_counter()
        try:
            ack = next(self.acks)
        except StopIteration:
            raise MigrationError(f"migration to {self.t.target} failed: the target closed the stream") from None
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE and not (
                    self.lane_broken and e.code() == grpc.StatusCode.CANCELLED):
                raise
            self._reconnect()
            return
        finally:
            self.waited += time.perf_counter() - began
        for seq in range(self.acked, min(ack.next_seq, len(self.frames))):
            self.frames[seq] = b""  # verified by the target: never resent, so not kept
        self.acked, self.state = max(self.acked, ack.next_seq), ack.state
        if ack.phases_ms:
            self.target_phases = dict(ack.phases_ms)
        self.ack_times.append((time.perf_counter(), self.ends[self.acked - 1] if self.acked else 0))
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
                    len(self.frames) - self.acked >= WINDOW_FRAMES or self.unacked_bytes >= WINDOW_BYTES):
                self._next_ack()
            self._put(len(self.frames), f)
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

    def wait_acked_bytes(self, since: int, t0: float) -> float:
        """Read the acks the target owes (it acks every ACK_EVERY_FRAMES frames or
        ACK_EVERY_BYTES bytes) for what was sent after offset ``since``; the rate
        between the first and the last of them, MB/s (the start, while HTTP/2's
        windows and the connection warm up, is left out), or 0.0 when fewer than
        two acks came."""
        first = len(self.ack_times)
        self.settle()
        acks = [a for a in self.ack_times[first:] if a[1] > since]
        if len(acks) < 2 or acks[-1][0] <= acks[0][0]:
            return 0.0
        return (acks[-1][1] - acks[0][1]) / 1e6 / (acks[-1][0] - acks[0][0])

    def settle(self) -> None:
        """Read the acks the target owes: until what it has not acknowledged is less
        than it acks at once (ACK_EVERY_FRAMES frames, ACK_EVERY_BYTES bytes)."""
        while len(self.frames) - self.acked >= ACK_EVERY_FRAMES or self.unacked_bytes >= ACK_EVERY_BYTES:
            self._next_ack()

    def wait_restored(self) -> None:
        while self.state != "restored":
            self._next_ack()

    def commit(self) -> None:
        """Commit at the target. Returns once it committed; MigrationError (or the
        target's own error) when it definitely did not; InDoubt when neither can be
        told within IN_DOUBT_S (the commit was sent and its answer lost)."""
        try:
            self._commit()
            return
        except grpc.RpcError as e:
            if _coded(e):
                raise target_refused(e, self.t.target) from None
        except MigrationError:
            pass  # a closed stream or an odd answer: ask below
        deadline = time.monotonic() + IN_DOUBT_S
        while (committed := self.ask()) is None:
            if time.monotonic() > deadline:
                raise InDoubt()
            time.sleep(0.5)
        if not committed:
            raise MigrationError(f"migration to {self.t.target} failed: the target did not commit")

    def ask(self) -> bool | None:
        """The target's word on this migration: True committed, False aborted (it
        will never commit it now), None no answer."""
        ch = channel(self.t.target, self.srv.client_tls)
        try:
            ack = pbg.MigrationStub(ch).Status(pb.MigrationRef(migration_id=self.mid, session_id=self.sid),
                                               metadata=auth_metadata(self.t.token or self.srv.token), timeout=5)
            return {"committed": True, "aborted": False}.get(ack.state)
        except grpc.RpcError:
            return None
        finally:
            ch.close()

    def _commit(self) -> None:
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
        if self.lane is not None:
            self.lane.close()
        if self.reqs is not None:
            self.reqs.put(None)
        if self.ch is not None:
            self.ch.close()
        self.reqs = self.ch = self.lane = None
        self.lane_broken = False
