"""The optimized BLAS really is what libmlx.so calls."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from kvferry import blas


def test_shim_loaded_and_correct():
    s = blas.status()
    assert s["kind"] in ("openblas", "scipy-openblas", "custom", "accelerate")
    if sys.platform.startswith("linux"):
        maps = open("/proc/self/maps").read()
        assert s["path"].split("/")[-1] in maps
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 200), np.float32), rng.standard_normal((200, 100), np.float32)
    assert np.allclose(np.array(mx.array(a) @ mx.array(b)), a @ b, atol=1e-3)


MATMUL = "mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"


def _sgemm_binding(env: dict, code: str = f"from kvferry import blas; blas.enable(); import mlx.core as mx; {MATMUL}",
                   out_of: list | None = None) -> str:
    """What the dynamic linker bound libmlx.so's cblas_sgemm to (LD_DEBUG=bindings)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env, "LD_DEBUG": "bindings"})
    assert out.returncode == 0, out.stderr[-2000:]
    if out_of is not None:
        out_of.append(out)
    lines = [l for l in out.stderr.splitlines() if "libmlx.so" in l and "`cblas_sgemm'" in l]
    assert lines, "no binding of cblas_sgemm seen"
    return lines[-1]


def test_libmlx_sgemm_binds_to_optimized_blas():
    if not sys.platform.startswith("linux"):
        return
    env = {k: v for k, v in os.environ.items() if k not in ("KVFERRY_BLAS", "LD_PRELOAD")}
    fast = _sgemm_binding({**env, "KVFERRY_BLAS": "auto"})
    assert "openblas" in fast or "kvferry_blas" in fast, fast
    ref = _sgemm_binding({**env, "KVFERRY_BLAS": "reference"})
    assert "libblas" in ref, ref


def test_importing_kvferry_first_is_enough_and_importing_mlx_first_is_reported():
    """`import kvferry` makes the first import of mlx.core load the BLAS before it (no
    enable() call); mlx imported before kvferry keeps the reference BLAS, and
    kvferry says so instead of reporting a BLAS MLX never calls."""
    if not sys.platform.startswith("linux"):
        return
    env = {k: v for k, v in os.environ.items() if k not in ("KVFERRY_BLAS", "LD_PRELOAD")}
    first = _sgemm_binding(env, f"import kvferry; import mlx.core as mx; {MATMUL}")
    assert "openblas" in first or "kvferry_blas" in first, first
    runs: list = []
    late = _sgemm_binding(env, "import mlx.core as mx; from kvferry import blas; "
                               f"print(blas.enable()['kind']); {MATMUL}", runs)
    assert "libblas" in late, late
    assert runs[0].stdout.split() == ["reference"]
    assert "mlx was imported before kvferry" in runs[0].stderr


def test_host_actors_keep_freed_kv_unless_told_not_to(monkeypatch):
    """Host actors start with malloc settings that keep freed KV for the next landing
    (one arena, no trimming, a layer's buffers from the heap); KVFERRY_KEEP_FREED=0
    drops them, and tunables the user set are left as they are."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc tunables are Linux's")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("KVFERRY_KEEP_FREED", raising=False)
    monkeypatch.delenv("KVFERRY_HUGEPAGES", raising=False)
    got = blas.worker_env()["GLIBC_TUNABLES"].split(":")
    assert {"glibc.malloc.arena_max=1", f"glibc.malloc.mmap_threshold={blas.KEEP_BELOW}",
            f"glibc.malloc.trim_threshold={blas.KEEP_FREED}", "glibc.malloc.hugetlb=1"} == set(got)
    monkeypatch.setenv("KVFERRY_KEEP_FREED", "0")
    assert blas.worker_env()["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("KVFERRY_HUGEPAGES", "0")
    assert "GLIBC_TUNABLES" not in blas.worker_env()
    monkeypatch.delenv("KVFERRY_KEEP_FREED")
    monkeypatch.delenv("KVFERRY_HUGEPAGES")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert blas.worker_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
