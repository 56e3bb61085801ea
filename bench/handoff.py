"""Where a live migration's handoff went, from a handoff trace.

    KVFERRY_STEP_TRACE=DIR kvferry bench migrate --json --contexts 2048 --modes live ...
    python bench/handoff.py DIR [--json]

With ``KVFERRY_STEP_TRACE`` set, every process of the run (the bench's client and
both hosts) appends its handoff events to ``DIR/handoff-PID.jsonl`` and the hosts
their steps to ``DIR/steps-PID.jsonl``, all on one clock (CLOCK_MONOTONIC). For each
migrated session (``m<context>l<rep>``) this lines them up from the client's last
token from the source (0 ms) to its first from the target: the source's pause and
its last frames, the target's landing, prepare and adoption, the commit, the client
told where to go and following there, and the target's first steps.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

# spans of the handoff gap, each from the event before it (the first from the client's last token)
SPANS = (("pause", "source_paused"), ("last_delta", "source_final_frame1"),
         ("small_state", "source_sent"), ("land_prepare", "target_prepared"),
         ("restored_ack", "source_restored"), ("commit", "source_committed"),
         ("first_token", "target_first_token"), ("to_client", "client_first_from_target"))


def _lines(pattern: str) -> list[dict]:
    out = []
    for f in sorted(glob.glob(pattern)):
        pid = f.rsplit("-", 1)[1].split(".")[0]
        for line in open(f):
            try:
                out.append({**json.loads(line), "pid": pid})
            except ValueError:  # a line cut short by a killed host
                continue
    return out


def handoffs(folder: str) -> list[dict]:
    """One record a migrated session: its events in ms from the client's last token
    from the source, the spans between them, and the target's first step."""
    events = _lines(str(Path(folder) / "handoff-*.jsonl"))
    steps = _lines(str(Path(folder) / "steps-*.jsonl"))
    out = []
    for sid in sorted({e["session"] for e in events if e["event"] == "client_first_from_target"}):
        t = {e["event"]: e["t"] for e in events if e["session"] == sid}
        if "client_last_from_source" not in t:
            continue
        t0 = t["client_last_from_source"]
        at = {k: round((v - t0) * 1e3, 2) for k, v in sorted(t.items(), key=lambda kv: kv[1])}
        spans, prev = {}, 0.0
        for name, event in SPANS:
            if event in at:
                spans[name], prev = round(at[event] - prev, 2), at[event]
        first = next((s for s in sorted(steps, key=lambda s: s["t"])
                      if s["t"] >= t.get("target_adopted", t0) and any(r[0] == sid for r in s.get("rows", []))), None)
        out.append({"session": sid, "gap_ms": at["client_first_from_target"], "events_ms": at, "spans_ms": spans,
                    "target_first_step": None if first is None else
                    {k: first[k] for k in ("forward_ms", "guests_ms", "join_ms", "guessed") if k in first}})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="the KVFERRY_STEP_TRACE folder of a bench migrate run")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    rows = handoffs(args.folder)
    if args.json:
        print(json.dumps({"handoffs": rows}, indent=2))
        return
    if not rows:
        print(f"no handoff in {args.folder} (was KVFERRY_STEP_TRACE set for the bench?)")
        return
    names = [n for n, _ in SPANS]
    print(f"{'session':>10} {'gap':>6} " + " ".join(f"{n:>12}" for n in names) + "  first step forward")
    for r in rows:
        step = r["target_first_step"] or {}
        print(f"{r['session']:>10} {r['gap_ms']:6.1f} " + " ".join(f"{r['spans_ms'].get(n, float('nan')):12.2f}"
                                                          for n in names) + f"  {step.get('forward_ms', '-')}")
    print(f"{'median':>10} {statistics.median(r['gap_ms'] for r in rows):6.1f} " + " ".join(
        f"{statistics.median([r['spans_ms'][n] for r in rows if n in r['spans_ms']] or [float('nan')]):12.2f}"
        for n in names))


if __name__ == "__main__":
    main()
