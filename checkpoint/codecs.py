"""Payload codecs for KV tensors and other bulk bytes.

Encode and decode a tensor as a codec blob (see :mod:`.blob`). Decoding never
trusts a declared size: each zstd stream is decompressed with a hard output cap
derived from the shape.

Modes
-----
``lossless`` (``xsplit``): bit-exact. KV tensors ``[B, H, T, D]`` are turned
channel-major (``[B·H, D, T]``: each head-dim channel's values over time are
contiguous), split into byte planes, and the plane holding sign + exponent is
normalised per channel (sign XOR the channel's majority sign, exponent minus the
channel's mean), so zstd's entropy coder sees one concentrated distribution
instead of a mixture of per-channel ones.

``raw``: bit-exact and uncompressed (the frame checksum still covers it). For a
fast link, live migration's default: lossless compression gains ~1.17x on
float32 KV but costs a core on each end while the session keeps generating.

``int8`` / ``int4``: lossy, in :mod:`.quant`.
"""

from __future__ import annotations

import math

import numpy as np

from .blob import DTYPES, FLOATS, check_shape, compress, decompress_capped, field, part
from .errors import CheckpointError
from .bodies import Gather
from .quant import OUTLIERS, decode_outliers, decode_quantized, decode_symmetric, encode_outliers, encode_symmetric

MODES = ("lossless", "raw", "int8", "int4")


# ----------------------------------------------------------------------------- lossless

def _normalise(top: np.ndarray):
    """Per channel (axis 1 is time): sign XOR majority sign, low 7 bits minus the
    channel mean (mod 128)."""
    sign = top >> 7
    low = top & 0x7F
    maj = (sign.mean(axis=1, keepdims=True) > 0.5).astype(np.uint8)
    off = np.round(low.mean(axis=1, keepdims=True, dtype=np.float32)).astype(np.uint8)
    out = ((sign ^ maj) << 7) | ((low - off) & 0x7F)
    return out.astype(np.uint8), maj.reshape(-1), off.reshape(-1)


def _denormalise(top: np.ndarray, maj: np.ndarray, off: np.ndarray) -> np.ndarray:
    maj = (maj << 7).reshape(top.shape[0], 1, top.shape[2])
    off = off.reshape(top.shape[0], 1, top.shape[2])
    out = top + off  # the carry out of bit 6 lands in bit 7 and is masked off below
    out &= 0x7F
    out |= (top & 0x80) ^ maj
    return out


def _planes(u: np.ndarray) -> tuple[list[np.ndarray], tuple[int, int, int]]:
    """Byte planes of a [..., T, D] array (plane i = byte i of each value), shaped
    [B·H, T, D]. Channel statistics are taken over T; no transpose is needed
    because zstd's entropy stage only sees the (normalised) histogram."""
    t, d = u.shape[-2], u.shape[-1]
    w = u.dtype.itemsize
    b = np.ascontiguousarray(u).view(np.uint8).reshape(-1, t, d, w)
    return [np.ascontiguousarray(b[..., i]) for i in range(w)], (b.shape[0], t, d)


def encode_lossless(u: np.ndarray, dtype: str) -> dict:
    """``u``: the tensor's bits as an unsigned integer array of its width."""
    shape = list(u.shape)
    if dtype not in FLOATS or u.ndim < 2:
        return {"codec": "zstd", "dtype": dtype, "shape": shape, "nbytes": u.nbytes,
                "parts": [compress(np.ascontiguousarray(u).tobytes(), 1)], "meta": {}}
    planes, cm_shape = _planes(u)
    top, maj, off = _normalise(planes[-1])
    planes[-1] = top
    parts = [compress(p, 1) for p in planes]  # level 1: within 0.5% of level 3 here, 4x faster
    return {"codec": "xsplit", "dtype": dtype, "shape": shape, "nbytes": u.nbytes, "parts": parts,
            "meta": {"maj": maj.tobytes(), "off": off.tobytes(), "tm": list(cm_shape)}}


def _decode_lossless(b: dict, nbytes: int, where: str) -> np.ndarray:
    dtype, shape = b["dtype"], tuple(b["shape"])
    utype, width = DTYPES[dtype]
    if b["codec"] == "zstd":
        raw = decompress_capped(part(b, 0, where), nbytes, where)
        if len(raw) != nbytes:
            raise CheckpointError(f"{where}: payload is {len(raw)} bytes, expected {nbytes}")
        return np.frombuffer(raw, dtype=utype).reshape(shape)
    meta = b.get("meta") or {}
    cm_shape = tuple(meta.get("tm", ()))
    n = nbytes // width
    if len(cm_shape) != 3 or int(np.prod(cm_shape)) != n or len(b["parts"]) != width:
        raise CheckpointError(f"{where}: malformed xsplit layout")
    planes = []
    for i in range(width):
        raw = decompress_capped(part(b, i, where), n, where)
        if len(raw) != n:
            raise CheckpointError(f"{where}: byte plane {i} is {len(raw)} bytes, expected {n}")
        planes.append(np.frombuffer(raw, dtype=np.uint8).reshape(cm_shape))
    maj = np.frombuffer(field(meta, "maj", where), dtype=np.uint8)
    off = np.frombuffer(field(meta, "off", where), dtype=np.uint8)
    if maj.size != cm_shape[0] * cm_shape[2] or off.size != maj.size:
        raise CheckpointError(f"{where}: malformed xsplit channel table")
    planes[-1] = _denormalise(planes[-1], maj, off)
    out = np.empty(cm_shape + (width,), dtype=np.uint8)
    for i in range(width):
        out[..., i] = planes[i]
    return out.view(utype).reshape(shape)


