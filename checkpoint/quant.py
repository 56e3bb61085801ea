"""Lossy KV codecs: ``int8`` / ``int4`` (``sq8``/``sq4``, ``so4``) and the earlier ``q8``/``q4``.

Group-wise symmetric quantization (groups of 64 along the head dim, codes in
-127..127 / -7..7), each group's scale stored in one byte as a 1/16-octave step
above a per-tensor base (rounded up, so nothing clips): 0.125 bits per value of
side data instead of 0.5 for a float16 scale and bias. Codes are laid out
channel-major and entropy-coded with zstd. ``int4`` keys (``so4``) keep the 6
channels per head of largest mean magnitude apart, at 8 bits with one scale per
channel; the rest get 4-bit codes with one scale per token, no longer rounded to
a few levels by those outliers. The affine ``q8``/``q4`` codec only still loads.
"""

from __future__ import annotations

import numpy as np

from .blob import DTYPES, FLOATS, compress, decompress_capped, part
from .errors import CheckpointError

def to_float32(u: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return u.view(np.float32)
    if dtype == "float16":
        return u.view(np.float16).astype(np.float32)
    return (u.astype(np.uint32) << 16).view(np.float32)  # bfloat16


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x.astype(np.float32).view(np.uint32)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _split_sink(u: np.ndarray, dtype: str, sink: int) -> tuple[int, int, int, bytes, np.ndarray]:
    """The first ``sink`` tokens' exact bits (compressed) and the rest as float32
    ``[BH, T - sink, D]``; returns ``(t, d, sink, sink_part, x)`` with ``t`` all tokens."""
    t, d = (u.shape[-2], u.shape[-1]) if u.ndim >= 2 else (1, u.shape[-1])
    sink = max(0, min(sink, t - 1))
    sink_part = b""
    if sink:
        sink_part = compress(np.ascontiguousarray(u.reshape(-1, t, d)[:, :sink]).tobytes(), 1)
    return t, d, sink, sink_part, to_float32(u, dtype).reshape(-1, t, d)[:, sink:]


def _join_sink(b: dict, i: int, out: np.ndarray, sink: int, where: str) -> np.ndarray:
    """Prepend the exact sink tokens (payload part ``i``) to decoded ``out`` ``[BH, T', D]``."""
    if not sink:
        return out
    utype, width = DTYPES[b["dtype"]]
    bh, d = out.shape[0], out.shape[2]
    n = bh * sink * d * width
    raw = decompress_capped(part(b, i, where), n, where)
    if len(raw) != n:
        raise CheckpointError(f"{where}: sink tokens are {len(raw)} bytes, expected {n}")
    return np.concatenate([np.frombuffer(raw, dtype=utype).reshape(bh, sink, d), out], axis=1)


def encode_quantized(u: np.ndarray, dtype: str, bits: int, group: int = 64, axis: str = "d",
                     sink: int = 0) -> dict:
    """Affine ``bits``-bit codes in groups of ``group`` values: along the head dim
    (``axis="d"``, one group per token — values) or along time per channel
    (``axis="t"`` — keys, whose outlier channels would otherwise set every
    token's range, as KIVI observes). The first ``sink`` tokens (attention
    sinks, which most heads attend to heavily) are kept bit-exact."""
    shape = list(u.shape)
    t, d, sink, sink_part, x = _split_sink(u, dtype, sink)
    t -= sink
    if axis == "t":
        x = x.transpose(0, 2, 1)  # [BH, D, T]
        pad = (-t) % group
        if pad:
            x = np.concatenate([x, np.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
        g = group
    else:
        g = group if d % group == 0 else d
    xg = x.reshape(-1, g)
    lo, hi = xg.min(axis=1, keepdims=True), xg.max(axis=1, keepdims=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(np.float16)
    bias = lo.astype(np.float16)
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1.0)
    codes = np.clip(np.rint((xg - bias.astype(np.float32)) / safe), 0, levels).astype(np.uint8)
    if axis == "d":  # channel-major codes: each channel's codes over time are contiguous
        codes = np.ascontiguousarray(codes.reshape(x.shape).transpose(0, 2, 1))
    return {"codec": f"q{bits}", "dtype": dtype, "shape": shape, "nbytes": u.nbytes,
            "parts": [compress(codes.tobytes()), compress(scale.tobytes()), compress(bias.tobytes()), sink_part],
            "meta": {"group": g, "axis": axis, "layout": list(x.shape), "sink": sink}}


def decode_quantized(b: dict, nbytes: int, where: str) -> np.ndarray:
    dtype, shape = b["dtype"], tuple(b["shape"])
    meta = b.get("meta") or {}
    g, axis = meta.get("group"), meta.get("axis")
    layout = tuple(meta.get("layout", ()))
    t, d = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    sink = meta.get("sink", 0)
    if not isinstance(sink, int) or not 0 <= sink < max(t, 1):
        raise CheckpointError(f"{where}: malformed quantized layout")
    bh = int(np.prod(shape)) // (t * d) if t * d else 0
    t -= sink
    n = bh * t * d
    m = int(np.prod(layout)) if layout else -1
    ok = isinstance(g, int) and g > 0 and len(layout) == 3 and m % g == 0 and m <= 2 * n + 64 * d * 64
    if ok and axis == "t":
        ok = layout[0] * t * d == n and layout[1] == d and layout[2] >= t and layout[2] % g == 0
    elif ok:
        ok = axis == "d" and m == n and layout[1:] == (t, d)
    if not ok:
        raise CheckpointError(f"{where}: malformed quantized layout")
    codes = np.frombuffer(decompress_capped(part(b, 0, where), m, where), dtype=np.uint8)
    scale = np.frombuffer(decompress_capped(part(b, 1, where), 2 * (m // g), where), dtype=np.float16)
    bias = np.frombuffer(decompress_capped(part(b, 2, where), 2 * (m // g), where), dtype=np.float16)
    if codes.size != m or scale.size != m // g or bias.size != m // g:
        raise CheckpointError(f"{where}: quantized payload sizes do not match the shape")
    if axis == "d":
        codes = np.ascontiguousarray(codes.reshape(layout[0], layout[2], layout[1]).transpose(0, 2, 1))
    x = codes.reshape(-1, g).astype(np.float32) * scale.astype(np.float32)[:, None] \
        + bias.astype(np.float32)[:, None]
    x = x.reshape(layout)
    if axis == "t":
        x = x[..., :t].transpose(0, 2, 1)
    bits = _join_sink(b, 3, from_float32(np.ascontiguousarray(x).reshape(bh, t, d), dtype), sink, where)
    return np.ascontiguousarray(bits).reshape(shape)


SCALE_STEPS = 16  # scale resolution: 1/16 octave (a scale is at most 4.4 % coarser than needed)


def encode_symmetric(u: np.ndarray, dtype: str, bits: int, group: int = 64, sink: int = 0) -> dict:
    """Symmetric ``bits``-bit codes in groups of ``group`` values along the head dim,
    one byte of (log) scale per group; the first ``sink`` tokens kept bit-exact."""
    shape = list(u.shape)
    t, d, sink, sink_part, x = _split_sink(u, dtype, sink)
    g = group if d % group == 0 else d
    xg = x.reshape(-1, g)
    levels = (1 << (bits - 1)) - 1
    e, base, scale = _log_scales(np.abs(xg).max(axis=1), levels, bits)
    codes = np.clip(np.rint(xg / scale[:, None]), -levels, levels).astype(np.int8)
    codes = np.ascontiguousarray(codes.reshape(x.shape).transpose(0, 2, 1))  # [BH, D, T]
    return {"codec": f"sq{bits}", "dtype": dtype, "shape": shape, "nbytes": u.nbytes,
            "parts": [compress(codes.view(np.uint8).tobytes()), compress(e.tobytes()), sink_part],
            "meta": {"group": g, "base": base, "sink": sink}}


def _log_scales(amax: np.ndarray, levels: int, bits: int) -> tuple[np.ndarray, int, np.ndarray]:
    """One byte per scale: ``(steps above base as uint8, base, float32 scales)``,
    each scale the smallest 1/16-octave step with ``amax / scale <= levels``."""
    if not np.isfinite(amax).all():
        raise CheckpointError(f"int{bits}: the KV holds non-finite values (inf/nan); use lossless")
    e = np.ceil(np.log2(np.maximum(amax / levels, 2.0 ** -126)) * SCALE_STEPS).astype(np.int64)
    base = int(e.max()) - 255 if e.size else 0
    e = np.maximum(e, base)  # tiny groups share the smallest stored scale: still never clipped
    return (e - base).astype(np.uint8), base, _scales(e - base, base)


def _scales(e: np.ndarray, base: int) -> np.ndarray:
    return np.exp2((e.astype(np.float64) + base) / SCALE_STEPS).astype(np.float32)


OUTLIERS = 6  # key channels per head kept at 8 bits in int4 (of 64)


def encode_outliers(u: np.ndarray, dtype: str, bits: int = 4, k: int = OUTLIERS, sink: int = 0) -> dict:
    """Keys at ``bits`` bits with their outlier channels apart: per head, the ``k``
    channels of largest mean magnitude get 8-bit codes with one scale per
    channel (over the tokens), the rest ``bits``-bit codes with one scale per
    token. A few key channels are far larger than the rest; with them inside a
    token's group, the others round to a handful of levels."""
    shape = list(u.shape)
    t, d, sink, sink_part, x = _split_sink(u, dtype, sink)
    order = np.argsort(-np.abs(x).mean(axis=1), axis=1, kind="stable")  # [BH, D]
    idx, rest = np.sort(order[:, :k], axis=1), np.sort(order[:, k:], axis=1)
    xo = np.take_along_axis(x, idx[:, None, :], axis=2)  # [BH, T, k]
    xr = np.take_along_axis(x, rest[:, None, :], axis=2)  # [BH, T, D - k]
    eo, base_o, so = _log_scales(np.abs(xo).max(axis=1), 127, bits)  # per channel: [BH, k]
    qo = np.clip(np.rint(xo / so[:, None, :]), -127, 127).astype(np.int8)
    levels = (1 << (bits - 1)) - 1
    er, base_r, sr = _log_scales(np.abs(xr).max(axis=2), levels, bits)  # per token: [BH, T]
    qr = np.clip(np.rint(xr / sr[..., None]), -levels, levels).astype(np.int8)
    cm = lambda q: np.ascontiguousarray(q.transpose(0, 2, 1)).view(np.uint8).tobytes()  # noqa: E731
    return {"codec": f"so{bits}", "dtype": dtype, "shape": shape, "nbytes": u.nbytes,
            "parts": [compress(cm(qr)), compress(er.tobytes()), compress(cm(qo)), compress(eo.tobytes()),
                      compress(idx.astype(np.uint8).tobytes()), sink_part],
            "meta": {"k": k, "base": base_r, "base_outliers": base_o, "sink": sink}}


def decode_outliers(b: dict, nbytes: int, where: str) -> np.ndarray:
    dtype, shape = b["dtype"], tuple(b["shape"])
    meta = b.get("meta") or {}
    k, base, base_o, sink = meta.get("k"), meta.get("base"), meta.get("base_outliers"), meta.get("sink", 0)
    t, d = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    bits = int(b["codec"][2:])
    if not (all(isinstance(v, int) for v in (k, base, base_o, sink)) and 0 < k < d <= 256
            and -2400 <= base <= 1700 and -2400 <= base_o <= 1700 and 0 <= sink < max(t, 1)) \
            or dtype not in FLOATS:
        raise CheckpointError(f"{where}: malformed quantized layout")
    bh = int(np.prod(shape)) // (t * d) if t * d else 0
    t -= sink
    qr = np.frombuffer(decompress_capped(part(b, 0, where), bh * t * (d - k), where), dtype=np.int8)
    er = np.frombuffer(decompress_capped(part(b, 1, where), bh * t, where), dtype=np.uint8)
    qo = np.frombuffer(decompress_capped(part(b, 2, where), bh * t * k, where), dtype=np.int8)
    eo = np.frombuffer(decompress_capped(part(b, 3, where), bh * k, where), dtype=np.uint8)
    idx = np.frombuffer(decompress_capped(part(b, 4, where), bh * k, where), dtype=np.uint8).astype(np.int64)
    if qr.size != bh * t * (d - k) or er.size != bh * t or qo.size != bh * t * k or eo.size != bh * k \
            or idx.size != bh * k:
        raise CheckpointError(f"{where}: quantized payload sizes do not match the shape")
    idx = idx.reshape(bh, k)
    if (k > 1 and not (np.diff(idx, axis=1) > 0).all()) or (idx.size and idx.max() >= d):
        raise CheckpointError(f"{where}: outlier channel indices are not increasing channels below {d}")
    levels = (1 << (bits - 1)) - 1
    if qr.size and np.abs(qr.astype(np.int16)).max() > levels:
        raise CheckpointError(f"{where}: int{bits} codes out of range")
    mask = np.zeros((bh, d), bool)
    np.put_along_axis(mask, idx, True, axis=1)
    rest = np.argsort(mask, axis=1, kind="stable")[:, :d - k]  # the other channels, in order
    x = np.empty((bh, t, d), np.float32)
    np.put_along_axis(x, rest[:, None, :], qr.reshape(bh, d - k, t).transpose(0, 2, 1).astype(np.float32)
                      * _scales(er, base).reshape(bh, t, 1), axis=2)
    np.put_along_axis(x, idx[:, None, :], qo.reshape(bh, k, t).transpose(0, 2, 1).astype(np.float32)
                      * _scales(eo, base_o).reshape(bh, 1, k), axis=2)
    return np.ascontiguousarray(_join_sink(b, 5, from_float32(x, dtype), sink, where)).reshape(shape)


def decode_symmetric(b: dict, nbytes: int, where: str) -> np.ndarray:
    dtype, shape = b["dtype"], tuple(b["shape"])
    meta = b.get("meta") or {}
    g, base, sink = meta.get("group"), meta.get("base"), meta.get("sink", 0)
    t, d = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[-1])
    bits = int(b["codec"][2:])
    if not (isinstance(g, int) and isinstance(base, int) and isinstance(sink, int) and 0 < g <= d
            and d % g == 0 and -2400 <= base <= 1700 and 0 <= sink < max(t, 1)) or dtype not in FLOATS:
        raise CheckpointError(f"{where}: malformed quantized layout")
    bh = int(np.prod(shape)) // (t * d) if t * d else 0
    t -= sink
    n = bh * t * d
    codes = np.frombuffer(decompress_capped(part(b, 0, where), n, where), dtype=np.int8)
    e = np.frombuffer(decompress_capped(part(b, 1, where), n // g, where), dtype=np.uint8)
    if codes.size != n or e.size != n // g:
        raise CheckpointError(f"{where}: quantized payload sizes do not match the shape")
    levels = (1 << (bits - 1)) - 1
    if bits < 8 and n and np.abs(codes).max() > levels:
        raise CheckpointError(f"{where}: int{bits} codes out of range")
    scale = _scales(e, base)
    codes = codes.reshape(bh, d, t).transpose(0, 2, 1).reshape(-1, g)
    x = (codes.astype(np.float32) * scale[:, None]).reshape(bh, t, d)
    return np.ascontiguousarray(_join_sink(b, 2, from_float32(x, dtype), sink, where)).reshape(shape)
