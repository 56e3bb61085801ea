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

Where the CUDA runtime is reached (``copy_engine``), the same megabytes as a
SmolLM2-shaped cache (60 rooms of [1, 3, 8192, 64] float16, or fewer) also cross
by the copy engine (kvferry.checkpoint.unified.read and land), a batch of up to
64 MB at a time:

- ``engine_read_{fresh,kept_pinned,kept_pageable}_ms``: read into fresh numpy
  buffers, into kept page-locked blocks (kvferry.checkpoint.host_blocks, what a
  migration's source uses), into kept pageable ones; ``*_cold_ms`` is the first
  rep, which fills the blocks;
- ``engine_land_{pageable,pinned}_ms``: landed from pageable host memory (a lane's
  buffers) or page-locked memory.

On a CPU every prefetch is a no-op and the pairs measure the same thing; the copy
engine's rows are absent.
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
    if unified.available():
        _copy_engine(mb, reps, timed)
    out = {k: round(statistics.median(v), 2) for k, v in times.items()}
    for k in ("read", "land"):
        out[f"{k}_prefetched_gb_s"] = round(n * 2 / 1e9 / (out[f"{k}_prefetched_ms"] / 1000), 2)
        out[f"{k}_plain_gb_s"] = round(n * 2 / 1e9 / (out[f"{k}_plain_ms"] / 1000), 2)
    return {"mb": mb, "reps": reps, "prefetch": unified._runtime() is not None,
            "copy_engine": unified.available(), **out,
            "samples_ms": {k: [round(x, 2) for x in v] for k, v in times.items()},
            "device": current().as_dict()}


def _copy_engine(mb: float, reps: int, timed) -> None:
    """The copy engine's rows (see the module's doc), into ``timed``'s samples."""
    import mlx.core as mx
    import numpy as np

    from kvferry.checkpoint import host_blocks, unified
    from kvferry.checkpoint.mlxbits import mx_bits_lazy

    shape, batch = (1, 3, 8192, 64), host_blocks.BLOCK_BYTES
    side = int(np.prod(shape)) * 2  # float16
    rooms = [mx.full(shape, i, mx.float16) for i in range(max(1, min(60, int(mb * 2**20) // side)))]
    mx.eval(rooms)
    views = [np.array(mx_bits_lazy(r)[0], copy=False) for r in rooms]
    per = max(1, batch // side)

    def read(take) -> list:
        out = []
        for j in range(0, len(views), per):
            host = take(min(per, len(views) - j) * side)
            for q, v in enumerate(views[j:j + per]):
                part = host[q * side:(q + 1) * side].view(np.uint16).reshape(shape)
                assert unified.read(v, 0, part)
                out.append(part)
        return out
    for name, take in (("fresh", lambda n: np.empty(n, np.uint8)),
                       ("kept_pinned", host_blocks.HostBlocks().take),
                       ("kept_pageable", host_blocks.HostBlocks(pin=False).take)):
        for rep in range(reps + 1):
            got = timed(f"engine_read_{name}_{'cold_' if rep == 0 else ''}ms", lambda t=take: read(t))
            assert all(int(g[0, 1, 7, 3]) == int(np.float16(i).view(np.uint16)) for i, g in enumerate(got))
            del got
    pinned = host_blocks.HostBlocks(block=side, cap=side)
    for name, src in (("pageable", np.full(shape, 7, np.uint16)), ("pinned", pinned.take(side).view(np.uint16))):
        src = src.reshape(shape)
        for _ in range(reps):
            timed(f"engine_land_{name}_ms", lambda s=src: [unified.land(v, s, 0) for v in views])


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
    for k, v in r.items():
        if k.startswith("engine_"):
            print(f"  {k:32} {v:8.2f} ms")


if __name__ == "__main__":
    main()
