"""``kvferry bench migrate``: live vs stop-and-copy vs re-prefill, two hosts on loopback.

Two ``kvferry serve`` processes (each its own embedded Ray). For each context
length a conversation is built on host A and checkpointed; for each mode a
restored copy generates while the client records when every token arrives, and
is migrated to host B after a few tokens. An unmigrated restored twin on A gives
the reference continuation. Each (context, mode) is migrated ``reps`` times, each
time from a fresh restore of the same checkpoint; a row is the median rep (the
lower median for an even count) and lists every rep's figures next to it: on a
shared, noisy machine one migration's worst gap is partly the machine's.

- ``downtime_ms``: the longest gap in the client's token stream around the
  migration, minus the median normal inter-token gap;
- ``handoff_over_normal_ms``: the gap in which the session moved (last token
  from A to first from B) minus the normal gap: the pause the session itself
  takes, where the worst gap may instead fall on a slow pre-copy step;
- ``twin_worst_gap_over_median_ms``: the same statistic for the unmigrated twin
  over the same stretch of its reply: what this machine's noise alone gives;
- ``total_ms``: the whole migration as the source reports it;
- ``bytes``: on the wire; ``reprefill_ms``: host B prefilling the same context
  from scratch (time to first token); ``identical``: continuation == twin's.
"""

from __future__ import annotations

import gc
import os
import secrets
import statistics
import tempfile
import threading
import time
from pathlib import Path

from ..errors import KvferryError
from ..handoff_trace import mark
from .loopback import LoopbackHost, free_port

FILLER = ("The lighthouse keeper wrote in his log every night: the weather, the ships, the birds, "
          "and the small repairs the tower needed. ")


def _host(token: str, threads: int | None, cpus: str | None, port: int, peer_port: int,
          model: str | None = None) -> LoopbackHost:
    return LoopbackHost(token, *(["--threads", str(threads)] if threads else []), *(["--model", model] if model else []),
                        *(["--cpus", cpus] if cpus else []), "--peers", f"127.0.0.1:{peer_port}", port=port)


