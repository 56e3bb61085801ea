"""The checkpoint container: a preamble, then self-checking frames.

    preamble  b"KVFERRY\\0" | u16 format version | u16 flags           (12 bytes)
    frame     u8 kind | u8 0 | u16 0 | u32 body length | u64 xxh64(kind+body) | body
    ...
    trailer   a frame of kind TRAILER: {frames, digest}  digest = xxh3-128 of
              every byte before the trailer frame

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
FORMAT_VERSION = 1
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


@dataclass
class Frame:
    index: int
    kind: int
    body: Any  # unpacked msgpack
    nbytes: int  # on-the-wire size

    @property
    def name(self) -> str:
        return f"frame {self.index} ({KIND_NAMES.get(self.kind, self.kind)})"


def preamble() -> bytes:
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0)


SPLICE_BYTES = 1 << 16  # payloads this large are joined into their frame, not copied into msgpack's buffer


def _bin_head(n: int) -> bytes:
    """msgpack's bin header for ``n`` bytes (the smallest that fits, as msgpack packs)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _pieces(obj: Any, packer: msgpack.Packer, out: list) -> None:
    """``obj`` packed as msgpack packs it, as a list of buffers: the small parts
    packed, each large payload by reference (a view is never copied here)."""
    if isinstance(obj, dict):
        out.append(packer.pack_map_header(len(obj)))
        for k, v in obj.items():
            out.append(packer.pack(k))
            _pieces(v, packer, out)
    elif isinstance(obj, (list, tuple)):
        out.append(packer.pack_array_header(len(obj)))
        for v in obj:
            _pieces(v, packer, out)
    elif isinstance(obj, (bytes, bytearray, memoryview)) and (n := memoryview(obj).nbytes) >= SPLICE_BYTES:
        out += (_bin_head(n), obj)
    else:
        out.append(packer.pack(obj))


def encode_frame(kind: int, obj: Any) -> bytes:
    # A large payload is copied once, by the join, which lets go of the GIL (past
    # 1 MiB) as the hash does: a generating session's thread runs on meanwhile
    # (msgpack's own buffer held it for each copy, see docs/migration.md).
    pieces: list = []
    _pieces(obj, msgpack.Packer(use_bin_type=True), pieces)
    size = sum(memoryview(p).nbytes for p in pieces)
    if size > MAX_BODY:
        raise CheckpointError(f"{KIND_NAMES.get(kind, kind)} frame of {size} bytes exceeds "
                              f"the {MAX_BODY >> 20} MiB frame limit")
    h = xxhash.xxh64(bytes([kind]))
    for p in pieces:
        h.update(p)
    return b"".join((FRAME_HEAD.pack(kind, 0, 0, size, h.intdigest()), *pieces))


class FrameWriter:
    """Emits the preamble, frames and trailer; tracks the running digest."""

    def __init__(self) -> None:
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
        return self._out(preamble())

    def frame(self, kind: int, obj: Any) -> bytes:
        out = b"" if self.started else self.start()
        self.count += 1
        return out + self._out(encode_frame(kind, obj))

    def trailer(self) -> bytes:
        t = encode_frame(TRAILER, {"frames": self.count, "digest": self.digest.hexdigest()})
        self.bytes += len(t)
        return t


def _after_trailer(n: int) -> str:
    return f"{n} byte{'s' if n != 1 else ''} after the trailer (the checkpoint ends there)"


class FrameDecoder:
    """Incremental, verifying decoder: feed bytes in any chunking, get frames."""

    def __init__(self, max_total: int = 64 << 30) -> None:
        self.buf = bytearray()
        self.digest = xxhash.xxh3_128()
        self.have_preamble = False
        self.index = 0
        self.done = False
        self.total = 0
        self.max_total = max_total

    def feed(self, data: bytes) -> Iterator[Frame]:
        if self.done and data:
            raise CheckpointError(_after_trailer(len(data)))
        self.total += len(data)
        if self.total > self.max_total:
            raise CheckpointError(f"checkpoint exceeds {self.max_total} bytes")
        if self.have_preamble and not self.buf:
            # whole frames in one chunk (a gRPC message each): read them where they are
            view = memoryview(data)
            used = yield from self._frames(view)
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
            if version != FORMAT_VERSION:
                raise CheckpointError(f"unknown checkpoint format version {version} "
                                      f"(this kvferry reads version {FORMAT_VERSION})")
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

    def _frames(self, buf: memoryview):
        """Verify and yield the whole frames at the start of ``buf``; returns the
        bytes they took."""
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
            h = xxhash.xxh64(bytes([kind]))
            h.update(body)
            if h.intdigest() != checksum:
                raise CheckpointError(f"{where}: checksum mismatch (corrupted)")
            pos += FRAME_HEAD.size + n
            obj = unpack(body, where)
            if kind == TRAILER:
                if not isinstance(obj, dict) or obj.get("frames") != self.index or \
                        obj.get("digest") != self.digest.hexdigest():
                    raise CheckpointError(f"{where}: trailer does not match the frames before it "
                                          f"(digest or frame count)")
                self.done = True
            else:
                self.digest.update(raw)
            if kind != TRAILER and self.index == 0 and kind != HEADER:
                raise CheckpointError(f"{where}: the first frame must be the header")
            yield Frame(self.index, kind, obj, len(raw))
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
