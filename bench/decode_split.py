"""Where a bare mlx-lm decode step's time goes: building its graph, then waiting for it.

    python bench/decode_split.py [MODEL ...] [--steps 200] [--json]

For each model (a name in kvferry's model store or a directory; default
SmolLM2-135M-Instruct), one token at a time after a 100-token prompt, each step
synchronous: the Python that builds the forward pass (``model(x, cache)``, no
evaluation) and then ``mx.eval`` of its logits, medians. When the sum is longer
than mlx-lm's own pipelined step (``bench overhead``'s bare decode), the device
ran part of it beside the host; when the build and the launch inside ``eval``
already fill mlx-lm's step, decode is bound by the host's Python, and every
further microsecond of host work a token (a guest's sampling, a scheduler's
bookkeeping) shows in tokens/s. docs/performance-log.md ("Guest overhead") has the
H200 figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def split(model_name: str | None, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvferry.models import load

    lm = load(model_name, progress=False)
    model = lm.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 100]), cache=cache))
    build, wait = [], []
    for _ in range(steps + 10):
        t0 = time.perf_counter()
        out = model(mx.array([[5]]), cache=cache)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        wait.append(t2 - t1)
    build, wait = build[10:], wait[10:]  # after the kernels are compiled
    b, w = statistics.median(build) * 1e3, statistics.median(wait) * 1e3
    return {"model": lm.name, "dtype": lm.dtype, "weights": lm.weights, "steps": steps,
            "build_ms_p50": round(b, 3), "eval_wait_ms_p50": round(w, 3), "step_ms_p50": round(b + w, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=[None], help="model names or directories")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per model")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import kvferry  # noqa: F401  (the BLAS and the CUDA attention settings first)
    from kvferry.device import current

    rows = [split(m, a.steps) for m in a.models]
    if a.json:
        print(json.dumps({"device": current().as_dict(), "rows": rows}, indent=1))
        return
    for r in rows:
        print(f"{r['model']}: build {r['build_ms_p50']} ms + eval wait {r['eval_wait_ms_p50']} ms "
              f"= {r['step_ms_p50']} ms a synchronous step (p50 of {r['steps']})")


if __name__ == "__main__":
    main()
