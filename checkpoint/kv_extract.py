"""A session's KV read off an accelerator (a mixin of
:class:`kvferry.checkpoint.snapshot.Snapshotter`): beside the host's steps by MLX
copies queued under short holds of its compute lock and read after them, and
held still by the device's copy engine straight out of the caches' buffers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import numpy as np

from . import host_blocks, unified
from .mlxbits import joined, mx_bits_lazy, split_joined

DEVICE_BATCH_BYTES = host_blocks.BLOCK_BYTES  # KV copied on an accelerator before one wait: bounds the extra memory


def read_device(flat: Any) -> np.ndarray:
    """An evaluated MLX array's bytes, as a numpy array of the host's own. On a GPU,
    MLX moves the array to managed memory for the CPU to read; its pages are then
    brought over in one DMA instead of a fault at a time, and sent back once copied, so
    that the buffer MLX reuses for a later step's output is on the device again."""
    view = np.array(flat, copy=False)
    moved = unified.to_host(view)
    data = view.copy()
    if moved:
        unified.to_device(view)
    return data


class DeviceExtract:
    """Reads the Snapshotter's ``caches``, ``kind`` and ``_layer``; adds to its ``busy``."""

    def _extract_device(self, pieces: list[tuple[int, int, int]], n: int, lock,
                        per_hold: int | None = None, extra: list | None = None) -> Iterator[tuple]:
        """:meth:`extract` on an accelerator: held still, by the copy engine where it is
        reached (:meth:`_extract_dma`), else by MLX copies (:meth:`_extract_mlx`)."""
        if lock is None and not extra and self.kind == "KVCache" and unified.available():
            return self._extract_dma(pieces, n)
        return self._extract_mlx(pieces, n, lock, per_hold, extra)

    def _extract_mlx(self, pieces: list[tuple[int, int, int]], n: int, lock,
                     per_hold: int | None = None, extra: list | None = None) -> Iterator[tuple]:
        """:meth:`_extract_device` by MLX: a hold only queues device copies of a
        few pieces (microseconds); they are waited for once, after it, and read on
        the host. Waiting inside
        the hold, as the CPU does, waited for the step in
        flight (a speculated one, say) and then read unified memory while the
        session's next step could not start: on the H200, 1B shape, holds of 4-7 ms
        beside 3.5 ms steps, and pre-copy's worst step 2-3.6x a normal one. Without
        a lock (a paused session's last delta, a stop-and-copy) up to
        DEVICE_BATCH_BYTES of pieces are queued at once: one wait per batch, not one
        per piece (a stop-and-copy's raw transfer on the H200 went from 194 to 430
        MB/s, 1B shape at 2k tokens). The copies keep the cache's buffer
        referenced until they run, so a step meanwhile writes a copy of it: bytes
        the device moves in microseconds. ``extra``: a list of (bits, name) MLX arrays read
        with the first batch; their host copies replace them in it."""
        import mlx.core as mx

        per_hold = per_hold or (8 if lock is not None else len(pieces))
        j = 0
        while j < len(pieces):
            queued, size = [], 0
            with lock if lock is not None else contextlib.nullcontext():
                start = time.perf_counter()
                while j + len(queued) < len(pieces) and len(queued) < per_hold and size < DEVICE_BATCH_BYTES:
                    i, a, b = pieces[j + len(queued)]
                    keys, values, _, *meta = self._layer(i, n)
                    sides = [[mx_bits_lazy(x[..., a:b, :]) for x in side]
                             for side in (([keys], [values]) if self.kind == "KVCache" else (keys, values))]
                    size += sum(u.nbytes for side in sides for u, _ in side)
                    queued.append((i, a, b, sides, None if self.kind == "KVCache"
                                   else {"group_size": meta[0], "bits": meta[1]}))
                    del keys, values, sides
                parts = [u for q in queued for side in q[3] for u, _ in side]
                ride, more, extra = [u for u, _ in extra or []], extra, None
                # one buffer for the batch, read on the host once: a delta of 30 layers
                # made 60 reads beside the steps
                flat = joined(parts + ride)
                mx.async_eval(flat)
                j += len(queued)
                self.busy["extract"] += time.perf_counter() - start
            began = time.perf_counter()
            data = read_device(flat)  # the copy is this thread's: waited for without the lock
            del flat
            self.busy["extract"] += time.perf_counter() - began
            copies = split_joined(data, parts + ride)  # in the order of parts
            if ride:
                more[:] = [(u, name) for u, (_, name) in zip(copies[len(parts):], more)]
            views = iter(copies[:len(parts)])
            # the host's pieces, and no MLX array left: a lazy slice kept while the consumer
            # sends would pin the cache's buffer, and the session's steps would copy it whole
            read = [(i, a, b, [[(next(views), name) for _, name in side] for side in sides], meta)
                    for i, a, b, sides, meta in queued]
            del parts, queued, ride, more
            for i, a, b, (k, v), meta in read:
                yield (i, a, b, k[0], v[0], None) if meta is None else (i, a, b, k, v, meta)

    def _extract_dma(self, pieces: list[tuple[int, int, int]], n: int) -> Iterator[tuple]:
        """:meth:`_extract_device` of a session held still: each range read by the copy
        engine straight out of its cache's buffer into a kept host block
        (:func:`unified.read`, :mod:`host_blocks`), up to DEVICE_BATCH_BYTES a batch. No MLX op gathers the
        ranges, and their pages never leave the device (a stop-and-copy's extraction
        took 61-71 ms for 178 MB on an H100 the other way). The caches' host views
        are dropped before the batch is yielded, so none pins a buffer the session's
        next step would then copy whole. A failed copy hands the rest to MLX."""
        from mlx_lm.models.cache import KVCache

        j = 0
        while j < len(pieces):
            start = time.perf_counter()
            rooms = {}  # layer -> its keys' and values' buffers as host views (unified memory)
            batch, size = [], 0
            while j + len(batch) < len(pieces):
                i, a, b = pieces[j + len(batch)]
                if i not in rooms:
                    c = self.caches[i]
                    if type(c) is not KVCache or c.keys is None or c.offset < n:
                        break  # not a plain cache's own buffer (a resident row's, say)
                    rooms[i] = [(np.array(u, copy=False), name) for u, name in (mx_bits_lazy(c.keys),
                                                                               mx_bits_lazy(c.values))]
                sizes = [v.nbytes // v.shape[2] * (b - a) for v, _ in rooms[i]]
                if batch and size + sum(sizes) > DEVICE_BATCH_BYTES:
                    break
                size += sum(sizes)
                batch.append((i, a, b, sizes))
            if not batch:  # through MLX from here on
                yield from self._extract_mlx(pieces[j:], n, None)
                return
            host = host_blocks.take(size)  # pages touched already: fresh ones cost a fault each
            out, at = [], 0
            for i, a, b, sizes in batch:
                sides = []
                for (v, name), nbytes in zip(rooms[i], sizes):
                    part = host[at:at + nbytes].view(v.dtype).reshape(1, v.shape[1], b - a, v.shape[3])
                    at += nbytes
                    if not unified.read(v, a, part):
                        break
                    sides.append((part, name))
                if len(sides) < 2:
                    break
                out.append((i, a, b, sides[0], sides[1], None))
            del rooms
            self.busy["extract"] += time.perf_counter() - start
            j += len(out)
            if len(out) < len(batch):  # a copy failed: through MLX from here on
                yield from out
                yield from self._extract_mlx(pieces[j:], n, None)
                return
            yield from out
