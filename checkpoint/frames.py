"""The checkpoint container: a preamble, then self-checking frames.

    preamble  b"KVFERRY\\0" | u16 format version | u16 flags           (12 bytes)
    frame     u8 kind | u8 0 | u16 0 | u32 body length | u64 xxh3-64(kind+body) | body
    ...
    trailer   a frame of kind TRAILER: {frames, digest}  digest = xxh3-128 of the
              preamble and every frame's head before the trailer frame

Each byte is hashed once: a frame's head holds its body's checksum, so the
digest over the heads covers the bodies, their order and their count. Version 1
(still read) checksummed with xxh64 and digested every byte a second time: on a
GPU host those two passes were 40 ms of a 178 MB landing's 178 (docs/performance-log.md).

Bodies are msgpack maps (never pickle); bulk payloads inside them are codec
blobs (see :mod:`checkpoint.codecs`). A writer emits frames as they are ready; a
reader verifies each frame on arrival, so a checkpoint can be streamed (gRPC)
and applied incrementally. KV frames carry token ranges, so later tokens can be
appended to a checkpoint already sent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator

import msgpack
import xxhash

from .errors import CheckpointError

MAGIC = b"KVFERRY\0"
FORMAT_VERSION = 2  # written; READS are read
READS = (1, 2)
PREAMBLE = struct.Struct("<8sHH")
FRAME_HEAD = struct.Struct("<BBHIQ")
MAX_BODY = 256 << 20  # no single frame may declare more than this

HEADER, KV, STATE, GUEST, TRAILER = 1, 2, 3, 4, 255
KIND_NAMES = {HEADER: "header", KV: "kv", STATE: "state", GUEST: "guest", TRAILER: "trailer"}

_UNPACK_LIMITS = dict(max_bin_len=MAX_BODY, max_str_len=16 << 20, max_array_len=1 << 24,
                      max_map_len=1 << 16, max_ext_len=0)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


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


@dataclass
class Frame:
    index: int
    kind: int
    body: Any  # unpacked msgpack
    nbytes: int  # on-the-wire size
    borrowed: bool = False  # its large payloads are views of the caller's buffer (FrameDecoder views)

    @property
    def name(self) -> str:
        return f"frame {self.index} ({KIND_NAMES.get(self.kind, self.kind)})"


def preamble(version: int = FORMAT_VERSION) -> bytes:
    return PREAMBLE.pack(MAGIC, version, 0)


def _checksum(version: int) -> Any:
    """A frame's checksum, started: xxh64 in version 1, xxh3-64 (2.5x as fast) since."""
    return xxhash.xxh64() if version == 1 else xxhash.xxh3_64()


def _body_checksum(version: int, kind: int, body: memoryview) -> int:
    h = _checksum(version)
    h.update(bytes([kind]))
    h.update(body)
    return h.intdigest()


@dataclass(frozen=True)
class Checked:
    """The checksums of a chunk's whole frames, computed ahead of its decoding, by
    each frame's offset in the chunk, for the format ``version``. A lane's reader
    hashes a frame as it arrives (xxhash lets go of the GIL) while the handler lands
    the one before; the decoder still compares each to its frame head's."""

    version: int
    sums: dict[int, int]


def check_ahead(chunk: Any, version: int = FORMAT_VERSION) -> Checked:
    """:class:`Checked` for the whole frames at the start of ``chunk`` (a chunk of
    frames after the preamble); it stops, without a word, where they end or look
    wrong, and the decoder reports that."""
    buf, pos, sums = memoryview(chunk).cast("B"), 0, {}
    while len(buf) - pos >= FRAME_HEAD.size:
        kind, _, _, n, _ = FRAME_HEAD.unpack_from(buf, pos)
        end = pos + FRAME_HEAD.size + n
        if kind not in KIND_NAMES or n > MAX_BODY or end > len(buf):
            break
        sums[pos] = _body_checksum(version, kind, buf[pos + FRAME_HEAD.size:end])
        pos = end
    return Checked(version, sums)


SPLICE_BYTES = 1 << 16  # payloads this large are joined into their frame, not copied into msgpack's buffer
# A KV body this large is read in place (unpack_views); a smaller one by msgpack's C reader:
# copying under 1 MiB costs less than walking a live pause's last delta, ~1,300 small
# parts, in Python (0.06 against 0.9 ms on this CPU, 30 layers).
VIEWS_FROM = 1 << 20


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


