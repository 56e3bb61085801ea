"""Host memory the copy engine reads a session's KV into, kept between extractions.

A fresh numpy buffer's pages are new to the process, and the first write to each
costs a fault: on an H100 host the copy engine read 179 MB of KV into fresh memory
in 112 ms, into pages already touched in 15 (stop 65). So an extraction takes its
batch from blocks the process keeps. A block is free again once no array refers to
it (the frames that borrowed its bytes were sent and dropped), which CPython's
reference count tells exactly: every numpy view of a block has the block as its
``base``. A request larger than a block, or past ``CAP_BYTES`` of blocks all in
use, gets a fresh buffer, as before. Where the CUDA runtime is reached, a block is
also page-locked once, so the copy engine writes it without staging.

A GPU host keeps a second set for the frames its lane receives: the landing's copy
engine reads each frame's KV from there, and read 179 MB from pageable memory in
21-24 ms against 4.6 from page-locked (stop 65). A CPU host's lane keeps its own few
buffers (:mod:`kvferry.migration_lane`): there, kept huge blocks only slowed a host's
first migration (the kernel compacting memory for their huge pages).
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from . import unified

BLOCK_BYTES = 64 << 20  # one extraction batch (kv_extract.DEVICE_BATCH_BYTES is this)
CAP_BYTES = 256 << 20  # kept for the process's life: a 7.7k-token SmolLM2 session's KV is 179 MB
FRAME_BLOCK_BYTES = 20 << 20  # a lane frame, one layer's KV: SmolLM2's 5.9 MB at 7.7k tokens, 1B's 16 MiB at 8k
FRAME_CAP_BYTES = 320 << 20  # frames read ahead of the landing: up to 16 of those blocks
_FREE = 3  # references to a block nobody uses: the list's, the loop's and getrefcount's own


class HostBlocks:
    """Blocks of ``block`` bytes, at most ``cap`` bytes of them, handed out as views
    (``pin``: page-locked where the CUDA runtime is reached)."""

    def __init__(self, block: int = BLOCK_BYTES, cap: int = CAP_BYTES, pin: bool = True) -> None:
        self.block, self.cap, self.pin = block, cap, pin
        self.blocks: list[np.ndarray] = []
        self.fresh = 0  # requests answered with a buffer of their own (too large, or every block in use)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory (uint8), valid while the returned array or a view of
        it lives; a kept block's pages are touched already."""
        with self._lock:
            if nbytes <= self.block:
                for b in self.blocks:
                    if sys.getrefcount(b) <= _FREE:
                        return b[:nbytes]
                if not self._full():
                    b = np.empty(self.block, np.uint8)
                    if self.pin:
                        unified.pin(b)  # a failure only leaves it pageable
                    self.blocks.append(b)
                    return b[:nbytes]
            self.fresh += 1
        return np.empty(nbytes, np.uint8)

    def _full(self) -> bool:
        """Whether one more block would pass the cap (called under the lock)."""
        return (len(self.blocks) + 1) * self.block > self.cap

    def fill(self) -> None:
        """Blocks up to the cap, each touched (page-locked, where it can be) before it
        is listed: a first extraction then finds them ready."""
        while True:
            with self._lock:
                if self._full():
                    return
            b = np.empty(self.block, np.uint8)
            if not (self.pin and unified.pin(b)):
                b.fill(0)
            with self._lock:
                if self._full():
                    return
                self.blocks.append(b)


_blocks = HostBlocks()
_frames = HostBlocks(FRAME_BLOCK_BYTES, FRAME_CAP_BYTES)


def warm() -> None:
    """Where the copy engine reaches the host (a GPU), fill the process's blocks ahead
    of its first migration, which would otherwise pay each page's first touch and
    lock (179 MB: 39-48 ms on an H100, against 4.6 once kept). A host server starts
    it on a thread of its own; on a CPU it does nothing."""
    if unified.available():
        _blocks.fill()
        _frames.fill()


def take(nbytes: int) -> np.ndarray:
    """:meth:`HostBlocks.take` of the process's blocks (a source's extraction)."""
    return _blocks.take(nbytes)


def frame(nbytes: int) -> np.ndarray | None:
    """Room for a lane frame of ``nbytes`` from the frames' blocks where the copy engine
    reaches the host (a GPU); None on a CPU, whose lane keeps buffers of its own."""
    return _frames.take(nbytes) if unified.available() else None
