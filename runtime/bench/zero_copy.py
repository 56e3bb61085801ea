"""``kvferry bench zero-copy``: the seed's table, reproduced.

A guest's memory exposed to MLX in place (zero-copy) against the copy path
(guest bytes copied into a fresh MLX array, the result copied back), in one run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from ..guests import GUESTS_DIR

REGION = 16 << 20


def rss_bytes() -> int:
    """Current resident set size of this process."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True, text=True)
    return int(out.stdout.strip()) * 1024


def run(n: int = 128, reps: int = 100) -> dict:
    import mlx.core as mx

    from ..abi import V1
    from ..guest import GuestEngine, GuestLimits

    engine = GuestEngine(V1)
    guest = engine.instantiate(engine.compile(GUESTS_DIR / "gemm.wasm"), "gemm",
                               GuestLimits(memory_cap=32 << 20))
    try:
        # 1. pointer identity: wasmtime's memory base is the MLX buffer's address
        identity = guest.base_address() == guest.arena.ptr == int(
            np.array(guest.arena.array, copy=False).ctypes.data)
        # an MLX view of guest bytes has the guest's own address
        view_identity = int(np.array(guest.view(0, mx.uint8, (64,)), copy=False).ctypes.data) == guest.arena.ptr

        # 2. RSS delta from exposing a 16 MB guest region to MLX
        off = guest.call("region_fill", REGION)
        if off == 0:
            raise RuntimeError("guest could not grow its memory for the 16 MB region")
        def expose_zero_copy(nbytes):
            v = guest.view(off, mx.uint8, (nbytes,))
            mx.eval(v)
            return v

        def expose_copy(nbytes):
            c = mx.array(guest.arena.np[off:off + nbytes])  # the copy path
            mx.eval(c)
            return c

        for fn in (expose_zero_copy, expose_copy):  # warm up MLX's own first-use allocations
            fn(4096)
        mx.clear_cache()
        base = rss_bytes()
        zc = expose_zero_copy(REGION)
        rss_zero = rss_bytes() - base
        zc_addr = int(np.array(zc, copy=False).ctypes.data)
        mx.clear_cache()
        base = rss_bytes()
        cp = expose_copy(REGION)
        rss_copy = rss_bytes() - base
        cp_addr = int(np.array(cp, copy=False).ctypes.data)
        same_bytes = bool(mx.array_equal(zc, cp).item())
        del zc, cp

        # 3. GEMM driven from the guest, interleaved zero-copy / copy
        if guest.call("gemm_setup", n) != 0:
            raise RuntimeError(f"gemm_setup({n}) refused")
        times = {False: [], True: []}
        for _ in range(5):  # warm-up
            for mode in (False, True):
                guest.copy_mode = mode
                guest.call("gemm_run")
        for _ in range(reps):
            for mode in (False, True):
                guest.copy_mode = mode
                t = time.perf_counter()
                guest.call("gemm_run")
                times[mode].append(time.perf_counter() - t)
        # 4. errors: against NumPy, for both paths, plus the guest's own check
        errors = 0
        for mode in (False, True):
            guest.copy_mode = mode
            guest.call("gemm_setup", n)
            guest.call("gemm_run")
            a, b, c = (guest.arena.np[p:p + 4 * n * n].view(np.float32).reshape(n, n)
                       for p in (guest.call("gemm_ptr", i) for i in range(3)))
            errors += int(np.count_nonzero(c != a @ b)) + guest.call("gemm_check")
        return {
            "pointer_identity": bool(identity and view_identity and zc_addr == guest.arena.ptr + off),
            "copy_path_distinct_address": cp_addr != guest.arena.ptr + off,
            "guest_base": hex(guest.base_address()),
            "mlx_buffer": hex(guest.arena.ptr),
            "rss_delta_mb_zero_copy": round(rss_zero / 2**20, 3),
            "rss_delta_mb_copy": round(rss_copy / 2**20, 3),
            "region_mb": REGION / 2**20,
            "region_address_zero_copy": hex(zc_addr),
            "region_address_copy": hex(cp_addr),
            "region_same_bytes": same_bytes,
            "gemm_n": n,
            "gemm_reps": reps,
            "gemm_ms_zero_copy": round(float(np.median(times[False])) * 1e3, 4),
            "gemm_ms_copy": round(float(np.median(times[True])) * 1e3, 4),
            "errors": errors,
            "device": str(mx.default_device()),
        }
    finally:
        guest.close()
        engine.close()


def table(r: dict) -> str:
    rows = [
        ("pointer identity", f"{r['pointer_identity']} ({r['guest_base']} == {r['mlx_buffer']})",
         "different addresses" if r["copy_path_distinct_address"] else "same address (!)"),
        (f"RSS delta, {r['region_mb']:g} MB region", f"{r['rss_delta_mb_zero_copy']} MB",
         f"{r['rss_delta_mb_copy']} MB"),
        (f"GEMM {r['gemm_n']}x{r['gemm_n']} f32 (median of {r['gemm_reps']})",
         f"{r['gemm_ms_zero_copy']} ms", f"{r['gemm_ms_copy']} ms"),
        ("errors (both paths vs NumPy)", str(r["errors"]), str(r["errors"])),
    ]
    w = max(len(a) for a, _, _ in rows)
    lines = [f"{'metric':{w}}  {'zero-copy':40}  copy", "-" * (w + 60)]
    lines += [f"{a:{w}}  {b:40}  {c}" for a, b, c in rows]
    return "\n".join(lines)
