"""MLX arrays <-> their bits as numpy arrays, for codecs that work on integers
(float32 as uint32, float16/bfloat16 as uint16), and MLX allocation failures as
one-line errors. The only MLX-specific piece of the checkpoint format."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from . import unified
from .errors import CheckpointError, OutOfMemoryError


def mx_bits(a) -> tuple[np.ndarray, str]:
    """An MLX array -> (its bits as an unsigned numpy array, dtype name)."""
    u, name = mx_bits_lazy(a)
    return np.array(u), name


def mx_bits_lazy(a) -> tuple:
    """An MLX array -> (its bits as an unsigned MLX array, dtype name), not evaluated:
    many can be evaluated at once (one wait on a GPU), then read with ``np.array``."""
    import mlx.core as mx

    name = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16",
            mx.uint32: "uint32", mx.int32: "int32", mx.uint8: "uint8"}[a.dtype]
    view = {"float32": mx.uint32, "float16": mx.uint16, "bfloat16": mx.uint16}.get(name)
    return (a.view(view) if view is not None else a), name


def np_bits_type(dtype) -> type:
    """The numpy type of an MLX bits array (as :func:`mx_bits_lazy` gives them)."""
    import mlx.core as mx

    return {mx.uint32: np.uint32, mx.uint16: np.uint16, mx.int32: np.int32, mx.uint8: np.uint8}[dtype]


def np_kind(dtype) -> tuple[type, str] | None:
    """(unsigned numpy type, name) to read an MLX dtype's bits through the buffer
    protocol without an MLX op; None where numpy has no such dtype (bfloat16)."""
    import mlx.core as mx

    return {mx.float32: (np.uint32, "float32"), mx.float16: (np.uint16, "float16")}.get(dtype)


def host_memory() -> bool:
    """Whether MLX's arrays live in host memory the CPU reads and writes directly
    (the CPU device), so numpy may copy KV in and out of them in place. On a GPU
    (CUDA unified memory) a CPU touch migrates the pages, and the next step on
    the GPU migrates them back: there KV moves by MLX copies on the device."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def mx_from_bits(u: np.ndarray, dtype: str, device: bool = False):
    import mlx.core as mx

    a = mx.array(u)
    if device and not host_memory():
        unified.to_device(np.array(a, copy=False), wait=True)  # (an array of its own: read in place)
    if dtype in ("float32", "float16", "bfloat16"):
        a = a.view(getattr(mx, dtype))
    return a


def _as_float32(u: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return u.view(np.float32)
    if dtype == "float16":
        return u.view(np.float16).astype(np.float32)
    return (u.astype(np.uint32) << 16).view(np.float32)  # bfloat16: float32's upper half


def cast_bits(u: np.ndarray, src: str, dst: str, where: str) -> tuple[np.ndarray, str]:
    """KV bits in dtype ``src`` -> bits in ``dst`` (float32/float16/bfloat16), exactly
    or not at all: widening is always exact; narrowing only when every value
    survives the round trip (say KV that was float16 before), else one line."""
    if src == dst:
        return u, src
    f = _as_float32(u, src)
    if dst == "float32":
        return f.view(np.uint32), dst
    out = f.astype(np.float16).view(np.uint16) if dst == "float16" else (f.view(np.uint32) >> 16).astype(np.uint16)
    if not np.array_equal(_as_float32(out, dst).view(np.uint32), f.view(np.uint32)):
        raise CheckpointError(f"{where}: the session's KV is {src} and does not fit {dst} exactly, the dtype "
                              f"this host computes in (serve it with --dtype {src}, or keep it on such a host)")
    return out, dst


@contextlib.contextmanager
def oom(where: str) -> Iterator[None]:
    """MLX reports a failed allocation as RuntimeError: name it."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, MemoryError) or "alloc" in str(e).lower():
            raise OutOfMemoryError(f"{where}: out of memory on this host ({e})") from None
        raise


def joined(arrays: list) -> Any:
    """MLX arrays as one uint8 buffer (lazy), to read on the host at once: MLX CUDA moves
    each array it reads to unified memory (an allocation, a copy and a free that waits
    for the device), so many small reads cost many waits."""
    import mlx.core as mx

    return mx.concatenate([u.reshape(-1).view(mx.uint8) for u in arrays])


def split_joined(data: np.ndarray, arrays: list) -> list[np.ndarray]:
    """:func:`joined`'s buffer read on the host (``data``) -> a view per array, its shape and bits type."""
    edges = np.cumsum([0] + [u.nbytes for u in arrays]).tolist()
    return [data[lo:hi].view(np_bits_type(u.dtype)).reshape(u.shape) for u, lo, hi in zip(arrays, edges, edges[1:])]
