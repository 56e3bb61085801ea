"""Transfer's frame messages, written and read by hand (a leaf: both sides import it).

A migration moves its KV as ``MigrationMessage(frame=FramePart(seq, data))``,
megabytes each. protobuf copies ``data`` holding the GIL on each side: building and
serializing the message on the source, and every read of ``.data`` on the target
(upb returns a fresh ``bytes`` each time). Beside a generating session each copy
is time its step thread waits for the GIL, and on the target the copies were most
of the landing. So the source writes these messages itself (one join, without the
GIL), and the target reads them as a view of the received bytes (no copy). Any
other message, or a frame message in any other encoding protobuf accepts, goes
through protobuf as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checkpoint.frames import Checked, Parts
from .proto import kvferry_pb2 as pb

_FRAME, _SEQ, _DATA = 0x12, 0x08, 0x12  # MigrationMessage.frame (2, bytes); FramePart.seq (1, varint), data (2)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame_message(seq: int, data: bytes | Parts) -> bytes:
    """``MigrationMessage(frame=FramePart(seq, data))`` as protobuf encodes it: one
    join, which lets go of the GIL for a large frame."""
    part = bytes((_SEQ,)) + _varint(seq) + bytes((_DATA,)) + _varint(len(data))
    body = data.buffers if isinstance(data, Parts) else (data,)
    return b"".join((bytes((_FRAME,)), _varint(len(part) + len(data)), part, *body))


def write_message(m: Any) -> bytes:
    """Transfer's request serializer: a frame message comes written already."""
    return m if isinstance(m, bytes) else m.SerializeToString()


@dataclass
class FrameView:
    """A frame message read in place: ``data`` is a view of the received bytes
    (``checked``: its frames' checksums, where its reader computed them ahead)."""

    seq: int
    data: memoryview
    checked: Checked | None = None


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, next position), or (-1, pos) for a varint that is cut short or
    longer than 9 bytes (past any seq or length a frame message can hold)."""
    n = shift = 0
    for i in range(pos, min(pos + 9, len(buf))):
        b = buf[i]
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i + 1
        shift += 7
    return -1, pos


def _frame_view(raw: bytes) -> FrameView | None:
    """The frame message ``raw`` holds, if it is exactly what :func:`frame_message`
    writes (each length consistent with the message's size); else None."""
    buf = memoryview(raw)
    if len(buf) < 6 or buf[0] != _FRAME:
        return None
    size, pos = _read_varint(buf, 1)
    if size <= 0 or size != len(buf) - pos or buf[pos] != _SEQ:
        return None
    seq, pos = _read_varint(buf, pos + 1)
    if seq < 0 or pos >= len(buf) or buf[pos] != _DATA:
        return None
    n, pos = _read_varint(buf, pos + 1)
    if n != len(buf) - pos:
        return None
    return FrameView(seq, buf[pos:])


def read_message(raw: bytes) -> Any:
    """Transfer's request deserializer: a :class:`FrameView` for a frame message
    as the source writes it, else the protobuf message (which raises on bytes that
    are not one)."""
    return _frame_view(raw) or pb.MigrationMessage.FromString(raw)
