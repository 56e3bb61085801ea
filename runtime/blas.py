"""Give MLX's Linux CPU backend an optimized BLAS.

The ``mlx-cpu`` wheel links a bundled *reference* BLAS: float32 GEMM runs at
~6 GFLOP/s. ``libmlx.so`` imports ``cblas_sgemm`` (and d/c) as undefined
dynamic symbols, so a library exporting them that is loaded into the global
symbol scope first (``RTLD_GLOBAL``, or ``LD_PRELOAD``) takes over: ~30x faster.

Sources, in order: ``$KVFERRY_BLAS`` (a path, or ``reference`` to opt out),
the system OpenBLAS (``libopenblas.so.0``), and ``scipy-openblas32`` from PyPI,
whose symbols carry a ``scipy_`` prefix, so we compile a 3-function forwarding
shim for it once (with the ``ziglang`` toolchain we already depend on) and
cache it. If none works: one warning and the slow path, never a failure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

from .paths import home

_SHIM_C = r"""
/* kvferry: forward the CBLAS GEMMs libmlx.so imports to scipy-openblas. */
typedef int I;
extern void scipy_cblas_sgemm(I,I,I,I,I,I,float,const float*,I,const float*,I,float,float*,I);
extern void scipy_cblas_dgemm(I,I,I,I,I,I,double,const double*,I,const double*,I,double,double*,I);
extern void scipy_cblas_cgemm(I,I,I,I,I,I,const void*,const void*,I,const void*,I,const void*,void*,I);
void cblas_sgemm(I o,I ta,I tb,I m,I n,I k,float al,const float*a,I lda,const float*b,I ldb,float be,float*c,I ldc)
{ scipy_cblas_sgemm(o,ta,tb,m,n,k,al,a,lda,b,ldb,be,c,ldc); }
void cblas_dgemm(I o,I ta,I tb,I m,I n,I k,double al,const double*a,I lda,const double*b,I ldb,double be,double*c,I ldc)
{ scipy_cblas_dgemm(o,ta,tb,m,n,k,al,a,lda,b,ldb,be,c,ldc); }
void cblas_cgemm(I o,I ta,I tb,I m,I n,I k,const void*al,const void*a,I lda,const void*b,I ldb,const void*be,void*c,I ldc)
{ scipy_cblas_cgemm(o,ta,tb,m,n,k,al,a,lda,b,ldb,be,c,ldc); }
"""

_status: dict = {"kind": "unset", "path": None}


def _load(path: str) -> bool:
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def _system_openblas() -> str | None:
    for cand in ("libopenblas.so.0", ctypes.util.find_library("openblas")):
        if cand and _load(cand):
            return cand
    return None


def _scipy_openblas_lib() -> Path | None:
    try:
        import scipy_openblas32  # type: ignore
    except ImportError:
        return None
    lib = Path(scipy_openblas32.__file__).parent / "lib" / "libscipy_openblas.so"
    return lib if lib.exists() else None


def shim_path() -> Path | None:
    """Path of the forwarding shim (built on first use), or None if impossible."""
    lib = _scipy_openblas_lib()
    if lib is None:
        return None
    tag = hashlib.sha256((_SHIM_C + str(lib)).encode()).hexdigest()[:12]
    out = home() / "blas" / f"libkvferry_blas-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(_SHIM_C)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    args = ["-shared", "-fPIC", "-O2", str(src), "-o", str(tmp), f"-L{lib.parent}",
            "-lscipy_openblas", f"-Wl,-rpath,{lib.parent}"]
    compilers = [[sys.executable, "-m", "ziglang", "cc", "-target", "x86_64-linux-gnu.2.17"]
                 if os.uname().machine == "x86_64" else [sys.executable, "-m", "ziglang", "cc"],
                 ["cc"]]
    for cc in compilers:
        try:
            r = subprocess.run(cc + args, capture_output=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and tmp.exists():
            os.replace(tmp, out)  # atomic: concurrent processes may race here
            return out
    return None


def _preloaded() -> bool:
    return "blas" in os.environ.get("LD_PRELOAD", "")


def enable() -> dict:
    """Load an optimized BLAS into the global scope (idempotent). Returns status."""
    if _status["kind"] != "unset":
        return _status
    choice = os.environ.get("KVFERRY_BLAS", "auto")
    if sys.platform == "darwin":
        _status.update(kind="accelerate", path=None)  # MLX on macOS uses Accelerate
    elif choice == "reference":
        _status.update(kind="reference", path=None)
    elif "mlx.core" in sys.modules and not _preloaded():
        # too late: libmlx already bound the reference BLAS it ships with
        warnings.warn("kvferry: mlx was imported before kvferry, so MLX CPU matmuls keep the "
                      "reference BLAS (~30x slower); import kvferry first", stacklevel=2)
        _status.update(kind="reference", path=None, late=True)
    elif choice != "auto":
        if not _load(choice):
            warnings.warn(f"kvferry: KVFERRY_BLAS={choice} could not be loaded; "
                          "MLX CPU matmuls use the slow reference BLAS", stacklevel=2)
            _status.update(kind="reference", path=None)
        else:
            kind = ("scipy-openblas" if "kvferry_blas" in choice else
                    "openblas" if "openblas" in choice else "custom")
            _status.update(kind=kind, path=choice)
    elif (p := _system_openblas()) is not None:
        _status.update(kind="openblas", path=p)
    else:
        shim = None
        try:
            shim = shim_path()
        except OSError:
            shim = None
        if shim is not None and _load(str(shim)):
            _status.update(kind="scipy-openblas", path=str(shim))
        else:
            warnings.warn("kvferry: no optimized BLAS found (install scipy-openblas32 or the "
                          "system libopenblas0); MLX CPU matmuls use the reference BLAS and "
                          "run ~30x slower", stacklevel=2)
            _status.update(kind="reference", path=None)
    # Worker processes (Ray, subprocesses) inherit the choice without redoing it.
    if _status["path"]:
        os.environ.setdefault("KVFERRY_BLAS", _status["path"])
    return _status


def status() -> dict:
    return dict(_status)


KEEP_BELOW = 32 << 20  # glibc's largest mmap threshold: smaller blocks come from the heap
KEEP_FREED = 4 << 30  # free heap memory a host keeps for reuse before it gives any back


def worker_env() -> dict[str, str]:
    """Environment for Ray ``runtime_env`` so actors get the same BLAS even when
    they import MLX before kvferry."""
    s = enable()
    env = {"KVFERRY_BLAS": s["path"] or ("reference" if s["kind"] == "reference" else "auto")}
    if s["path"] and sys.platform.startswith("linux"):
        env["LD_PRELOAD"] = s["path"]
    for k in ("OPENBLAS_NUM_THREADS",):  # `kvferry serve --threads`
        if os.environ.get(k):
            env[k] = os.environ[k]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    add = []
    if sys.platform.startswith("linux") and os.environ.get("KVFERRY_HUGEPAGES", "1") != "0" \
            and "glibc.malloc.hugetlb" not in tunables:
        # MLX's big buffers (weights, KV caches) on transparent huge pages: measured
        # here, allocating a migrated-in cache costs half (39 vs 84 ms per 130 MB)
        # and decode steps run ~5% faster (fewer TLB misses)
        add.append("glibc.malloc.hugetlb=1")
    if sys.platform.startswith("linux") and os.environ.get("KVFERRY_KEEP_FREED", "1") != "0" \
            and not any(f"glibc.malloc.{t}" in tunables for t in ("trim_threshold", "mmap_threshold", "arena_max")):
        # KV freed (a session closed or moved away) stays in the host for the next one
        # to land in, as vLLM's preallocated blocks: a layer's buffers (< 32 MiB) come
        # from the heap, which is not given back, and from one arena, whichever thread
        # frees or lands them (a migration lands on a gRPC thread). Memory new to the
        # process costs its page faults: on this VM they were most of a migration's
        # landing, and after a prefill a transfer ran at 41-754 MB/s instead of
        # ~1.1-1.3 GB/s (docs/performance-log.md, "KV read in place, and landing in
        # memory the host kept").
        # Decode with 1 and 4 sessions measured the same with one arena.
        add += [f"glibc.malloc.mmap_threshold={KEEP_BELOW}", f"glibc.malloc.trim_threshold={KEEP_FREED}",
                "glibc.malloc.arena_max=1"]
    if add:
        env["GLIBC_TUNABLES"] = ":".join(x for x in (tunables, *add) if x)
    return env
