"""What a host read of each step's logits costs a pipelined decode.

    python bench/host_read.py [MODEL ...] [--steps 300] [--reps 2] [--json]

For each model (a name in kvferry's model store or a directory; default
SmolLM2-135M-Instruct), mlx-lm's order of a greedy decode: step n+1 is built and
queued (``mx.async_eval``) before step n's token is read. Three ways to read what
a greedy sampler needs, each timed per token (median):

- ``bare``: the device's argmax only (mlx-lm's own loop);
- ``read``: also the row's float32 logits on the host, as a guest answered from
  them would (numpy's argmax over ``np.array(logits, copy=False)``);
- ``top1``: the (argmax, max) pair computed in the step's graph and read as 8
  bytes, as kvferry's scheduler now does for greedy guests (kvferry.top1).

On MLX CUDA an array's first host read copies its device buffer into unified
memory; on the CPU the read is free. docs/performance-log.md has the H200 figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("bare", "read", "top1")


def decode(model, variant: str, steps: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from kvferry.top1 import StepTop1

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 100]), cache=cache))

    def step(tok):
        logits = model(tok.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32)
        top = StepTop1([logits])
        return logits, top, top.ids[0]

    logits, top, tok = step(mx.array(5))
    mx.async_eval(logits, top.pairs)
    per_token, reads = [], []
    last = time.perf_counter()
    for i in range(steps + 20):
        n_logits, n_top, n_tok = step(tok)
        mx.async_eval(n_logits, n_top.pairs)
        t = tok.item()
        r0 = time.perf_counter()
        if variant == "read":
            assert int(np.argmax(np.array(logits, copy=False))) == t
        elif variant == "top1":
            assert top.row(0)[0] == t
        r1 = time.perf_counter()
        logits, top, tok = n_logits, n_top, n_tok
        now = time.perf_counter()
        if i >= 20:  # after the kernels are compiled
            per_token.append(now - last)
            reads.append(r1 - r0)
        last = now
    return {"variant": variant, "ms_per_token_p50": round(statistics.median(per_token) * 1e3, 3),
            "read_ms_p50": round(statistics.median(reads) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=[None], help="model names or directories")
    ap.add_argument("--steps", type=int, default=300, help="timed tokens per run")
    ap.add_argument("--reps", type=int, default=2, help="runs of each variant, interleaved")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import kvferry  # noqa: F401  (the BLAS and the CUDA attention settings first)
    from kvferry.device import current
    from kvferry.models import load

    rows = []
    for name in a.models:
        lm = load(name, progress=False)
        for rep in range(a.reps):
            for v in VARIANTS:
                rows.append({"model": lm.name, "rep": rep, **decode(lm.model, v, a.steps)})
                if not a.json:
                    r = rows[-1]
                    print(f"{r['model']} rep {rep} {v:>5}: {r['ms_per_token_p50']} ms a token "
                          f"(its read {r['read_ms_p50']} ms)", flush=True)
    if a.json:
        print(json.dumps({"device": current().as_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