# ----------------------------------------------------------------------------- API

SINK_TOKENS = 0  # measured: keeping attention-sink tokens exact did not change top-1 here


def encode(u: np.ndarray, dtype: str, mode: str = "lossless", role: str = "values",
           sink: int = SINK_TOKENS, borrow: bool = False) -> dict:
    """Encode a tensor given as its raw bits (unsigned view) and dtype name.
    ``role`` ("keys"/"values") picks the quantization axis in lossy modes;
    ``sink``: leading tokens kept exact in lossy modes (0 for a later delta);
    ``borrow``: a raw blob's payload is a view of ``u``, valid while ``u`` is
    (packed into a frame at once, the payload is copied once instead of twice;
    a strided ``u``, read in place from a cache, as its contiguous runs)."""
    if mode not in MODES:
        raise CheckpointError(f"unknown checkpoint mode '{mode}' (choose from {', '.join(MODES)})")
    if mode == "raw":
        data = _runs(u) if borrow else np.ascontiguousarray(u).tobytes()
        return {"codec": "raw", "dtype": dtype, "shape": list(u.shape), "nbytes": u.nbytes,
                "parts": [data], "meta": {}}
    if mode == "lossless" or dtype not in FLOATS or u.ndim < 2:
        return encode_lossless(u, dtype)
    # int4 keys keep their few outlier channels at 8 bits. Measured on SmolLM2, mean
    # top-1 over 8 windows of 2,048 tokens: 0.906 without; with 4 / 6 / 8 outlier
    # channels 0.951 / 0.955 / 0.963 at 4.24 / 4.12 / 4.03x. Per-channel key groups
    # (KIVI) gave 0.963 at 4.0x; 32-value groups 0.955 at 4.7x but 0.875 in one window.
    if mode == "int4" and role == "keys" and 1 < u.shape[-1] <= 256:
        return encode_outliers(u, dtype, 4, min(OUTLIERS, u.shape[-1] - 1), sink=sink)
    return encode_symmetric(u, dtype, 8 if mode == "int8" else 4, sink=sink)


def _runs(u: np.ndarray) -> memoryview | Gather:
    """``u``'s bytes in C order, by reference: one view if contiguous, else the views
    of its contiguous runs (a KV slice ``[1, heads, tokens, dim]`` of a longer
    cache: one run a head)."""
    if u.flags.c_contiguous:
        return memoryview(u).cast("B")
    k = 0
    while k < u.ndim and not u[(0,) * k].flags.c_contiguous:
        k += 1
    if k == u.ndim or math.prod(u.shape[:k]) > 4096:  # no long runs: one copy is cheaper
        return memoryview(np.ascontiguousarray(u)).cast("B")
    return Gather(memoryview(u[i]).cast("B") for i in np.ndindex(*u.shape[:k]))




def decode(b: dict, where: str) -> np.ndarray:
    """Decode a blob to its raw bits (unsigned view); validates every declared size."""
    if not isinstance(b, dict) or not isinstance(b.get("codec"), str):
        raise CheckpointError(f"{where}: malformed tensor blob")
    dtype, shape = b.get("dtype"), b.get("shape")
    nbytes = check_shape(shape, dtype, where)
    if b.get("nbytes") != nbytes:
        raise CheckpointError(f"{where}: declared size {b.get('nbytes')} does not match shape {shape}")
    codec = b["codec"]
    if codec == "raw":
        raw = part(b, 0, where)
        if len(raw) != nbytes:
            raise CheckpointError(f"{where}: payload is {len(raw)} bytes, expected {nbytes}")
        return np.frombuffer(raw, dtype=DTYPES[dtype][0]).reshape(shape)
    if codec in ("zstd", "xsplit"):
        return _decode_lossless(b, nbytes, where)
    if codec in ("sq8", "sq4"):
        return decode_symmetric(b, nbytes, where)
    if codec == "so4":
        return decode_outliers(b, nbytes, where)
    if codec in ("q8", "q4"):  # the earlier affine codec
        return decode_quantized(b, nbytes, where)
    raise CheckpointError(f"{where}: unknown codec '{codec}'")


def encode_bytes(data: bytes) -> dict:
    return {"codec": "zstd", "dtype": "uint8", "shape": [len(data)], "nbytes": len(data),
            "parts": [compress(data)], "meta": {}}


def decode_bytes(b: dict, where: str, max_bytes: int) -> bytes:
    u = decode(b, where)
    if u.nbytes > max_bytes:
        raise CheckpointError(f"{where}: {u.nbytes} bytes, over the {max_bytes}-byte limit")
    return u.tobytes()
