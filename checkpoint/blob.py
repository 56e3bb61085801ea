"""The codec blob's shared ground: dtypes, size checks, capped zstd, payload parts.

A codec blob is a plain dict (msgpack-able): ``codec``, ``dtype``, ``shape``,
``nbytes`` (raw size, capped and checked on decode), ``parts`` (zstd streams or
raw bytes) and codec ``meta``. Everything here treats a blob as hostile: a
declared size is checked before anything is allocated for it.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import zstandard as zstd

from .errors import CheckpointError

MAX_TENSOR_BYTES = 8 << 30
DTYPES = {"float32": (np.uint32, 4), "float16": (np.uint16, 2), "bfloat16": (np.uint16, 2),
          "uint32": (np.uint32, 4), "int32": (np.int32, 4), "uint8": (np.uint8, 1),
          "int8": (np.int8, 1), "uint16": (np.uint16, 2)}
FLOATS = ("float32", "float16", "bfloat16")
LEVEL = 3

# zstd contexts are not thread-safe: shared by a host's migrations, drains and
# restores at once they corrupted its heap and killed it (`bench chaos`). One each
# per thread, kept for its next call.
_local = threading.local()


def _cctx(level: int) -> zstd.ZstdCompressor:
    cs = _local.__dict__.setdefault("c", {})
    if (c := cs.get(level)) is None:
        c = cs[level] = zstd.ZstdCompressor(level=level)
    return c


def _dctx() -> zstd.ZstdDecompressor:
    if (d := getattr(_local, "d", None)) is None:
        d = _local.d = zstd.ZstdDecompressor()
    return d


def compress(data: bytes | memoryview, level: int = LEVEL) -> bytes:
    return _cctx(level).compress(data)


def decompress_capped(data: bytes, cap: int, where: str) -> bytes:
    """Decompress at most ``cap`` bytes. The zstd frame's own content size is not
    trusted: checked against the cap before anything is allocated."""
    try:
        size = zstd.frame_content_size(data)
        if size > cap:
            raise CheckpointError(f"{where}: zstd stream declares {size} bytes, larger than declared "
                                  f"for the tensor ({cap})")
        if size >= 0:
            return _dctx().decompress(data)
        with _dctx().stream_reader(data) as r:
            out = r.read(cap + 1)
    except zstd.ZstdError as e:
        raise CheckpointError(f"{where}: zstd stream is corrupt ({e})") from None
    if len(out) > cap:
        raise CheckpointError(f"{where}: zstd stream inflates larger than declared ({cap} bytes)")
    return out


def check_shape(shape, dtype: str, where: str) -> int:
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 8 or \
            not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
        raise CheckpointError(f"{where}: malformed shape {shape!r}")
    n = math.prod(shape) * DTYPES[dtype][1]  # Python ints: a declared shape cannot wrap around
    if n > MAX_TENSOR_BYTES:
        raise CheckpointError(f"{where}: declares {n} bytes, over the {MAX_TENSOR_BYTES >> 30} GiB "
                              "tensor limit")
    return n


def part(b: dict, i: int, where: str) -> bytes | memoryview:
    parts = b.get("parts")
    if not isinstance(parts, list) or i >= len(parts) or not isinstance(parts[i], (bytes, memoryview)):
        raise CheckpointError(f"{where}: payload part {i} missing")
    return parts[i]


def field(meta: dict, key: str, where: str) -> bytes:
    v = meta.get(key)
    if not isinstance(v, (bytes, memoryview)):
        raise CheckpointError(f"{where}: codec field '{key}' missing")
    return v
