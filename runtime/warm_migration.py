"""A GPU host's first live migration, made once at start on a session of its own.

A fresh H100 host's first live migration in had a downtime of 37-49 ms, where the
later ones had medians of 22-28: the target's landing of the last delta and its
build of the session took 19-27 ms against 7-14 (the build alone 8-10 against
3-5), in four runs of ``kvferry bench migrate --contexts 1024 2048 2048 --modes
live`` (stop 63, docs/performance-log.md). Idle sessions landed on that host
before (the bench's stop-and-copy transfers) did not spare it, and a CPU host
shows no such first time: what it pays is MLX CUDA meeting, in that process, the pieces only a reply
moved mid-way has (the step its source ran ahead, a last delta of a few tokens
landed as one batch, a turn in flight).

:func:`warm_migration` runs those pieces in process: a reply on a session of its
own, stopped between two steps; its KV pre-copied under the compute lock while it
goes on, its last delta and the step ahead read at a still boundary
(:class:`kvferry.checkpoint.snapshot.Snapshotter`, as a migration's source does);
all of it landed as a new session (:class:`kvferry.checkpoint.restore.Restorer`,
as a target does), whose turn then goes on for a few tokens. Both sessions are
closed after. ``KVFERRY_WARM_MIGRATION=0`` leaves it out (to compare).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

from .params import SamplingParams

log = logging.getLogger("kvferry.host")

PROMPT = " ".join(["warm"] * 300)  # some hundreds of tokens: pre-copy pieces of several layers' KV
AHEAD = 8  # tokens of the reply before the pre-copy, and again before the pause
AFTER = 3  # tokens the landed reply goes on for


def enabled() -> bool:
    return os.environ.get("KVFERRY_WARM_MIGRATION", "1") != "0"


def warm_migration(host: Any) -> dict:
    """Move a reply of this host's own, mid-way, into a new session on this host, as
    a live migration would (see the module); returns what it did and how long it took.
    Nothing is left behind: both sessions are closed, whatever fails."""
    from .checkpoint.restore import Restorer
    from .checkpoint.frames import iter_frames
    from .checkpoint.snapshot import Snapshotter
    from .migration_out import PRECOPY_CHUNK

    t0 = time.perf_counter()
    sampling = SamplingParams(temperature=0.0, max_tokens=4 * AHEAD + AFTER + 8, ignore_eos=True)
    src = host.create_session(None, sampling)
    dst = None
    reply = src.send(PROMPT)
    try:
        head = [next(reply).token for _ in range(AHEAD)]  # between two steps, its reply in flight
        sn = Snapshotter(src, "raw")
        frames = [sn.header()]
        # pre-copy: short holds of the compute lock while the reply goes on
        frames += sn.precopy(len(src.history), host.compute, sn.chunk_tokens(PRECOPY_CHUNK))
        head += [next(reply).token for _ in range(AHEAD)]
        while not host.steps.still(src):  # a boundary with no step run on past it, as a pause waits for
            head.append(next(reply).token)
        frames += sn.finish()  # the pause: the last delta, the step run ahead, the state and the guest
        r = Restorer(host, session_id=f"{src.id}-{secrets.token_hex(4)}")
        try:
            for f in iter_frames(frames):
                r.apply(f)
            dst = host.adopt(r.commit())
        finally:
            r.release()
        ahead = dst.landed_step is not None  # the step the source ran ahead, landed for its first step
        host.close_session(src.id)
        went_on = dst.continue_turn(from_index=len(head))
        try:
            tokens = head + [next(went_on).token for _ in range(AFTER)]
        finally:
            went_on.close()
        return {"tokens": tokens, "ahead": ahead, "seconds": round(time.perf_counter() - t0, 3)}
    finally:
        reply.close()
        for s in (src, dst):
            if s is not None and s.id in host.sessions:
                host.close_session(s.id)


def warm_logged(host: Any) -> None:
    """:func:`warm_migration`, logged; a failure is a warning, never a host that does not
    start (its first real migration then pays what this would have)."""
    try:
        log.info("a migration made in process at start: %s", warm_migration(host))
    except Exception as e:  # noqa: BLE001 (whatever it is, the host serves on)
        log.warning("the migration made at start failed (%s: %s); the first one in will be slower",
                    type(e).__name__, e)
