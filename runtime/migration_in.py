"""Migration, target side: verify frames as they arrive, restore, and make the
session ours only at commit (:meth:`ModelHost.adopt`); a session that moved
mid-reply generates on at once, before its client reconnects."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .checkpoint.frames import FrameDecoder
from .checkpoint.restore import Restorer
from .errors import KvferryError, MigrationError, ModelMismatchError, SessionExistsError
from .handoff_trace import mark
from .migration_lane import Inbox, LaneBroken, LaneFrame
from .migration_wire import FrameView, read_message
from .proto import kvferry_pb2 as pb
from .proto import kvferry_pb2_grpc as pbg
from .slots import Slot, TurnFeed
from .transport import MIGRATION_SERVICE, abort

log = logging.getLogger("kvferry.migration")

RUNNING_WAIT = 5.0  # s: how long the target waits for a landed turn's first token before it reports
# the target acks this often (< the source's window): about every pre-copy frame of
# KV, so that what a source still has in flight when it pauses is small
ACK_EVERY_FRAMES, ACK_EVERY_BYTES = 16, 1 << 20
PREPARED_TTL = 120.0
AHEAD_FRAMES = 64  # frames held for order (lane and stream race at the live pause); past: an error


@dataclass
class Incoming:
    session_id: str
    restorer: Restorer
    # KV read in place from the received frame (a lane's buffer goes back only after landing)
    decoder: FrameDecoder = field(default_factory=lambda: FrameDecoder(views=True))
    next_seq: int = 0
    prepared: Any = None
    land_s: float = 0.0  # verifying and applying frames
    ahead: dict = field(default_factory=dict)  # seq -> a frame that came before the one we need
    touched: float = field(default_factory=time.monotonic)  # last message: a live migration may run long


def expire(srv: Any, now: float) -> None:
    """Drop incoming migrations idle for PREPARED_TTL (never one still sending:
    a live pre-copy can take minutes), and old committed/aborted ids. A dropped
    one is marked aborted, so a late commit is refused, not half-applied."""
    with srv.registry_lock:
        for k in [k for k, v in srv.incoming.items() if now - v.touched > PREPARED_TTL]:
            _abandon(srv, k, now)
        for done in (srv.committed, srv.aborted):
            for k in [k for k, t in done.items() if now - t > 10 * PREPARED_TTL]:
                del done[k]


def _abandon(srv: Any, mid: str, now: float) -> None:
    """(registry lock held) Forget an incoming migration for good."""
    inc = srv.incoming.pop(mid, None)
    if inc is not None:
        inc.restorer.release()
        if inc.prepared is not None:
            inc.prepared.close()
    srv.aborted[mid] = now


def status(srv: Any, mid: str) -> str:
    """The answer to a source asking after a lost commit ack: committed, or
    aborted from now on (a commit arriving later is refused)."""
    with srv.registry_lock:
        if mid in srv.committed:
            return "committed"
        _abandon(srv, mid, time.monotonic())
        return "aborted"


class MigrationTarget(pbg.MigrationServicer):
    """Target side: verify frames as they come, restore, commit on request."""

    def __init__(self, srv: Any):
        self.srv = srv

    def Transfer(self, request_iterator, context):
        srv = self.srv
        inc: Incoming | None = None
        mid = ""
        acked_seq, unacked = 0, 0
        inbox, ticket = Inbox(request_iterator), b""
        try:
            for msg in inbox:
                if isinstance(msg, LaneBroken):
                    log.warning("migration %s: its lane broke (%s); the source resumes on a new one", mid, msg.why)
                    continue
                kind = "frame" if isinstance(msg, FrameView) else msg.WhichOneof("kind")
                if inc is not None:
                    inc.touched = time.monotonic()
                if kind == "begin":
                    b = msg.begin
                    srv.refuse_if_draining()
                    if b.fingerprint != srv.host.lm.fingerprint:
                        raise ModelMismatchError(f"model mismatch: the target serves '{srv.host.lm.name}' "
                                                 f"({srv.host.lm.fingerprint[:12]}…), the session's model differs")
                    if b.migration_id in srv.committed:  # the link dropped after our commit ack
                        yield pb.MigrationAck(state="committed", next_seq=0, session_id=b.session_id)
                        yield pb.MigrationAck(state="running", next_seq=0, session_id=b.session_id)
                        continue
                    with srv.registry_lock:
                        if b.migration_id in srv.aborted:
                            raise MigrationError(f"migration {b.migration_id} was abandoned here; start again")
                        inc = srv.incoming.get(b.migration_id)
                        if inc is None:
                            if b.session_id in srv.host.sessions:
                                raise SessionExistsError(f"session {b.session_id} already exists on the target")
                            inc = Incoming(b.session_id, Restorer(srv.host, session_id=b.session_id))
                            srv.incoming[b.migration_id] = inc
                        mid = b.migration_id
                    acked_seq, unacked = inc.next_seq, 0
                    ready = pb.MigrationAck(state="ready" if inc.prepared is None else "restored",
                                            next_seq=inc.next_seq, session_id=inc.session_id)
                    if b.lane and srv.lane is not None and not ticket:  # one lane a stream
                        ticket = srv.lane.issue(inbox)
                        ready.lane_port, ready.lane_ticket = srv.lane.port, ticket
                        inbox.merge()
                    yield ready
                elif kind == "frame":
                    if inc is None:
                        if mid and isinstance(msg, FrameView):
                            continue  # a lane's frame sent before the stream's abort or commit
                        raise KvferryError("frame before begin")
                    f = msg if isinstance(msg, FrameView) else msg.frame
                    if f.seq < inc.next_seq:
                        continue  # a resend after reconnect: already verified
                    if f.seq > inc.next_seq:
                        # the lane's last frames may come after the stream's first ones
                        # (the live pause's small frames go on the stream): hold it
                        if len(inc.ahead) >= AHEAD_FRAMES:
                            raise KvferryError(f"frame {f.seq} arrived, expected {inc.next_seq}")
                        inc.ahead[f.seq] = f
                        continue
                    while f is not None:
                        data = f.data  # once: protobuf's .data is a fresh copy each time
                        began = time.perf_counter()
                        for fr in inc.decoder.feed(data, getattr(f, "checked", None)):
                            inc.restorer.apply(fr)
                        landed = time.perf_counter()
                        inc.land_s += landed - began
                        inc.next_seq += 1
                        unacked += len(data)
                        if isinstance(f, LaneFrame):
                            f.release()  # its buffer back to the lane: what landed was copied (Restorer._kept)
                        f = inc.ahead.pop(inc.next_seq, None)
                    if inc.decoder.done and inc.prepared is None:
                        mark("target_landed", inc.session_id)
                        inc.prepared = inc.restorer.commit()
                        mark("target_prepared", inc.session_id)
                        yield pb.MigrationAck(state="restored", next_seq=inc.next_seq, session_id=inc.session_id,
                                              phases_ms={"land": inc.land_s * 1e3,
                                                         "prepare": (time.perf_counter() - landed) * 1e3})
                    elif inc.next_seq - acked_seq >= ACK_EVERY_FRAMES or unacked >= ACK_EVERY_BYTES:
                        # coalesced acks (below the source's window, so it never starves)
                        yield pb.MigrationAck(state="ack", next_seq=inc.next_seq, session_id=inc.session_id)
                    else:
                        continue
                    acked_seq, unacked = inc.next_seq, 0
                elif kind == "commit":
                    mark("target_commit", mid)
                    if inc is None or inc.prepared is None:
                        raise KvferryError("commit before a verified restore")
                    with srv.registry_lock:  # the check and the adoption at once: commit is idempotent
                        feed = None
                        if mid in srv.committed:  # a re-sent commit (the link was replaced meanwhile)
                            yield pb.MigrationAck(state="committed", next_seq=inc.next_seq, session_id=inc.session_id)
                            yield pb.MigrationAck(state="running", next_seq=inc.next_seq, session_id=inc.session_id)
                            inc = None
                            continue
                        if mid in srv.aborted or srv.incoming.get(mid) is not inc:
                            raise MigrationError(f"migration {mid} was abandoned here (idle too long, or the "
                                                 "source asked); not committed")
                        if srv.draining:  # a drain has listed what it moves: a newcomer would be left behind
                            _abandon(srv, mid, time.monotonic())
                            inc = None
                            srv.refuse_if_draining()
                        try:
                            srv.host.adopt(inc.prepared)
                        except SessionExistsError:
                            inc.prepared = None  # adopt closed it
                            raise
                        inc.restorer.release()  # its KV is the host's now
                        srv.incoming.pop(mid, None)
                        srv.moved.pop(inc.session_id, None)
                        srv.committed[mid] = time.monotonic()
                        if inc.prepared.turn is not None:  # it moved mid-reply: generate on now
                            # a fresh slot (free: nothing can wait on it yet), never a wait under this lock
                            slot = srv.slots[inc.session_id] = Slot()
                            slot.lock.acquire()
                            t = inc.prepared.turn
                            feed = srv.feeds[inc.session_id] = TurnFeed(earlier=list(zip(t.tokens, t.texts)))
                            srv.drivers.submit(srv.drive, inc.session_id, slot, feed)
                    mark("target_adopted", inc.session_id)
                    yield pb.MigrationAck(state="committed", next_seq=inc.next_seq, session_id=inc.session_id)
                    # Bookkeeping waits for the landed turn's first token: on a shared
                    # machine it would slow the step the client is waiting for.
                    if feed is not None:
                        feed.wait_started(RUNNING_WAIT)
                    srv.tell_directory("register_session", inc.session_id, srv.address)
                    yield pb.MigrationAck(state="running", next_seq=inc.next_seq, session_id=inc.session_id)
                    inc = None
                elif kind == "abort":
                    with srv.registry_lock:
                        srv.incoming.pop(mid, None)
                    if inc is not None and inc.prepared is not None:
                        inc.prepared.close()
                    inc = None
        except (KvferryError, TypeError, ValueError, KeyError, AttributeError) as e:
            if inc is not None:
                with srv.registry_lock:
                    srv.incoming = {k: v for k, v in srv.incoming.items() if v is not inc}
                    srv.aborted[mid] = time.monotonic()  # refused: a reconnect may not resume it
                inc.restorer.release()  # its KV reservation and its guest made ahead
            if not isinstance(e, KvferryError):  # a malformed message: one line, not UNKNOWN
                e = MigrationError(f"malformed migration message ({type(e).__name__}: {e})")
            abort(context, e)
        finally:
            inbox.close()
            if ticket:
                srv.lane.revoke(ticket)

    def Status(self, ref, context):
        return pb.MigrationAck(state=status(self.srv, ref.migration_id), session_id=ref.session_id)

    def add_to_server(self, server: Any) -> None:
        """The generated registration, but Transfer's requests read by
        :func:`read_message` (a frame's bytes not copied)."""
        import grpc

        handlers = {
            "Transfer": grpc.stream_stream_rpc_method_handler(
                self.Transfer, request_deserializer=read_message,
                response_serializer=pb.MigrationAck.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(
                self.Status, request_deserializer=pb.MigrationRef.FromString,
                response_serializer=pb.MigrationAck.SerializeToString),
        }
        service = MIGRATION_SERVICE.strip("/")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)
