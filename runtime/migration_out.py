"""Migration, source side: pre-copy while the session generates, pause it at a
step boundary for the last delta and the small state, commit, hand the client
over (or stop-and-copy). The Transfer stream itself is :class:`kvferry.migration_link.Link`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import grpc

from .checkpoint.snapshot import Snapshotter
from .errors import ForbiddenError, KvferryError, MigrationError, UnknownSessionError
from .handoff_trace import mark
from .linkaware import PROBE_BYTES, SAMPLE_BYTES, choose, codec_costs
from .migration_link import InDoubt, Link, target_refused
from .proto import kvferry_pb2 as pb
from .slots import Slot

log = logging.getLogger("kvferry.migration")

RUNNING_WAIT = 5.0  # s: how long a source keeps a moved session's memory for the target's first token
PRECOPY_STEP_BYTES = 3 << 20  # live pre-copy default: ~3 MB of KV per step of the generating session
PRECOPY_RATE = 40e6  # ... and 40 MB/s while it is not generating
PRECOPY_MAX = {"cpu": 80e6, "gpu": 1e9}  # pace cap: a CPU's generation shares its memory bandwidth
PRECOPY_CHUNK = 3 << 19  # pre-copy frames carry ~1.5 MB of one layer's KV (a token range)


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


def _marked(frames: Iterator[bytes], sid: str) -> Iterator[bytes]:
    """``frames``, each one marked in the handoff trace (the last delta, the
    state, the guest, the trailer)."""
    for k, f in enumerate(frames):
        mark(f"source_final_frame{k}", sid)
        yield f


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
        sn = Snapshotter(s, "raw" if t.mode == "auto" else t.mode, parts=True)
        def progress() -> None:
            t.progress.put(pb.MigrateProgress(
                bytes_sent=link.bytes, frames_sent=link.acked, frames_total=len(link.frames),
                target=t.target, seconds=time.perf_counter() - t0, raw_kv_bytes=sn.raw_kv_bytes,
                tokens=len(s.history)))

        link = pause = None
        m = self.host.metrics
        m.migrations.labels("started").inc()
        try:
            link = Link(self, t, s, sid, on_ack=progress)
            link.send([sn.header()])
            chunk = sn.chunk_tokens(PRECOPY_CHUNK)
            if t.mode == "auto":
                t.choice = self._probe_link(s, sn, link, t, chunk)
            if t.live and sn.incremental:
                for _ in range(t.max_stages):  # pre-copy: the session keeps generating
                    with self.host.compute:
                        upto = len(s.history)
                    sn.rate = t.rate or precopy_rate(s, self.host.device.kind)
                    link.send(sn.precopy(upto, self.host.compute, chunk))
                    # the target lands what it was sent before the pause, not in it: a
                    # backlog (up to the window) landed inside the pause lengthened it
                    link.settle()
                    if len(s.history) - sn.sent_tokens < t.final_delta:
                        break
            sn.rate = 0.0
            t_wait = time.perf_counter()
            pause = self.pause(sid, slot)  # stop-and-copy, or the live final stage
            t_pause = time.perf_counter()
            mark("source_paused", sid)
            link.on_stream = t.live and sn.incremental  # a few tokens' KV and the small state
            link.send(_marked(sn.finish(), sid))  # streamed: the target verifies and lands while we encode
            t_sent = time.perf_counter()
            mark("source_sent", sid)
            link.wait_restored()
            t_restored = time.perf_counter()
            mark("source_restored", sid)
            try:
                link.commit()
            except InDoubt:
                # Neither host may run it now: keep it paused here until the target answers.
                self._fence(sid, slot, pause, link, t, s)
                pause = link = None
                raise MigrationError(f"migration to {t.target}: the commit's answer was lost; the session "
                                     "stays paused here until the target says whether it committed") from None
            t.pause_ms = (time.perf_counter() - t_pause) * 1000
            mark("source_committed", sid)
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
                frames = link.release()
            if pause is not None:
                self.unpause(slot, pause)
        t.progress.put(pb.MigrateProgress(bytes_sent=link.bytes, frames_sent=frames,
                                          frames_total=frames, done=True, target=t.target,
                                          seconds=time.perf_counter() - t0, raw_kv_bytes=sn.raw_kv_bytes,
                                          tokens=len(s.history), pause_ms=t.pause_ms, mode=sn.mode,
                                          phases_ms=t.phases_ms, transfer_mb_s=t.transfer_mb_s,
                                          transport=link.transport))

    def _probe_link(self, s: Any, sn: Snapshotter, link: Link, t: MigrationTicket, chunk: int) -> Any:
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
        link.send(sn.encode(tap(sn.extract(upto, lock=self.host.compute, chunk=chunk)),
                              lasting=sn.lasting(self.host.compute)))
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

    def _fence(self, sid: str, slot: Slot, pause: Any, link: Link, t: MigrationTicket, s: Any) -> None:
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