def _pair(token: str, threads: int | None, cpus: tuple[str, str] | None,
          model: str | None) -> tuple[LoopbackHost, LoopbackHost]:
    """Two hosts, each naming the other as its peer (migrations go to peers only), so
    their ports are picked before they start; one taken meanwhile by another process
    (an outgoing connection's ephemeral port) means two new ports."""
    for attempt in range(3):
        pa, pb = free_port(), free_port()
        a = None
        try:
            a = _host(token, threads, cpus and cpus[0], pa, pb, model)
            return a, _host(token, threads, cpus and cpus[1], pb, pa, model)
        except KvferryError as e:
            if a is not None:
                a.stop()
            if "Failed to bind" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _prompt(tokens: int, limit: int, model: str | None = None) -> str:
    """Text of about ``tokens`` tokens (never past ``limit``) for ``model``'s tokenizer."""
    from transformers import AutoTokenizer

    from ..models import resolve

    tok = AutoTokenizer.from_pretrained(str(resolve(model, progress=False)))
    ids = tok.encode(FILLER * (tokens // 20 + 1), add_special_tokens=False)[:min(tokens, limit)]
    return "Read this log and continue it.\n" + tok.decode(ids)


def split_cpus() -> tuple[str, str] | None:
    """Half of this machine's CPUs for each host (``serve --cpus``), as two machines
    would have; None where affinity is not available or there is one CPU."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


def run(contexts=(512, 2048, 8192), generate: int = 400, after: int = 16, migrate_after: int = 8,
        threads: int | None = 1, pin: bool = False, reps: int = 5, progress=print,
        transfer_only: bool = False, model: str | None = None, modes=("live", "stop-copy"),
        rate_mb_s: float = 0.0, lane: bool = True) -> dict:
    """``threads``: BLAS threads per host (``serve --threads``): both hosts share this
    machine, so each gets its share of the cores; None = the BLAS default (all).
    ``pin``: each host on its own half of the CPUs (``serve --cpus``).
    ``reps``: migrations per context and mode (a row is their median).
    ``modes``: which generating migrations to run. ``rate_mb_s``: the live
    pre-copy's pace, as ``kvferry migrate --rate`` (0: the host's default).
    ``lane``: the generating migrations' frames on the lane (False: the stream)."""
    if reps < 1:
        raise ValueError("reps must be at least 1")
    if rate_mb_s < 0:
        raise ValueError("rate must be positive")
    from ..models import resolve
    from ..sdk import Client

    resolve(model, progress=False)  # an unknown model is one line, before any host starts
    token = secrets.token_urlsafe(16)
    cpus = split_cpus() if pin else None
    progress("starting two hosts" + (f" (CPUs {cpus[0]} and {cpus[1]})" if cpus else ""))
    a, b = _pair(token, threads, cpus, model)
    rows, transfers = [], []
    try:
        ca, cb = Client(a.address, token), Client(b.address, token)
        with tempfile.TemporaryDirectory() as d:
            for ctx in contexts:
                prompt = _prompt(ctx, 8192 - generate - 96, model)
                base = ca.create_session(max_tokens=generate, ignore_eos=True)
                list(base.send(prompt, max_tokens=16))
                n_ctx = base.info()["tokens"]
                progress(f"context {n_ctx} tokens: prefilled on the source; re-prefilling it on the target")
                ck = Path(d) / f"ctx{ctx}.kvf"
                base.snapshot(ck)
                base.close()
                # re-prefill on the target: the alternative to moving the KV
                rp = cb.create_session(max_tokens=1, ignore_eos=True)
                t = time.perf_counter()
                next(iter(rp.events(prompt)))
                reprefill_ms = (time.perf_counter() - t) * 1000
                rp.close()
                progress(f"context {n_ctx} tokens: re-prefill {reprefill_ms:.0f} ms")
                transfers.append(transfer(a, b, token, ck, f"x{ctx}", n_ctx, reps))
                t = transfers[-1]
                progress(f"  raw transfer (idle session, stop-copy): {t['transfer_mb_s']} MB/s on the lane "
                         f"(reps {t['transfer_mb_s_reps']}), {t['stream_mb_s']} MB/s on the gRPC stream "
                         f"(reps {t['stream_mb_s_reps']}); lane phases {t['phases_ms']}")
                for live in (() if transfer_only else [m == "live" for m in modes]):
                    runs = []
                    for r in range(reps):
                        runs.append(_one(a, b, token, ck, f"m{ctx}{'l' if live else 's'}{r}", live, n_ctx,
                                         reprefill_ms, generate, after, migrate_after, rate_mb_s, lane))
                        progress(f"  {runs[-1]['mode']} rep {r + 1}/{reps}: downtime {runs[-1]['downtime_ms']} ms"
                                 f" (handoff gap {runs[-1]['handoff_gap_ms']} ms, normal {runs[-1]['normal_gap_ms']}"
                                 f" ms; twin noise {runs[-1]['twin_worst_gap_over_median_ms']} ms)")
                    rows.append(aggregate(runs))
                    rows[-1]["threads_per_host"] = threads or "default"
                    rows[-1]["cpus"] = {"source": cpus[0], "target": cpus[1]} if cpus else "shared"
                    progress(f"  {rows[-1]['mode']}: median downtime {rows[-1]['downtime_ms']} ms of "
                             f"{rows[-1]['downtime_ms_reps']}, total {rows[-1]['total_ms']} ms, "
                             f"identical {rows[-1]['identical']}")
    finally:
        a.stop()
        b.stop()
    from ..device import current

    return {"device": current().as_dict(), "model": resolve(model, progress=False).name, "rows": rows,
            "precopy_rate_mb_s": rate_mb_s or "host default", "lane": lane,
            "transfers": transfers, "targets": _targets(rows, transfers)}


def transfer(a: LoopbackHost, b: LoopbackHost, token: str, ck: Path, sid: str, n_ctx: int, reps: int) -> dict:
    """Raw KV transfer: a restored session not generating, moved stop-and-copy in
    raw mode, ``reps`` times on the lane and ``reps`` times on the gRPC stream
    (alternated, back and forth between A and B); each side's median rep by MB/s,
    each rep's figure listed. The rate is the KV's raw bytes over the time from the
    pause to the target's verified, landed restore (extract, encode, wire, land overlap)."""
    from ..sdk import Client
    from . import ceiling

    runs: dict[bool, list] = {True: [], False: []}
    src, dst = a, b
    s = Client(a.address, token).restore(ck, session_id=sid)
    try:
        for i in range(2 * reps):
            lane = i % 4 in (0, 3)  # lane, stream, stream, lane: each first as often
            m = Client(src.address, token).session(sid).migrate(to=dst.address, live=False, mode="raw", lane=lane)
            runs[lane].append({"transfer_mb_s": m.transfer_mb_s, "raw_kv_bytes": m.raw_kv_bytes,
                               "total_ms": round(m.seconds * 1000, 1), "phases_ms": m.phases_ms,
                               "transport": m.transport})
            src, dst = dst, src
    finally:
        try:
            Client(src.address, token).session(sid).close()
        except Exception:
            pass
    del s

    def median(rs: list) -> dict:
        return dict(sorted(rs, key=lambda r: r["transfer_mb_s"])[(len(rs) - 1) // 2])
    row, stream = median(runs[True]), median(runs[False])
    row.update(context=n_ctx, reps=len(runs[True]), transfer_mb_s_reps=[r["transfer_mb_s"] for r in runs[True]],
               transports=sorted({r["transport"] for r in runs[True]}),
               stream_mb_s=stream["transfer_mb_s"], stream_mb_s_reps=[r["transfer_mb_s"] for r in runs[False]],
               stream_phases_ms=stream["phases_ms"],
               lane_over_stream=round(row["transfer_mb_s"] / max(stream["transfer_mb_s"], 1e-9), 3))
    wire = ceiling.measure(row["raw_kv_bytes"], reps=max(3, reps))  # the same bytes over bare gRPC, same run
    bare_lane = ceiling.measure_lane(row["raw_kv_bytes"], reps=max(3, reps))  # and over a bare lane
    row.update(grpc_ceiling_mb_s=wire["mb_s"], grpc_ceiling_mb_s_reps=wire["reps"],
               transfer_over_ceiling=round(row["transfer_mb_s"] / max(wire["mb_s"], 1e-9), 3),
               lane_ceiling_mb_s=bare_lane["mb_s"], lane_ceiling_mb_s_reps=bare_lane["reps"],
               transfer_over_lane_ceiling=round(row["transfer_mb_s"] / max(bare_lane["mb_s"], 1e-9), 3))
    return row


def _one(a: LoopbackHost, b: LoopbackHost, token: str, ck: Path, sid: str, live: bool, n_ctx: int, reprefill_ms: float,
         generate: int, after: int, migrate_after: int, rate_mb_s: float = 0.0, lane: bool = True) -> dict:
    """Generate on A, migrate to B mid-reply, read ``after`` tokens more on B
    (the session object follows the migration: ``m.host`` turns to B)."""
    from ..sdk import Client

    ca = Client(a.address, token)
    m = ca.restore(ck, session_id=sid)
    twin = ca.restore(ck, session_id=sid + "t")
    stamps: list[float] = []
    got: list[int] = []
    handoff: list[int] = []  # index of the first token read from B

    def consume():
        for c in m.events("Continue the log."):
            if c.token < 0:
                break
            stamps.append(time.perf_counter())
            got.append(c.token)
            if m.host == b.address and not handoff:
                handoff.append(len(got) - 1)
                if len(stamps) > 1:  # the handoff gap's ends, on the host traces' clock (KVFERRY_STEP_TRACE)
                    mark("client_last_from_source", sid, stamps[-2])
                mark("client_first_from_target", sid, stamps[-1])
            if handoff and len(got) - handoff[0] >= after:
                break  # closing the stream; the session is closed below
    # The client is the stopwatch: no garbage collection pause of its own in a gap
    # (a full collection here took up to 32 ms).
    gc.collect()
    gc.disable()
    try:
        th = threading.Thread(target=consume)
        th.start()
        while len(stamps) < migrate_after and th.is_alive():
            time.sleep(0.005)
        t_mig = time.perf_counter()
        # raw, as every figure in docs/migration.md: mode auto would first send 16 MB unpaced to time the link
        mig = Client(a.address, token).session(sid).migrate(to=b.address, live=live, mode="raw",
                                                            rate_mb_s=rate_mb_s, lane=lane)
        th.join()
        # the landed turn would go on generating on B; stop it so the twin runs
        # with nothing else generating, as the migrated session ran before it
        m.close()
        ref, twin_stamps = [], []
        for c in twin.events("Continue the log."):
            if c.token < 0 or len(ref) == len(got):
                break
            ref.append(c.token)
            twin_stamps.append(time.perf_counter())
        gaps = [y - x for x, y in zip(stamps, stamps[1:])]
        idx = next(i for i, s in enumerate(stamps) if s >= t_mig)
        end = handoff[0] if handoff else len(stamps) - 1
        window = gaps[max(0, idx - 1): end]  # from the migration's start to the first token from B
        normal = statistics.median(gaps[:max(1, idx - 1)])
        # the noise floor: the unmigrated twin's worst gap over the same stretch of its reply
        tg = [y - x for x, y in zip(twin_stamps, twin_stamps[1:])]
        tw = tg[max(0, idx - 1): end] or tg
        tmed = statistics.median(tg) if tw else None
        pre = gaps[max(0, idx - 1): end - 1] if handoff else window  # the steps beside pre-copy
        return {"context": n_ctx, "mode": "live" if live else "stop-copy",
                "precopy_worst_gap_ms": round(max(pre) * 1000, 1) if pre else None,
                "precopy_worst_over_normal": round(max(pre) / normal, 2) if pre else None,
                "downtime_ms": round((max(window) - normal) * 1000, 1),
                "handoff_gap_ms": round(gaps[end - 1] * 1000, 1) if handoff else None,
                "handoff_over_normal_ms": round((gaps[end - 1] - normal) * 1000, 1) if handoff else None,
                "normal_gap_ms": round(normal * 1000, 1),
                "twin_worst_gap_over_median_ms": round((max(tw) - tmed) * 1000, 1) if tw else None,
                # the same ratio as precopy_worst_over_normal for the twin, which nothing disturbs
                "twin_worst_over_median": round(max(tw) / tmed, 2) if tw else None,
                "total_ms": round(mig.seconds * 1000, 1), "pause_ms": round(mig.pause_ms, 1),
                "bytes": mig.bytes, "raw_kv_bytes": mig.raw_kv_bytes, "phases_ms": mig.phases_ms,
                "transfer_mb_s": mig.transfer_mb_s, "transport": mig.transport,
                "reprefill_ms": round(reprefill_ms, 1), "identical": got == ref and len(got) > 0,
                "mid_reply": bool(handoff), "tokens": len(got),
                "gaps_ms": [round(g * 1000) for g in gaps], "migration_started_at": idx,
                "handoff_at": end}
    finally:
        gc.enable()
        for x in (m, twin):
            try:
                x.close()
            except Exception:
                pass


PER_REP = ("downtime_ms", "handoff_gap_ms", "handoff_over_normal_ms", "normal_gap_ms",
           "twin_worst_gap_over_median_ms", "total_ms", "pause_ms", "bytes", "migration_started_at",
           "handoff_at", "gaps_ms", "phases_ms", "precopy_worst_over_normal", "twin_worst_over_median")


def aggregate(runs: list[dict]) -> dict:
    """One row from the reps of a (context, mode): the median rep by ``downtime_ms``
    (the lower median for an even count, so the row is one real migration), with
    every rep's figures in ``*_reps``; ``identical``/``mid_reply`` must hold in all."""
    row = dict(sorted(runs, key=lambda r: r["downtime_ms"])[(len(runs) - 1) // 2])
    row["reps"] = len(runs)
    for k in PER_REP:
        row[f"{k}_reps"] = [r[k] for r in runs]
    row["downtime_ms_worst_rep"] = max(r["downtime_ms"] for r in runs)
    row["identical"] = all(r["identical"] for r in runs)
    row["mid_reply"] = all(r["mid_reply"] for r in runs)
    return row


def _targets(rows: list[dict], transfers: list[dict] = ()) -> dict:
    live = {r["context"]: r for r in rows if r["mode"] == "live"}
    stop = {r["context"]: r for r in rows if r["mode"] == "stop-copy"}
    out = {"identical_everywhere": all(r["identical"] for r in rows),
           "mid_reply_everywhere": all(r["mid_reply"] for r in rows),
           "live_downtime_max_ms": max((r["downtime_ms"] for r in live.values()), default=None),
           "live_downtime_worst_rep_ms": max((r["downtime_ms_worst_rep"] for r in live.values()),
                                             default=None)}
    for key in ("precopy_worst_over_normal", "twin_worst_over_median"):  # the worst live rep's
        out[f"live_{key}"] = max((x for r in live.values() for x in r[f"{key}_reps"] if x is not None), default=None)
    if live:
        lo, hi = min(live), max(live)
        out["live_downtime_ratio_largest_vs_smallest"] = round(
            live[hi]["downtime_ms"] / max(live[lo]["downtime_ms"], 1e-3), 2)
    mid = [c for c in stop if 1500 <= c <= 2600]
    if mid:
        r = stop[mid[0]]
        out["stop_copy_total_over_reprefill_at_2048"] = round(r["total_ms"] / r["reprefill_ms"], 4)
    if transfers:
        out["transfer_mb_s_min"] = min(t["transfer_mb_s"] for t in transfers)
        out["transfer_over_grpc_ceiling_min"] = min(t["transfer_over_ceiling"] for t in transfers)
        out["lane_over_stream_min"] = min(t["lane_over_stream"] for t in transfers)
    return out


def table(r: dict) -> str:
    """The human-readable form of :func:`run`'s result."""
    out = [f"device: {r['device']['backend']} ({r['device']['name']})", "",
           f"{'context':>8} {'raw transfer MB/s':>18} {'on the stream':>14} {'bare lane':>10} {'bare gRPC':>10} "
           f"{'extract':>8} {'encode':>8} {'wire':>8} {'land':>8} {'total ms':>9}"]
    for t in r["transfers"]:
        p = t["phases_ms"]
        out.append(f"{t['context']:>8} {t['transfer_mb_s']:>18} {t['stream_mb_s']:>14} {t['lane_ceiling_mb_s']:>10} "
                   f"{t['grpc_ceiling_mb_s']:>10} "
                   f"{p.get('extract', 0):>8.1f} {p.get('encode', 0):>8.1f} {p.get('wire', 0):>8.1f} "
                   f"{p.get('land', 0):>8.1f} {t['total_ms']:>9}")
    if r["rows"]:
        out += ["", f"{'context':>8} {'mode':>9} {'downtime ms':>12} {'worst rep':>10} {'handoff':>8} "
                    f"{'total ms':>9} {'re-prefill ms':>14} {'identical':>9}"]
        for x in r["rows"]:
            out.append(f"{x['context']:>8} {x['mode']:>9} {x['downtime_ms']:>12} {x['downtime_ms_worst_rep']:>10} "
                       f"{x['handoff_over_normal_ms']!s:>8} {x['total_ms']:>9} {x['reprefill_ms']:>14} "
                       f"{x['identical']!s:>9}")
    out += ["", "targets: " + ", ".join(f"{k} {v}" for k, v in r["targets"].items())]
    return "\n".join(out)


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ctxs = sorted({r["context"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in (("live", "o-"), ("stop-copy", "s-")):
        rs = [next(r for r in rows if r["context"] == c and r["mode"] == mode) for c in ctxs]
        ys = [r["downtime_ms"] for r in rs]
        # whiskers: the best and worst of the reps (a row is the median one)
        lo = [y - min(r["downtime_ms_reps"]) for y, r in zip(ys, rs)]
        hi = [max(r["downtime_ms_reps"]) - y for y, r in zip(ys, rs)]
        ax.errorbar(ctxs, ys, yerr=[lo, hi], fmt=style, capsize=3,
                    label=f"{mode} (median downtime; bars: best-worst rep)")
    rp = [next(r["reprefill_ms"] for r in rows if r["context"] == c) for c in ctxs]
    ax.plot(ctxs, rp, "^--", label="re-prefill on the target")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ctxs, [str(c) for c in ctxs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("pause seen by the client (ms)")
    ax.set_title(f"kvferry: moving a generating conversation ({result.get('model', 'SmolLM2')})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
