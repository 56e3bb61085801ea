"""Drain: empty a host before it stops, by live migration to its peers.

SIGTERM on ``kvferry serve`` and ``kvferry drain HOST`` both end here. The host
first says NOT_SERVING (grpc.health.v1) and refuses new sessions, then moves
every session to a peer (``serve --peers``, else the cluster controller's healthy
hosts) with live migration: a reply being generated continues on the peer and
its client follows. A session no peer takes is checkpointed to the drain
directory and restored when a host with that directory starts again. The whole
drain is bounded by ``--drain-timeout``; each session's outcome (moved, saved,
failed, or ended: its client closed it meanwhile) is reported. A session is never in two places or none: a migration
that fails leaves it here, to be saved.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from .errors import KvferryError, SessionBusyError, SessionMovedError, UnknownSessionError
from .migration_out import MigrationTicket
from .params import DRAIN_TIMEOUT, MIGRATE_DEFAULTS

log = logging.getLogger("kvferry.drain")


class Drainer:
    """Mixin of :class:`kvferry.server.HostServer`: draining and the drain directory."""

    host: Any
    address: str
    peers: tuple[str, ...]
    drain_dir: Path | None
    draining: bool

    def peer_hosts(self, healthy: bool = True) -> list[str]:
        """Where sessions may go: ``--peers``, else the controller's hosts (``healthy``:
        only those it reports healthy)."""
        if self.peers:
            return [p for p in self.peers if p != self.address]
        hosts = self.tell_directory("hosts") or []
        return [h["address"] for h in hosts if (h.get("healthy") or not healthy) and h["address"] != self.address]

    def move(self, sid: str, target: str) -> None:
        """Migrate one session (live) and wait for the outcome."""
        slot = self.slot(sid)
        with self.registry_lock:
            if slot.migrating:
                raise SessionBusyError(f"session {sid}: a migration is already in progress")
            slot.migrating = True
        t = MigrationTicket(target, None, MIGRATE_DEFAULTS["mode"], live=True)
        self.run_ticket(sid, slot, t)
        if t.error is not None:
            raise t.error

    def drain(self, timeout: float = DRAIN_TIMEOUT) -> list[dict]:
        """Move every session away (or save it); one outcome per session."""
        with self.registry_lock:  # from here on no migration commits here (see migration_in)
            self.draining = True
        self.set_serving(False)
        deadline = time.monotonic() + timeout
        peers = self.peer_hosts()
        outcomes = []
        for i, sid in enumerate(self._to_drain()):
            out = {"session": sid, "outcome": "failed", "where": "", "error": ""}
            k = 0
            while k < len(peers):
                if time.monotonic() > deadline:
                    out["error"] = f"drain timeout ({timeout:g} s)"
                    break
                peer = peers[(i + k) % len(peers)]  # spread the sessions over the peers
                try:
                    self.move(sid, peer)
                    out.update(outcome="moved", where=peer, error="")
                    break
                except SessionMovedError as e:  # another migration took it meanwhile
                    out.update(outcome="moved", where=e.moved_to, error="")
                    break
                except UnknownSessionError:  # its client closed it meanwhile
                    out.update(outcome="ended", error="")
                    break
                except SessionBusyError:  # a migration of it is in flight: its outcome decides
                    time.sleep(0.2)
                    continue
                except KvferryError as e:
                    out["error"] = str(e)
                k += 1
            if out["outcome"] == "failed" and sid not in self.host.sessions:  # gone meanwhile: say where
                to = self.where(sid)
                out.update(outcome="moved" if to else "ended", where=to or "", error="")
            if out["outcome"] == "failed":
                if not peers:
                    out["error"] = "no peer to move it to"
                if self.drain_dir is not None:
                    try:
                        out.update(outcome="saved", where=str(self.save_drained(sid)))
                    except (KvferryError, OSError) as e:
                        out["error"] = f"{out['error']}; not saved either: {e}".lstrip("; ")
            (log.info if out["outcome"] != "failed" else log.error)(
                "drain %s: %s %s %s", sid, out["outcome"], out["where"], out["error"])
            outcomes.append(out)
        return outcomes

    def _to_drain(self):
        """Every session here, including any that landed while the drain ran (a
        create or restore already past its draining check): until none is left unseen."""
        seen: set[str] = set()
        while new := [sid for sid in list(self.host.sessions) if sid not in seen]:
            seen.update(new)
            yield from new

    def save_drained(self, sid: str) -> Path:
        """Checkpoint a session (held still between two steps) into the drain directory, then close it."""
        from .checkpoint.snapshot import save

        self.drain_dir.mkdir(parents=True, exist_ok=True)
        slot = self.slot(sid)
        pause = self.pause(sid, slot)
        try:
            path = self.drain_dir / f"{sid}.kvf"
            save(self.host.get(sid), path, "lossless")
            pause.committed, pause.target = True, ""  # its stream ends with a one-line error
            with self.registry_lock:
                self.slots.pop(sid, None)
                self.feeds.pop(sid, None)
            self.host.close_session(sid)
            self.tell_directory("forget_session", sid)
        finally:
            self.unpause(slot, pause)
        return path

    def restore_drained(self) -> list[dict]:
        """At start: bring back the sessions a drain saved here (each file once)."""
        out = []
        if self.drain_dir is None or not self.drain_dir.is_dir():
            return out
        for path in sorted(self.drain_dir.glob("*.kvf")):
            try:
                s = self.host.load(path)
                self.arrived(s.id)
                self.tell_directory("register_session", s.id, self.address)
                os.unlink(path)
                out.append({"session": s.id, "outcome": "restored", "where": str(path), "error": ""})
            except KvferryError as e:  # keep the file for a person to look at
                path.rename(path.with_suffix(".kvf.failed"))
                out.append({"session": path.stem, "outcome": "failed", "where": str(path), "error": str(e)})
            log.info("restore %s: %s", path.name, out[-1]["outcome"])
        return out
