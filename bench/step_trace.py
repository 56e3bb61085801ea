"""How a live migration's pre-copy disturbed its session, from a step trace.

    KVFERRY_STEP_TRACE=DIR kvferry bench migrate --json --contexts 2048 ...
    python bench/step_trace.py DIR [--skip 9] [--json]

``bench migrate`` names each live-migrated session ``m<context>l<rep>`` and its
unmigrated twin the same plus ``t``; both run on the source host, the twin after
the migration, alone. For each context this pools, over the reps, the migrated
session's steps on the source after the first ``--skip`` (its prompt and the
tokens before the migration starts: what is left ran beside pre-copy) and the
twin's steps at the same indices. It prints the period between steps and the
trace's ``forward_ms``, ``guests_ms``, ``lock_ms`` and ``gc_ms``, p50 / p90 / max.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from collections import defaultdict
from pathlib import Path

FIELDS = ("period", "forward_ms", "guests_ms", "lock_ms", "gc_ms")


def _steps(folder: str) -> dict[str, dict[str, list[dict]]]:
    """trace file -> session -> its steps (t and the step's timings), in order."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for f in sorted(glob.glob(str(Path(folder) / "steps-*.jsonl"))):
        for line in open(f):
            try:
                d = json.loads(line)
            except ValueError:  # a line cut short by a killed host
                continue
            for sid, _ in d.get("rows", []):
                out[f][sid].append(d)
    return out


def _figures(steps: list[dict]) -> dict[str, list[float]]:
    f = {"period": [(b["t"] - a["t"]) * 1e3 for a, b in zip(steps, steps[1:])]}
    for k in FIELDS[1:]:
        f[k] = [s[k] for s in steps[1:] if k in s]  # gc_ms: not in traces older than it
    return f


def _pct(xs: list[float]) -> list[float]:
    xs = sorted(xs)
    return [round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) for q in (0.5, 0.9)] + [round(xs[-1], 2)] if xs else []


def summarize(folder: str, skip: int = 9) -> dict[int, dict]:
    pooled: dict = defaultdict(lambda: {"migrated": defaultdict(list), "twin": defaultdict(list)})
    for by in _steps(folder).values():
        for sid, st in by.items():
            m = re.fullmatch(r"m(\d+)l(\d+)", sid)
            if not m or sid + "t" not in by:
                continue
            n = len(st)
            row = pooled[int(m.group(1))]
            for side, steps in (("migrated", st[skip - 1:n]), ("twin", by[sid + "t"][skip - 1:n])):
                for k, v in _figures(steps).items():
                    row[side][k] += v
    return {ctx: {side: {k: _pct(v) for k, v in figs.items()} | {"steps": len(figs["period"])}
                  for side, figs in row.items()} for ctx, row in sorted(pooled.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="the KVFERRY_STEP_TRACE folder of a bench migrate run")
    ap.add_argument("--skip", type=int, default=9, help="steps before pre-copy (prompt + bench migrate's 8 tokens)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = summarize(a.folder, a.skip)
    if a.json:
        print(json.dumps(out, indent=1))
        return
    if not out:
        raise SystemExit(f"step_trace: no live-migrated session with its twin in {a.folder}")
    for ctx, row in out.items():
        for side in ("migrated", "twin"):
            r = row[side]
            print(f"{ctx:>6} {side:<8} steps {r['steps']:>4}  " + "  ".join(
                f"{k} {'/'.join(map(str, r[k])) or '-'}" for k in FIELDS) + "  (ms, p50/p90/max)")


if __name__ == "__main__":
    main()
