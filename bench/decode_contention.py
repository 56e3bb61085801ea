"""What slows a decode step while another thread of the same process works?

    python bench/decode_contention.py [--steps 150] [--host-logits] [--only CASE ...] [--json]

One thread runs decode steps of 4 rows (SmolLM2 as this device's policy loads
it) and times each; another thread, in turn, does nothing, prefills 128-token
chunks (what ``serve --prefill-thread`` does), multiplies two 8192x8192 float16
matrices (GPU work, few launches; 1024x1024 float32 on a CPU), spins in pure Python (GIL only), or runs
graphs of 600 tiny ops (launches, no work). Then the prefill and the Python spin
again with a 0.5 ms GIL switch interval instead of CPython's 5 ms. The numbers in
docs/performance-log.md ("The prefill thread") came from it on an H200.
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
    ap.add_argument("--steps", type=int, default=150, help="timed decode steps per figure")
    ap.add_argument("--host-logits", action="store_true",
                    help="read each row's logits on the host after a step, as served guests do")
    ap.add_argument("--only", nargs="+", help="only these cases (nothing prefill matmul python launches)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import kvferry  # noqa: F401  (the BLAS and the CUDA attention settings first)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from kvferry.device import current
    from kvferry.models import load

    model = load(None, progress=False).model
    stop = threading.Event()

    def caches():
        c = [KVCache() for _ in model.layers]
        model(mx.array([[5] * 64] * 4), cache=c)
        mx.eval([x.state for x in c])
        return c

    def decode(n: int) -> list[float]:
        c, tok, out = caches(), mx.array([[7]] * 4), []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = model(tok, cache=c)
            if a.host_logits:  # float32 rows a guest's kv_logits reads through numpy
                rows = logits[:, -1].astype(mx.float32)
                mx.eval(rows)
                for i in range(rows.shape[0]):
                    np.array(rows[i], copy=False).argmax()
            else:
                mx.eval(logits)
            out.append((time.perf_counter() - t0) * 1e3)
            if c[0].offset > 1500:
                c = caches()
        return out

    def prefill() -> None:
        while not stop.is_set():
            c = [KVCache() for _ in model.layers]
            for _ in range(16):
                if stop.is_set():
                    break
                model.model(mx.array([[9] * 128]), cache=c)
                mx.eval([x.state for x in c])

    def matmul() -> None:
        gpu = current().is_gpu  # (a CPU multiplies float16 slowly: a smaller float32 one there)
        m = mx.random.normal((8192, 8192) if gpu else (1024, 1024)).astype(mx.float16 if gpu else mx.float32)
        while not stop.is_set():
            mx.eval(m @ m)

    def python() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    def launches() -> None:
        one = mx.ones((16,))
        while not stop.is_set():
            b = one
            for _ in range(600):
                b = b * 1.0001
            mx.eval(b)

    def measure(label: str, work) -> dict:
        decode(30)  # warm
        stop.clear()
        th = threading.Thread(target=work) if work else None
        if th:
            th.start()
            time.sleep(0.3)
        out = decode(a.steps)
        stop.set()
        if th:
            th.join()
        out.sort()
        row = {"beside": label, "switch_interval_ms": sys.getswitchinterval() * 1e3,
               "p50_ms": round(statistics.median(out), 2), "p90_ms": round(out[int(0.9 * len(out))], 2),
               "max_ms": round(out[-1], 2)}
        if not a.json:
            print(f"{label:10s} switch {row['switch_interval_ms']:.1f} ms: decode step p50 {row['p50_ms']:6.2f}"
                  f"  p90 {row['p90_ms']:6.2f}  max {row['max_ms']:6.2f} ms", flush=True)
        return row

    cases = [(label, w) for label, w in [("nothing", None), ("prefill", prefill), ("matmul", matmul),
                                         ("python", python), ("launches", launches)]
             if not a.only or label in a.only]
    rows = [measure(label, w) for label, w in cases]
    sys.setswitchinterval(0.0005)
    rows += [measure(label, w) for label, w in cases if label in ("prefill", "python")]
    if a.json:
        print(json.dumps({"device": current().as_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