class Parts:
    """A frame as the buffers it is made of (the frame is their concatenation).
    Written with scatter-gather I/O it is never joined: on this 2-core VM each
    join into fresh memory cost more than the wire (page faults)."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: list):
        self.buffers = buffers
        self.nbytes = sum(memoryview(b).nbytes for b in buffers)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers)


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


def encode_frame(kind: int, obj: Any) -> bytes:
    # A large payload is copied once, by the join, which lets go of the GIL (past
    # 1 MiB) as the hash does: a generating session's thread runs on meanwhile
    # (msgpack's own buffer held it for each copy, see docs/migration.md).
    return b"".join(encode_frame_parts(kind, obj).buffers)


def encode_frame_parts(kind: int, obj: Any, version: int = FORMAT_VERSION) -> Parts:
    """:func:`encode_frame` as its buffers: each large payload by reference."""
    pieces: list = []
    small = bytearray()
    _pieces(obj, msgpack.Packer(use_bin_type=True), pieces, small)
    _flush(pieces, small)
    return _framed(kind, pieces, version)


def encode_frame_packed(kind: int, obj: Any) -> bytes:
    """:func:`encode_frame` of a body whose payloads are all small and its own (a live
    pause's last delta: 30 layers' few tokens in one frame), packed by msgpack in one
    call: the same bytes, ~8x faster than walking its ~1,300 parts in Python. A
    :class:`Gather` (a view to splice) is refused: it belongs in :func:`encode_frame`."""
    return b"".join(_packed_parts(kind, obj).buffers)


def _packed_parts(kind: int, obj: Any, version: int = FORMAT_VERSION) -> Parts:
    return _framed(kind, [msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_exact)], version)


def _exact(obj: Any) -> Any:
    if type(obj) is tuple:  # packed as a list, as msgpack packs a tuple without strict_types
        return list(obj)
    raise TypeError(f"a {type(obj).__name__} in a packed frame (encode_frame splices views)")


def _framed(kind: int, pieces: list, version: int = FORMAT_VERSION) -> Parts:
    size = sum(memoryview(p).nbytes for p in pieces)
    if size > MAX_BODY:
        raise CheckpointError(f"{KIND_NAMES.get(kind, kind)} frame of {size} bytes exceeds "
                              f"the {MAX_BODY >> 20} MiB frame limit")
    h = _checksum(version)
    h.update(bytes([kind]))
    for p in pieces:
        h.update(p)
    return Parts([FRAME_HEAD.pack(kind, 0, 0, size, h.intdigest()), *pieces])


class FrameWriter:
    """Emits the preamble, frames and trailer; tracks the running digest. ``version``:
    the format written (1 only to make what an older kvferry wrote, say in a test)."""

    def __init__(self, version: int = FORMAT_VERSION) -> None:
        self.version = version
        self.digest = xxhash.xxh3_128()
        self.count = 0
        self.bytes = 0
        self.started = False

    def _out(self, data: bytes) -> bytes:
        self.digest.update(data)
        self.bytes += len(data)
        return data

    def start(self) -> bytes:
        self.started = True
        return self._out(preamble(self.version))

    def frame(self, kind: int, obj: Any) -> bytes:
        return bytes(self.frame_parts(kind, obj))  # one join, the preamble in it

    def frame_packed(self, kind: int, obj: Any) -> bytes:
        """:meth:`frame` of a body of small payloads of its own (:func:`encode_frame_packed`)."""
        return bytes(self._written(_packed_parts(kind, obj, self.version)))

    def frame_parts(self, kind: int, obj: Any) -> Parts:
        """:meth:`frame` as its buffers (payloads by reference: valid while they are)."""
        return self._written(encode_frame_parts(kind, obj, self.version))

    def _written(self, p: Parts) -> Parts:
        """A frame counted into the running digest, after the preamble if it is the first."""
        head = [] if self.started else [self.start()]
        self.count += 1
        for b in (p.buffers if self.version == 1 else p.buffers[:1]):  # since version 2: its head
            self.digest.update(b)
        self.bytes += p.nbytes
        return Parts(head + p.buffers) if head else p

    def trailer(self) -> bytes:
        t = bytes(encode_frame_parts(TRAILER, {"frames": self.count, "digest": self.digest.hexdigest()},
                                     self.version))
        self.bytes += len(t)
        return t


def _after_trailer(n: int) -> str:
    return f"{n} byte{'s' if n != 1 else ''} after the trailer (the checkpoint ends there)"


class FrameDecoder:
    """Incremental, verifying decoder: feed bytes in any chunking, get frames."""

    def __init__(self, max_total: int = 64 << 30, views: bool = False) -> None:
        # ``views``: a KV frame fed whole in one chunk, of VIEWS_FROM bytes or more, is read
        # in place, its payloads views of that chunk (Frame.borrowed): the caller keeps
        # the chunk until applied
        self.views = views
        self.buf = bytearray()
        self.digest = xxhash.xxh3_128()
        self.version = FORMAT_VERSION  # the stream's, once its preamble is read
        self.have_preamble = False
        self.index = 0
        self.done = False
        self.total = 0
        self.max_total = max_total

    def feed(self, data: bytes, checked: Checked | None = None) -> Iterator[Frame]:
        """Frames completed by ``data``; ``checked``: :func:`check_ahead` of ``data``
        (used where whole frames are read in place)."""
        if self.done and data:
            raise CheckpointError(_after_trailer(len(data)))
        self.total += len(data)
        if self.total > self.max_total:
            raise CheckpointError(f"checkpoint exceeds {self.max_total} bytes")
        if self.have_preamble and not self.buf:
            # whole frames in one chunk (a gRPC message each): read them where they are
            view = memoryview(data)
            sums = checked.sums if checked is not None and checked.version == self.version else None
            used = yield from self._frames(view, self.views, sums)
            self.buf += view[used:]
            self._nothing_after_trailer()
            return
        self.buf += data
        if not self.have_preamble:
            if len(self.buf) < PREAMBLE.size:
                return
            magic, version, _ = PREAMBLE.unpack_from(self.buf)
            if magic != MAGIC:
                raise CheckpointError("not a kvferry checkpoint (bad magic)")
            if version not in READS:
                raise CheckpointError(f"unknown checkpoint format version {version} "
                                      f"(this kvferry reads versions {READS[0]} to {READS[-1]})")
            self.version = version
            self.digest.update(bytes(self.buf[:PREAMBLE.size]))
            del self.buf[:PREAMBLE.size]
            self.have_preamble = True
        view = memoryview(self.buf)
        try:
            used = yield from self._frames(view)
        finally:
            view.release()
        del self.buf[:used]
        self._nothing_after_trailer()

    def _nothing_after_trailer(self) -> None:
        """Bytes in the same chunk as the trailer, after it (a later chunk is refused by feed)."""
        if self.done and self.buf:
            raise CheckpointError(_after_trailer(len(self.buf)))

    def _frames(self, buf: memoryview, views: bool = False, sums: dict[int, int] | None = None):
        """Verify and yield the whole frames at the start of ``buf``; returns the
        bytes they took (``views``: KV bodies as :func:`unpack_views` reads them;
        ``sums``: body checksums computed ahead, by offset in ``buf``)."""
        pos = 0
        while len(buf) - pos >= FRAME_HEAD.size and not self.done:
            kind, r1, r2, n, checksum = FRAME_HEAD.unpack_from(buf, pos)
            where = f"frame {self.index} ({KIND_NAMES.get(kind, f'kind {kind}')})"
            if kind not in KIND_NAMES or r1 or r2:
                raise CheckpointError(f"{where}: bad frame header")
            if n > MAX_BODY:
                raise CheckpointError(f"{where}: declares a {n}-byte body, over the "
                                      f"{MAX_BODY >> 20} MiB frame limit")
            if len(buf) - pos < FRAME_HEAD.size + n:
                break
            raw = buf[pos:pos + FRAME_HEAD.size + n]
            body = raw[FRAME_HEAD.size:]
            got = sums.get(pos) if sums is not None else None
            if (got if got is not None else _body_checksum(self.version, kind, body)) != checksum:
                raise CheckpointError(f"{where}: checksum mismatch (corrupted)")
            pos += FRAME_HEAD.size + n
            borrowed = views and kind == KV and n >= VIEWS_FROM
            obj = unpack_views(body, where) if borrowed else unpack(body, where)
            if kind == TRAILER:
                if not isinstance(obj, dict) or obj.get("frames") != self.index or \
                        obj.get("digest") != self.digest.hexdigest():
                    raise CheckpointError(f"{where}: trailer does not match the frames before it "
                                          f"(digest or frame count)")
                self.done = True
            else:
                self.digest.update(raw if self.version == 1 else raw[:FRAME_HEAD.size])
            if kind != TRAILER and self.index == 0 and kind != HEADER:
                raise CheckpointError(f"{where}: the first frame must be the header")
            yield Frame(self.index, kind, obj, len(raw), borrowed)
            self.index += 1
        return pos

    def close(self) -> None:
        if not self.have_preamble:
            raise CheckpointError("truncated: no checkpoint preamble")
        if not self.done:
            extra = f" ({len(self.buf)} bytes of a partial frame)" if self.buf else ""
            raise CheckpointError(f"truncated: stream ends after frame {self.index - 1} "
                                  f"without a trailer{extra}")


def iter_frames(chunks: Iterable[bytes]) -> Iterator[Frame]:
    dec = FrameDecoder()
    for chunk in chunks:
        yield from dec.feed(chunk)
    dec.close()


def read_file_chunks(f: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk
