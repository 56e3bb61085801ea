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

Bodies are msgpack maps (never pickle, :mod:`checkpoint.bodies`); bulk payloads
inside them are codec blobs (see :mod:`checkpoint.codecs`). A writer emits frames
as they are ready; a reader verifies each frame on arrival, so a checkpoint can be
streamed (gRPC) and applied incrementally. KV frames carry token ranges, so later tokens can be
appended to a checkpoint already sent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator

import xxhash

from .bodies import MAX_BODY, VIEWS_FROM, body_pieces, packed, unpack, unpack_views
from .errors import CheckpointError

MAGIC = b"KVFERRY\0"
FORMAT_VERSION = 2  # written; READS are read
READS = (1, 2)
PREAMBLE = struct.Struct("<8sHH")
FRAME_HEAD = struct.Struct("<BBHIQ")

HEADER, KV, STATE, GUEST, TRAILER = 1, 2, 3, 4, 255
KIND_NAMES = {HEADER: "header", KV: "kv", STATE: "state", GUEST: "guest", TRAILER: "trailer"}


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


def frame_checksum(version: int, kind: int, pieces: Iterable) -> int:
    """The checksum a frame's head holds: of its kind byte, then its body's pieces."""
    h = _checksum(version)
    h.update(bytes([kind]))
    for p in pieces:
        h.update(p)
    return h.intdigest()


def _body_checksum(version: int, kind: int, body: memoryview) -> int:
    """:func:`frame_checksum` of a received body (the reader's, apart from the writer's)."""
    return frame_checksum(version, kind, (body,))


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


def encode_frame(kind: int, obj: Any) -> bytes:
    # A large payload is copied once, by the join, which lets go of the GIL (past
    # 1 MiB) as the hash does: a generating session's thread runs on meanwhile
    # (msgpack's own buffer held it for each copy, see docs/migration.md).
    return b"".join(encode_frame_parts(kind, obj).buffers)


def encode_frame_parts(kind: int, obj: Any, version: int = FORMAT_VERSION) -> Parts:
    """:func:`encode_frame` as its buffers: each large payload by reference."""
    return _framed(kind, body_pieces(obj), version)


def encode_frame_packed(kind: int, obj: Any) -> bytes:
    """:func:`encode_frame` of a body whose payloads are all small and its own (a live
    pause's last delta: 30 layers' few tokens in one frame), packed by msgpack in one
    call: the same bytes, ~8x faster than walking its ~1,300 parts in Python. A
    :class:`Gather` (a view to splice) is refused: it belongs in :func:`encode_frame`."""
    return b"".join(_packed_parts(kind, obj).buffers)


def _packed_parts(kind: int, obj: Any, version: int = FORMAT_VERSION) -> Parts:
    return _framed(kind, [packed(obj)], version)


def _framed(kind: int, pieces: list, version: int = FORMAT_VERSION) -> Parts:
    size = sum(memoryview(p).nbytes for p in pieces)
    if size > MAX_BODY:
        raise CheckpointError(f"{KIND_NAMES.get(kind, kind)} frame of {size} bytes exceeds "
                              f"the {MAX_BODY >> 20} MiB frame limit")
    return Parts([FRAME_HEAD.pack(kind, 0, 0, size, frame_checksum(version, kind, pieces)), *pieces])


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
