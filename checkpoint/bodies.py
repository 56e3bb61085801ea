"""A frame's body: a msgpack map, packed with its large payloads by reference and
read with them as views of the received buffer. A leaf that treats input as
hostile: the same types and limits as msgpack's own reader, never pickle.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .errors import CheckpointError

MAX_BODY = 256 << 20  # no frame may declare a larger body, so no payload in one is larger
SPLICE_BYTES = 1 << 16  # payloads this large are joined into their frame, not copied into msgpack's buffer
# A KV body this large is read in place (unpack_views); a smaller one by msgpack's C reader:
# copying under 1 MiB costs less than walking a live pause's last delta, ~1,300 small
# parts, in Python (0.06 against 0.9 ms on this CPU, 30 layers).
VIEWS_FROM = 1 << 20

_UNPACK_LIMITS = dict(max_bin_len=MAX_BODY, max_str_len=16 << 20, max_array_len=1 << 24,
                      max_map_len=1 << 16, max_ext_len=0)


def unpack(body: bytes, where: str) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises many types on hostile input
        raise CheckpointError(f"{where}: malformed msgpack body ({type(e).__name__})") from None


_FIXED = {0xC0: None, 0xC2: False, 0xC3: True}
_NUMS = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
         0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_SIZED = {0xC4: (1, "bin"), 0xC5: (2, "bin"), 0xC6: (4, "bin"), 0xD9: (1, "str"), 0xDA: (2, "str"),
          0xDB: (4, "str"), 0xDC: (2, "array"), 0xDD: (4, "array"), 0xDE: (2, "map"), 0xDF: (4, "map")}
_LIMITS = {"bin": MAX_BODY, "str": 16 << 20, "array": 1 << 24, "map": 1 << 16}
MAX_DEPTH = 32


class _Reader:
    """msgpack as :func:`unpack` reads it (the same types and limits), but a bin of
    SPLICE_BYTES or more comes back as a view of ``buf``, not a copy: the KV
    payloads of a frame received into a buffer are read where they lie."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n > len(self.buf) - self.pos:
            raise ValueError("truncated")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def read(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        b = self.take(1)[0]
        if b <= 0x7F or b >= 0xE0:
            return b if b <= 0x7F else b - 0x100
        if b in _FIXED:
            return _FIXED[b]
        if b in _NUMS:
            fmt = _NUMS[b]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if 0x80 <= b <= 0x9F:
            n, kind = b & 0x0F, "map" if b <= 0x8F else "array"
        elif 0xA0 <= b <= 0xBF:
            n, kind = b & 0x1F, "str"
        elif b in _SIZED:
            width, kind = _SIZED[b]
            n = int.from_bytes(self.take(width), "big")
        else:
            raise ValueError(f"type byte 0x{b:02x}")
        if n > _LIMITS[kind]:
            raise ValueError(f"{kind} of {n} over the limit")
        if kind == "bin":
            v = self.take(n)
            return v if n >= SPLICE_BYTES else bytes(v)
        if kind == "str":
            return str(self.take(n), "utf-8")
        if kind == "array":
            return [self.read(depth + 1) for _ in range(n)]
        out = {}
        for _ in range(n):
            k = self.read(depth + 1)
            if not isinstance(k, (str, bytes)):
                raise ValueError("map key not str or bytes")
            out[k] = self.read(depth + 1)
        return out


def unpack_views(body: memoryview, where: str) -> Any:
    """:func:`unpack`, large bins as views of ``body`` (valid while it is)."""
    r = _Reader(body)
    try:
        obj = r.read()
        if r.pos != len(body):
            raise ValueError("extra bytes")
        return obj
    except Exception as e:  # hostile input: any error is a malformed body
        raise CheckpointError(f"{where}: malformed msgpack body ({type(e).__name__})") from None


def _bin_head(n: int) -> bytes:
    """msgpack's bin header for ``n`` bytes (the smallest that fits, as msgpack packs)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


class Gather(tuple):
    """Buffers that pack as one msgpack bin, their concatenation: the contiguous
    runs of a strided view (a layer's KV read in place from its cache), never
    joined by the framer."""

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self)


def _pieces(obj: Any, packer: msgpack.Packer, out: list, small: bytearray) -> None:
    """``obj`` packed as msgpack packs it, as a list of buffers: each large payload by
    reference (a view is never copied here), the small parts between two of them packed
    into one buffer (``small``, until the caller flushes it). A buffer each made a live
    pause's last delta (30 layers in one frame) ~1,350 buffers, each hashed twice."""
    if isinstance(obj, dict):
        small += packer.pack_map_header(len(obj))
        for k, v in obj.items():
            small += packer.pack(k)
            _pieces(v, packer, out, small)
    elif isinstance(obj, Gather):  # before tuple, which it is
        small += _bin_head(obj.nbytes)
        _flush(out, small)
        out += obj
    elif isinstance(obj, (list, tuple)):
        small += packer.pack_array_header(len(obj))
        for v in obj:
            _pieces(v, packer, out, small)
    elif isinstance(obj, (bytes, bytearray, memoryview)) and (n := memoryview(obj).nbytes) >= SPLICE_BYTES:
        small += _bin_head(n)
        _flush(out, small)
        out.append(obj)
    else:
        small += packer.pack(obj)


def _flush(out: list, small: bytearray) -> None:
    if small:
        out.append(bytes(small))
        small.clear()


def body_pieces(obj: Any) -> list:
    """``obj`` packed as a list of buffers whose concatenation is msgpack's packing,
    each large payload by reference (see :func:`_pieces`)."""
    out: list = []
    small = bytearray()
    _pieces(obj, msgpack.Packer(use_bin_type=True), out, small)
    _flush(out, small)
    return out


def packed(obj: Any) -> bytes:
    """``obj`` packed by msgpack in one call, where its payloads are all small and its
    own; a :class:`Gather` (a view to splice) is refused."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_exact)


def _exact(obj: Any) -> Any:
    if type(obj) is tuple:  # packed as a list, as msgpack packs a tuple without strict_types
        return list(obj)
    raise TypeError(f"a {type(obj).__name__} in a packed frame (encode_frame splices views)")

