"""Does copying KV out of a generating session slow its decode steps?

    python bench/precopy_contention.py [--steps 200] [--context 2048] [--json]

One thread decodes one row of a ``context``-token SmolLM2 session (as this
device's policy loads it) and times each step. Another thread copies the
session's KV out in 1.5 MB pieces, as live pre-copy does, either by numpy
straight from the cache's buffer, or after an MLX copy of the piece into a
buffer of its own. The question on a GPU: does numpy reading CUDA unified memory
move the cache's pages, so that the next step waits for them? On an H200 it did
not (docs/performance-log.md, the 2026-12-02 migration table's notes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per figure")
    ap.add_argument("--context", type=int, default=2048, help="tokens in the session's cache")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import kvferry  # noqa: F401  (the BLAS and the CUDA attention settings first)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from kvferry.device import current
    from kvferry.models import load

    model = load(None, progress=False).model
    cache = [KVCache() for _ in model.layers]
    for at in range(0, a.context, 512):
        model(mx.array([[5] * min(512, a.context - at)]), cache=cache)
        mx.eval([c.state for c in cache])
    lock = threading.Lock()  # the host's compute lock
    stop = threading.Event()
    chunk = max(16, (3 << 19) // (cache[0].keys.shape[1] * cache[0].keys.shape[3] * cache[0].keys.dtype.size))

    def copier(device_copy: bool) -> None:
        while not stop.is_set():
            for c in cache:
                for t in range(0, a.context, chunk):
                    if stop.is_set():
                        return
                    with lock:
                        k = c.keys[..., t:t + chunk, :]
                        if device_copy:
                            k = mx.contiguous(k)
                            mx.eval(k)
                        np.array(k.view(mx.uint16) if k.dtype in (mx.float16, mx.bfloat16) else k)
                    time.sleep(0.002)

    def decode(n: int) -> list[float]:
        tok, out = mx.array([[7]]), []
        for _ in range(n):
            t0 = time.perf_counter()
            with lock:
                mx.eval(model(tok, cache=cache))
                for c in cache:  # stay at the same context: the step writes in place
                    c.offset -= 1
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def figure(label: str, beside) -> dict:
        stop.clear()
        th = threading.Thread(target=beside, daemon=True) if beside else None
        if th:
            th.start()
        decode(10)
        ms = sorted(decode(a.steps))
        stop.set()
        if th:
            th.join()
        r = {"beside": label, "p50_ms": round(statistics.median(ms), 2),
             "p90_ms": round(ms[int(0.9 * len(ms))], 2), "max_ms": round(ms[-1], 2)}
        if not a.json:
            print(f"{label:32s} p50 {r['p50_ms']:7.2f}  p90 {r['p90_ms']:7.2f}  max {r['max_ms']:7.2f} ms")
        return r

    rows = [figure("nothing", None),
            figure("numpy from the cache", lambda: copier(False)),
            figure("MLX copy, then numpy", lambda: copier(True)),
            figure("nothing (again)", None)]
    if a.json:
        print(json.dumps({"device": current().as_dict(), "context": a.context, "rows": rows}))


if __name__ == "__main__":
    main()
