"""Where CUDA unified memory's pages sit when KV crosses between host and device.

MLX CUDA computes in device memory. An array the CPU reads is first moved into
managed memory (``cudaMallocManaged``, a copy on the device), and its pages then
follow whoever touches them, a fault at a time (a migration's extraction of 178 MB
of KV, read that way, took 74 ms on an H100), and a buffer the CPU read last, once
MLX reuses it for a step's output, makes the GPU fault every page back. A
prefetch moves the pages in one DMA before the reader needs them.

A landing's KV goes the other way by the copy engine (:func:`land`): a host
buffer copied into MLX (``mx.array``) and then into the cache by a kernel cost
0.63 ms a MB on an H100, each piece's host write faulting in pages the last
piece had sent to the device; one ``cudaMemcpy2DAsync`` straight into the
cache's room took 0.19.

MLX does not expose this, so the CUDA runtime is reached through ctypes. On a
CPU, without the runtime, or after a call fails, every function here does
nothing and returns False: a prefetch only moves pages, it never changes a byte,
and a landing that returns False is made the other way by its caller.
Nor is a buffer under ``MIN_BYTES`` prefetched.
``KVFERRY_PREFETCH=off`` turns it off (to compare).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

log = logging.getLogger("kvferry.checkpoint")

DEVICE, HOST = 1, 2  # cudaMemLocationType
# below this, a prefetch and its wait cost more than the faults they save: a live
# migration's last delta lands ~60 sides of a few KB, and with each prefetched and
# waited for, the pause's median was 2-4 ms longer on an H100 (stop 62)
MIN_BYTES = 256 << 10


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Runtime:
    """The calls of libcudart this module makes, typed, and a stream of its own:
    non-blocking, so a prefetch never waits behind MLX's kernels (the legacy
    default stream would wait for every blocking stream's work)."""

    def __init__(self, lib: ctypes.CDLL, prefetch_name: str) -> None:
        self._prefetch = getattr(lib, prefetch_name)
        self._prefetch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
        self._prefetch.restype = ctypes.c_int
        self._copy2d = lib.cudaMemcpy2DAsync
        self._copy2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._copy2d.restype = ctypes.c_int
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.restype = ctypes.c_int
        self._sync = lib.cudaStreamSynchronize
        self._sync.argtypes = [ctypes.c_void_p]
        self._sync.restype = ctypes.c_int
        self.stream = ctypes.c_void_p()
        create = lib.cudaStreamCreateWithFlags
        create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        create.restype = ctypes.c_int
        if create(ctypes.byref(self.stream), 1):  # cudaStreamNonBlocking
            raise OSError("cudaStreamCreateWithFlags failed")

    def prefetch(self, ptr: int, nbytes: int, where: int) -> int:
        return self._prefetch(ctypes.c_void_p(ptr), nbytes, _Location(where, 0), 0, self.stream)

    def sync(self) -> int:
        return self._sync(self.stream)

    def register(self, ptr: int, nbytes: int) -> int:
        err = self._register(ctypes.c_void_p(ptr), nbytes, 0)  # cudaHostRegisterDefault
        if err:
            self._last_error()  # cleared: MLX must not find it after its next kernel
        return err

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> int:
        """``height`` rows of ``width`` bytes, and wait (cudaMemcpyDefault: unified addressing
        tells host from device)."""
        err = self._copy2d(ctypes.c_void_p(dst), dpitch, ctypes.c_void_p(src), spitch, width, height, 4,
                           self.stream)
        return err or self.sync()


_state: dict[str, Any] = {"runtime": None, "loaded": False}
_lock = threading.Lock()


def _load() -> _Runtime | None:
    import mlx.core as mx

    if mx.default_device() == mx.cpu or not mx.cuda.is_available() or os.environ.get("KVFERRY_PREFETCH") == "off":
        return None
    # CUDA 13 names the location form cudaMemPrefetchAsync; 12.2+ calls it _v2
    for name, fn in (("libcudart.so.13", "cudaMemPrefetchAsync"), ("libcudart.so.12", "cudaMemPrefetchAsync_v2")):
        try:
            return _Runtime(ctypes.CDLL(name), fn)
        except (OSError, AttributeError):
            continue
    log.info("unified memory: no CUDA runtime found; KV pages move by faults")
    return None


def _runtime() -> _Runtime | None:
    if not _state["loaded"]:
        with _lock:
            if not _state["loaded"]:
                _state["runtime"], _state["loaded"] = _load(), True
    return _state["runtime"]


def _prefetch(view: Any, where: int, wait: bool) -> bool:
    if view.nbytes < MIN_BYTES:
        return False
    rt = _runtime()
    if rt is None:
        return False
    err = rt.prefetch(view.ctypes.data, view.nbytes, where)
    if not err and wait:
        err = rt.sync()
    if err:  # not managed memory after all, say: stop trying, nothing was changed
        log.warning("unified memory: prefetch failed (CUDA error %d); KV pages move by faults from now on", err)
        _state["runtime"] = None
        return False
    return True


def available() -> bool:
    """Whether the CUDA runtime is reached (a GPU host, prefetch not turned off)."""
    return _runtime() is not None


def to_host(view: Any) -> bool:
    """Move the pages under ``view`` (a numpy view of an MLX array, made by
    ``np.array(a, copy=False)``, which puts it in managed memory) to the host,
    and wait: the CPU then reads them at memory speed."""
    return _prefetch(view, HOST, wait=True)


def to_device(view: Any, wait: bool = False) -> bool:
    """Move the pages under ``view`` to the device (``wait``: and wait). Without
    waiting, a kernel that touches them before they arrive is still correct
    (managed memory), only slower: so for a buffer the CPU read last, which goes
    back to MLX's cache and becomes some later step's output."""
    return _prefetch(view, DEVICE, wait=wait)


def pin(host: Any) -> bool:
    """Page-lock ``host`` (a numpy array of the host's own, kept for the process's
    life: it is never unregistered), so the copy engine reads and writes it
    directly, not through the driver's staging buffers. False: it stays pageable."""
    rt = _runtime()
    if rt is None:
        return False
    err = rt.register(host.ctypes.data, host.nbytes)
    if err:
        log.info("unified memory: page-locking %d bytes failed (CUDA error %d); they stay pageable",
                 host.nbytes, err)
    return not err


def read(src: Any, t0: int, dst: Any) -> bool:
    """Copy tokens ``[t0, t0 + n)`` of ``src`` (a numpy view of a cache's ``[1, heads,
    capacity, head_dim]`` MLX array: unified memory) into ``dst`` (a C-contiguous
    ``[1, heads, n, head_dim]`` host array of the same item size), one row a head, by
    the device's copy engine; returns once it is there. The pages stay on the device:
    no prefetch there and back, and no MLX op to gather the range first."""
    if not _shapes_fit(src, dst, t0):
        return False
    row = src.shape[3] * src.itemsize
    n = dst.shape[2]
    return _copy(dst.ctypes.data, n * row, src.ctypes.data + t0 * row, src.shape[2] * row, n * row, src.shape[1],
                 "a read")


def _shapes_fit(cache: Any, part: Any, t0: int) -> bool:
    b, h, cap, d = cache.shape
    n = part.shape[2]
    return (b == 1 and part.shape == (1, h, n, d) and part.itemsize == cache.itemsize and part.flags.c_contiguous
            and cache.flags.c_contiguous and t0 + n <= cap)


def _copy(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, what: str) -> bool:
    rt = _runtime()
    if rt is None:
        return False
    err = rt.copy_2d(dst, dpitch, src, spitch, width, height)
    if err:
        log.warning("unified memory: %s by the copy engine failed (CUDA error %d); KV crosses through MLX "
                    "from now on", what, err)
        _state["runtime"] = None
        return False
    return True


def land(dst: Any, src: Any, t0: int) -> bool:
    """Copy ``src`` (a C-contiguous ``[1, heads, n, head_dim]`` numpy array of KV bits)
    into tokens ``[t0, t0 + n)`` of ``dst`` (a numpy view, ``np.array(a, copy=False)``,
    of a cache's ``[1, heads, capacity, head_dim]`` MLX array of the same item size:
    unified memory), one row a head, by the device's copy engine; returns once it is
    there. No CPU touch of ``dst``, so its pages stay on the device."""
    if not _shapes_fit(dst, src, t0):
        return False
    row = dst.shape[3] * dst.itemsize
    n = src.shape[2]
    return _copy(dst.ctypes.data + t0 * row, dst.shape[2] * row, src.ctypes.data, n * row, n * row, dst.shape[1],
                 "a landing")
