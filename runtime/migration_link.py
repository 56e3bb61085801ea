"""Migration, source side: one Transfer stream to the target. Windowed frames
(on a lane when the target opens one), coalesced acks, a resume from the
target's last verified frame after a reconnect (same migration id), and a
commit whose answer, when lost, is asked for until it is definite."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable, Iterable

import grpc

from . import addresses
from .errors import CODES, AuthError, HostDownError, KvferryError, MigrationError, RemoteError
from .migration_in import ACK_EVERY_BYTES, ACK_EVERY_FRAMES
from .migration_lane import LaneWriter
from .migration_wire import frame_message, write_message
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .transport import ERROR_KEY, MIGRATION_SERVICE, auth_metadata, channel, translate

log = logging.getLogger("kvferry.migration")

WINDOW_FRAMES = 256  # unacknowledged checkpoint frames in flight ...
WINDOW_BYTES = 32 << 20  # ... and bytes: big KV frames are paced, small final ones are not
IN_DOUBT_S = 30.0  # s: how long a source asks a silent target about a sent commit before it says so
LANE_TRIES = 2  # lanes a migration opens at most (a failed one, then the stream only)
LANE_GRACE_S = 1.0  # s a broken lane waits for the stream's own word before it counts as a dropped link


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


class Link:
    """The source's side of one Transfer stream: windowed sends, acks, resume
    from the target's last verified frame after a reconnect (same migration id)."""

    def __init__(self, srv: Any, t: Any, s, sid: str, on_ack: Callable | None = None):
        # srv: the MigrationSource (a HostServer); t: its MigrationTicket
        self.srv, self.t, self.s, self.sid = srv, t, s, sid
        self.on_ack = on_ack
        self.mid = uuid.uuid4().hex
        self.frames: list = []  # bytes, or frames.Parts (KV read in place), until verified
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

    def release(self) -> int:
        """Drop the frames kept for a resend and the progress callback (which holds the
        Snapshotter, and so the session's caches, in a cycle with this link): the KV
        they hold, a session's own buffers when read in place, is freed now, for the
        next session to land in while its pages are still mapped, not at the
        collector's next pass. Returns how many frames were sent."""
        n, self.frames, self.on_ack = len(self.frames), [], None
        return n

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        if self.reqs is not None:
            self.reqs.put(None)
        if self.ch is not None:
            self.ch.close()
        self.reqs = self.ch = self.lane = None
        self.lane_broken = False
