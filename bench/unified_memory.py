"""What a batch of KV costs to cross between an MLX CUDA array and the host, by path.

    python bench/unified_memory.py [--mb 178] [--reps 4] [--json]

MLX CUDA computes in device memory and moves an array the host reads into
managed memory, whose pages then follow whoever touches them. A migration reads
batches of KV copies on the source (up to 64 MB) and lands token ranges on the
target (kvferry.checkpoint.unified). Timed, the median of ``--reps``, on a buffer
of ``--mb`` megabytes (178 MB is SmolLM2's KV at 7,749 tokens):

- ``read_plain_ms``: ``np.array`` of an evaluated device array (the read before
  stop 61); ``read_prefetched_ms``: kvferry's read (pages to the host in one
  prefetch, copied, sent back);
- ``next_kernel_after_*_ms``: a kernel whose output is the size of that buffer,
  right after it was freed (MLX's cache hands it back, pages wherever the read
  left them);
- ``land_plain_ms`` / ``land_prefetched_ms``: host bits made an MLX array, then
  the first kernel that reads them (kvferry.checkpoint.mlxbits.mx_from_bits
  without and with ``device``).

On a CPU every prefetch is a no-op and the pairs measure the same thing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(mb: float, reps: int) -> dict:
    from kvferry.checkpoint import kv_extract, unified  # kvferry first: it picks the BLAS
    from kvferry.checkpoint.mlxbits import mx_from_bits
    from kvferry.device import current

    import mlx.core as mx
    import numpy as np

    n = int(mb * 2**20) // 2
    base = mx.random.randint(0, 60000, (n,), dtype=mx.uint16)
    mx.eval(base)

    def device_batch():  # a fresh device buffer, as extraction's concatenation makes one
        flat = mx.concatenate([base[: n // 2], base[n // 2:]])
        mx.eval(flat)
        return flat

    times: dict[str, list[float]] = {}

    def timed(key: str, fn):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(key, []).append((time.perf_counter() - t0) * 1000)
        return out

    want = np.array(base[:4096])
    for _ in range(reps):
        for name, read in (("plain", np.array), ("prefetched", kv_extract.read_device)):
            flat = device_batch()
            data = timed(f"read_{name}_ms", lambda f=flat: read(f))
            assert np.array_equal(data.view(np.uint16)[:4096], want)
            del flat, data
            timed(f"next_kernel_after_{name}_ms", lambda: mx.eval(device_batch()))
    host = np.array(base)
    for _ in range(reps):
        for name, up in (("plain", False), ("prefetched", True)):
            def land():
                a = mx_from_bits(host, "bfloat16", up)
                mx.eval(a * 2)
            timed(f"land_{name}_ms", land)
    out = {k: round(statistics.median(v), 2) for k, v in times.items()}
    for k in ("read", "land"):
        out[f"{k}_prefetched_gb_s"] = round(n * 2 / 1e9 / (out[f"{k}_prefetched_ms"] / 1000), 2)
        out[f"{k}_plain_gb_s"] = round(n * 2 / 1e9 / (out[f"{k}_plain_ms"] / 1000), 2)
    return {"mb": mb, "reps": reps, "prefetch": unified._runtime() is not None, **out,
            "samples_ms": {k: [round(x, 2) for x in v] for k, v in times.items()},
            "device": current().as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=178.0)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = measure(a.mb, a.reps)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"{a.mb:.0f} MB on {r['device'].get('name')}, prefetch {'on' if r['prefetch'] else 'unavailable'}")
    for k in ("read", "next_kernel_after", "land"):
        print(f"  {k:18} plain {r[f'{k}_plain_ms']:8.2f} ms   prefetched {r[f'{k}_prefetched_ms']:8.2f} ms")


if __name__ == "__main__":
    main()
