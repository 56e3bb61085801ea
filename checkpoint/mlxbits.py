"""MLX arrays <-> their bits as numpy arrays, for codecs that work on integers
(float32 as uint32, float16/bfloat16 as uint16), and MLX allocation failures as
one-line errors. The only MLX-specific piece of the checkpoint format."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from .errors import OutOfMemoryError


def mx_bits(a) -> tuple[np.ndarray, str]:
    """An MLX array -> (its bits as an unsigned numpy array, dtype name)."""
    import mlx.core as mx

    name = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16",
            mx.uint32: "uint32", mx.int32: "int32", mx.uint8: "uint8"}[a.dtype]
    view = {"float32": mx.uint32, "float16": mx.uint16, "bfloat16": mx.uint16}.get(name)
    return np.array(a.view(view) if view is not None else a), name


def np_kind(dtype) -> tuple[type, str] | None:
    """(unsigned numpy type, name) to read an MLX dtype's bits through the buffer
    protocol without an MLX op; None where numpy has no such dtype (bfloat16)."""
    import mlx.core as mx

    return {mx.float32: (np.uint32, "float32"), mx.float16: (np.uint16, "float16")}.get(dtype)


def mx_from_bits(u: np.ndarray, dtype: str):
    import mlx.core as mx

    a = mx.array(u)
    if dtype in ("float32", "float16", "bfloat16"):
        a = a.view(getattr(mx, dtype))
    return a


@contextlib.contextmanager
def oom(where: str) -> Iterator[None]:
    """MLX reports a failed allocation as RuntimeError: name it."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, MemoryError) or "alloc" in str(e).lower():
            raise OutOfMemoryError(f"{where}: out of memory on this host ({e})") from None
        raise
