"""``kvferry bench serve``: a real ``kvferry serve`` under N concurrent SDK clients,
next to mlx-lm's ``BatchGenerator`` on the same model, prompts and lengths.

For each N, every client creates a session and runs one chat turn of ``tokens``
tokens (EOS ignored), all at once. A point reports the aggregate decode rate
(tokens over the wall time from the first send to the last token), TTFT and TPOT
percentiles over all clients, and ``mlx_lm_tps``: BatchGenerator generating the
same prompts' replies in this process, measured in the same run. Then, with
``long_with`` sessions decoding, one more client sends a ``long_prompt``-token
prompt: the decoders' TPOT p99 during it, against their p50 without it.

With ``trace_steps`` the served host writes its step trace
(``KVFERRY_STEP_TRACE``, docs/performance.md) and each point gets ``steps``: over
that point's full decode steps (rows for at least 3/4 of its own sessions, no
prompt chunk), medians of the time from one step to the next and of its parts:
the forward pass, the guests, and what is left between steps (the sessions
coming back).
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import statistics
import tempfile
import threading
import time

from ..device import current
from ..errors import KvferryError
from ..policy import BATCH_KV, HostPolicy
from .loopback import LoopbackHost

TOPICS = ["rivers", "mountains", "ferries", "lighthouses", "bridges", "islands", "harbours", "storms"]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


WARM, WARM_TOKENS = 10_000, 4  # a point's warm-up: its prompts' first index, and tokens a turn


def _prompt(i: int) -> str:
    return f"Tell me a long story about {TOPICS[i % len(TOPICS)]} number {i}."


def _turns(address: str, token: str, prompts: list[str], tokens: int) -> list[dict]:
    """One chat turn per prompt, all at once; per turn: send time and token times."""
    from ..sdk import Client

    sessions = [Client(address, token, timeout=600).create_session(max_tokens=tokens, ignore_eos=True)
                for _ in prompts]
    out: list[dict] = [{} for _ in prompts]
    go = threading.Barrier(len(prompts))

    failed: list[BaseException] = []

    def one(i: int) -> None:
        go.wait()
        t0 = time.perf_counter()
        try:
            times = [time.perf_counter() for c in sessions[i].events(prompts[i]) if c.token >= 0]
        except Exception as e:  # reported once all turns end: a point with a failed turn has no figure
            failed.append(e)
            return
        out[i] = {"sent": t0, "times": times, "session": sessions[i].id}
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for s in sessions:
        s.close()
    if failed:
        raise KvferryError(f"bench serve: {len(failed)} of {len(prompts)} turns failed; the first: {failed[0]}")
    return out


def _point(turns: list[dict]) -> dict:
    start = min(t["sent"] for t in turns)
    end = max(t["times"][-1] for t in turns if t["times"])
    n = sum(len(t["times"]) for t in turns)
    ttft = [(t["times"][0] - t["sent"]) * 1000 for t in turns if t["times"]]
    gaps = [(b - a) * 1000 for t in turns for a, b in zip(t["times"], t["times"][1:])]
    # vLLM's TPOT: a turn's decode time over its tokens after the first (the gaps above are
    # its ITL; with serve --stream-interval N they are 0 inside a message and N tokens' long between)
    per_turn = [(t["times"][-1] - t["times"][0]) * 1000 / (len(t["times"]) - 1) for t in turns if len(t["times"]) > 1]
    return {"sessions": len(turns), "tokens": n, "aggregate_tps": round(n / (end - start), 2),
            "ttft_ms_p50": round(_pct(ttft, 50), 1), "ttft_ms_p99": round(_pct(ttft, 99), 1),
            "tpot_ms_p50": round(_pct(gaps, 50), 2), "tpot_ms_p99": round(_pct(gaps, 99), 2),
            "turn_tpot_ms_p50": round(_pct(per_turn, 50), 2), "turn_tpot_ms_p99": round(_pct(per_turn, 99), 2)}


class StepTrace:
    """The served host's step trace, read one point at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="kvferry-steps-")
        self.read: dict[str, int] = {}  # file -> bytes already taken by earlier points

    def _new_lines(self) -> list[list[dict]]:
        """Each trace file's lines written since the last call (a host process's own steps)."""
        out = []
        for f in sorted(glob.glob(os.path.join(self.folder, "steps-*.jsonl"))):
            with open(f, "rb") as fh:
                fh.seek(self.read.get(f, 0))
                data = fh.read()
            done = data.rfind(b"\n") + 1  # a line still being written waits for the next point
            self.read[f] = self.read.get(f, 0) + done
            lines = []
            for line in data[:done].splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    continue
            out.append(lines)
        return out

    def point(self, turns: list[dict]) -> dict:
        """The steps since the last call that decoded most of ``turns``' sessions, summarised.
        By session, not by time: a step's line is written after its tokens are sent, so the
        warm-up's last one may land after the warm-up's turns have ended."""
        ids = {t["session"] for t in turns}
        full = []
        for a, b in ((a, b) for lines in self._new_lines() for a, b in zip(lines, lines[1:])):
            if sum(r[0] in ids for r in a["rows"]) * 4 >= len(ids) * 3 and not a["prompts"]:
                period = (b["t"] - a["t"]) * 1000
                full.append((period, a["forward_ms"], a["guests_ms"], period - a["forward_ms"] - a["guests_ms"],
                             len(a["rows"]), a.get("guessed", 0), a.get("ran_on", 0)))
        if not full:
            return {"full_steps": 0}
        med = [round(statistics.median(x[k] for x in full), 2) for k in range(5)]
        return {"full_steps": len(full), "period_ms_p50": med[0], "forward_ms_p50": med[1],
                "guests_ms_p50": med[2], "between_ms_p50": med[3], "rows_p50": med[4],
                "guessed_share": round(sum(x[5] for x in full) / sum(x[4] for x in full), 3),
                "ran_on_share": round(sum(x[6] for x in full) / sum(x[4] for x in full), 3)}

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def mlx_lm_tps(lm, prompts: list[str], tokens: int) -> float:
    """mlx-lm's BatchGenerator: the same chat prompts, ``tokens`` each, EOS ignored."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    ids = [list(lm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
           for p in prompts]

    def once(n_tokens: int) -> float:
        gen = BatchGenerator(lm.model, max_tokens=n_tokens, stop_tokens=[[-1]],
                             completion_batch_size=max(8, len(ids)), prefill_batch_size=len(ids))
        try:
            t0 = time.perf_counter()
            gen.insert(ids, [n_tokens] * len(ids))
            n = 0
            while responses := gen.next_generated():
                n += len(responses)
            mx.synchronize()
            return n / (time.perf_counter() - t0)
        finally:
            gen.close()
    once(4)  # warm-up: the kernels for this batch's shapes are compiled here, not timed
    return round(once(tokens), 2)


def _beside_long(srv: LoopbackHost, token: str, prompts: list[str], tokens: int,
                 filler: str) -> tuple[list[dict], dict]:
    """Turns of ``prompts`` with one more client sending ``filler`` half a second in:
    the decoders' turns, and the long turn's start, end and prompt tokens."""
    from ..sdk import Client

    long_done: dict = {}

    def long_turn() -> None:
        time.sleep(0.5)  # the decoders are running by then
        s = Client(srv.address, token, timeout=600).create_session(max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        "".join(s.send(filler))
        long_done.update(start=t0, end=time.perf_counter(), tokens=s.info()["tokens"])
        s.close()
    th = threading.Thread(target=long_turn)
    th.start()
    during = _turns(srv.address, token, prompts, tokens)
    th.join()
    return during, long_done


def _long_prompt(srv: LoopbackHost, token: str, tokens: int, long_prompt: int, long_with: int, progress) -> dict:
    """TPOT of ``long_with`` decoders while one more client sends a ``long_prompt``-token
    prompt, against their p50 without it."""
    progress(f"kvferry serve: {long_with} decoding while one client sends a {long_prompt}-token prompt")
    # the same scenario untimed first, with prompts and a filler of its own (nothing left
    # cached for the timed one): a GPU compiles the prefill chunks' kernels here, beside
    # running decoders, as the points' warm-ups do for theirs
    def filler(sentence: str) -> str:  # a seven-word sentence: ~long_prompt tokens in all
        return " ".join([sentence] * (long_prompt // 8))
    _beside_long(srv, token, [_prompt(2 * WARM + i) for i in range(long_with)], tokens,
                 filler("A ferry left the harbour at dusk."))
    decoders = [_prompt(i) for i in range(long_with)]
    base = _point(_turns(srv.address, token, decoders, tokens))
    during, long_done = _beside_long(srv, token, decoders, tokens, filler("The ferry crossed the strait at dawn."))
    w0, w1 = long_done.get("start", 0.0), long_done.get("end", 0.0)
    gaps = [(b - a) * 1000 for t in during for a, b in zip(t["times"], t["times"][1:])
            if b >= w0 and a <= w1]  # the decoders' steps that overlapped the long prefill
    long = {"decoders": long_with, "prompt_tokens": long_done.get("tokens"),
            "tpot_ms_p50_without": base["tpot_ms_p50"], "tpot_ms_p99_during": round(_pct(gaps, 99) or 0, 2),
            "prefill_s": round(long_done.get("end", 0) - long_done.get("start", 0), 2)}
    long["ratio_p99_during_over_p50_without"] = round(long["tpot_ms_p99_during"] / base["tpot_ms_p50"], 2)
    progress(f"  {long}")
    return long


def run(model: str | None = None, sessions: tuple[int, ...] = (1, 4, 8), tokens: int = 64,
        long_prompt: int = 2000, long_with: int = 4, progress=print, http: bool = False,
        ttft_samples: int = 20, batch_kv: str = "auto", guest_thread: str = "auto",
        prefix_cache_mb: float | None = None, prefill_thread: str = "auto", speculate: str = "auto",
        stream_interval: int = 1, max_batch: int | None = None, trace_steps: bool = False) -> dict:
    from ..collector import freeze
    from ..models import load

    token = secrets.token_urlsafe(16)
    trace = StepTrace() if trace_steps else None
    srv = None
    points = []
    http_vs_grpc = None
    try:
        srv = LoopbackHost(token, *(["--model", model] if model else []), *(["--http-port", "0"] if http else []),
                           "--batch-kv", batch_kv, "--guest-thread", guest_thread, "--prefill-thread", prefill_thread,
                           "--speculate", speculate, "--stream-interval", str(stream_interval),
                           *(["--prefix-cache-mb", f"{prefix_cache_mb:g}"] if prefix_cache_mb is not None else []),
                           *(["--max-batch", str(max_batch)] if max_batch is not None else []),
                           env={"KVFERRY_STEP_TRACE": trace.folder} if trace else None)
        if http:
            from .http import compare

            progress(f"HTTP against gRPC: TTFT (median of {ttft_samples}) and {max(sessions)} concurrent streams")
            http_vs_grpc = compare(srv.address, srv.http, token, ttft_samples, max(sessions), tokens)
        freeze()  # this client's own full collections (50-70 ms here) would read as the host's slow tokens
        for n in sessions:
            progress(f"kvferry serve: {n} concurrent sessions x {tokens} tokens")
            # warm-up at this batch's shape, as mlx-lm's column gets one (mlx_lm_tps): a GPU
            # compiles the kernels for n rows here, not in the timed turns. Prompts of their
            # own, so the timed ones do not start from a prefix the warm-up left cached.
            _turns(srv.address, token, [_prompt(WARM + i) for i in range(n)], WARM_TOKENS)
            timed = _turns(srv.address, token, [_prompt(i) for i in range(n)], tokens)
            points.append(_point(timed))
            if trace:
                points[-1]["steps"] = trace.point(timed)
            progress(f"  {points[-1]}")  # as it goes: a run cut short still reports what it measured
        long = _long_prompt(srv, token, tokens, long_prompt, long_with, progress) if long_prompt else None
    finally:
        if srv is not None:
            srv.stop()
        if trace:  # (also when the host did not start)
            trace.close()
    progress("mlx-lm BatchGenerator, same prompts and lengths")
    lm = load(model, progress=False)
    for p in points:
        p["mlx_lm_tps"] = mlx_lm_tps(lm, [_prompt(i) for i in range(p["sessions"])], tokens)
        progress(f"  mlx-lm at {p['sessions']}: {p['mlx_lm_tps']} tok/s")
    from .consistency import consistency

    n = max(p["sessions"] for p in points)
    ids = [list(lm.tokenizer.apply_chat_template([{"role": "user", "content": _prompt(i)}],
                                                 add_generation_prompt=True)) for i in range(n)]
    shared = BATCH_KV[batch_kv] is not False  # the served layout (auto: shared)
    agree = consistency(lm.model, ids, min(tokens, 32), shared=shared)
    one = points[0]["aggregate_tps"] if points and points[0]["sessions"] == 1 else None
    for p in points:
        p["speedup_over_one"] = round(p["aggregate_tps"] / one, 2) if one else None
        p["ratio_to_mlx_lm"] = round(p["aggregate_tps"] / p["mlx_lm_tps"], 3) if p["mlx_lm_tps"] else None
    return {"model": lm.name, "tokens_per_turn": tokens, "points": points, "long_prompt": long,
            "consistency": agree, "batching": True, "batch_kv": batch_kv,
            "guest_thread": guest_thread, "prefill_thread": prefill_thread, "speculate": speculate,
            "stream_interval": stream_interval, "max_batch": max_batch, "trace_steps": trace_steps,
            "device": current().as_dict(),
            "prefix_cache_mb": HostPolicy.prefix_cache_bytes / 1e6 if prefix_cache_mb is None else prefix_cache_mb,
            **({"http_vs_grpc": http_vs_grpc} if http else {})}


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["sessions"] for p in r["points"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(xs, [p["aggregate_tps"] for p in r["points"]], "o-", label="kvferry serve")
    a.plot(xs, [p["mlx_lm_tps"] for p in r["points"]], "s--", label="mlx-lm BatchGenerator")
    a.set(xlabel="concurrent sessions", ylabel="aggregate tokens/s", title="throughput")
    a.legend()
    b.plot(xs, [p["tpot_ms_p99"] for p in r["points"]], "o-", label="kvferry TPOT p99")
    b.plot(xs, [p["tpot_ms_p50"] for p in r["points"]], "o:", label="kvferry TPOT p50")
    b.set(xlabel="concurrent sessions", ylabel="ms per output token", title="latency")
    b.legend()
    fig.suptitle(f"{r['model']}, {r['tokens_per_turn']} tokens per turn")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
