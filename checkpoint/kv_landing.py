"""A restore's KV frames, landed in the session's layer caches as they arrive (a
mixin of :class:`kvferry.checkpoint.restore.Restorer`).

Every size a frame declares is checked against the model, and charged to the
host's KV budget (``serve --max-kv-mb``), before anything is decoded or
allocated. A layer's cache is reserved once, at the token count the header
announces, so a chunked stream appends in place; on a CPU its first room is
written before the compute lock, on a GPU its bits go up before it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from . import codecs, unified
from .errors import CheckpointError, OutOfMemoryError
from .mlxbits import cast_bits, host_memory, mx_bits_lazy, mx_from_bits, np_kind, oom

MAX_TOKENS = 1 << 22


def _mx_sides(k: np.ndarray, kd: str, v: np.ndarray, vd: str) -> tuple:
    """A range's keys and values as MLX arrays, through MLX's own copy."""
    return mx_from_bits(k, kd, True), mx_from_bits(v, vd, True)


class KVLanding:
    """Reads the Restorer's ``host``, ``header``, ``chunks``, ``caches``, ``lock``,
    ``borrowed``, ``kv_heads``, ``head_dim``, ``kv_dtype``, ``context``, and keeps
    its ``kv_bytes``, ``reserved``, ``_charged`` and ``_views`` (on a GPU, each
    layer's room as the copy engine writes it)."""

    def _admit(self, nbytes: int, where: str, reserve: int = 0) -> None:
        """Refuse KV beyond the host's budget (``serve --max-kv-mb``) before allocating
        it: ``nbytes`` received, ``reserve`` cache room (received or to come)."""
        self.kv_bytes += nbytes
        self.reserved += reserve
        limit = getattr(self.host, "max_kv_bytes", None)
        if not limit:
            return
        need = max(self.kv_bytes, self.reserved)
        with self.host.lock:  # one host-wide count: restores in flight reserve what they will hold
            used = self.host.kv_bytes() + self.host.kv_reserved - self._charged[0]
            if used + need > limit:
                raise OutOfMemoryError(
                    f"{where}: out of memory on this host: the session's KV needs more than the "
                    f"{limit / 1e6:.0f} MB it may use ({used / 1e6:.1f} MB already in use or reserved)")
            self.host.kv_reserved += need - self._charged[0]
            self._charged[0] = need

    def _kv(self, b: dict, where: str, pending: list | None = None) -> None:
        """Apply one KV body. ``pending``: the caller holds the lock; the updated
        arrays are added to it for one evaluation of a whole batch."""
        i, t0, t1 = b.get("layer"), b.get("start"), b.get("end")
        n = len(self.chunks)
        if not (isinstance(i, int) and 0 <= i < n and isinstance(t0, int) and isinstance(t1, int)
                and 0 <= t0 <= t1 <= (MAX_TOKENS if b.get("whole") or self.header["cache"]["class"]
                                      == "RotatingKVCache" else self.context)):
            raise CheckpointError(f"{where}: bad layer or token range ({i}, {t0}..{t1})")
        cache = self.header["cache"]
        heads, hd = self.kv_heads, self.head_dim
        if b.get("whole"):
            if b.get("keys") is not None:
                n = sum(self._declared(b.get(side), f"{where} {side}", None) for side in ("keys", "values"))
                self._admit(n, where)  # before anything is decompressed
                k, v = self._side(b, "keys", where), self._side(b, "values", where)
                meta = b.get("meta")
                if not (isinstance(meta, list) and len(meta) == 4 and all(isinstance(x, int) for x in meta)):
                    raise CheckpointError(f"{where}: malformed rotating-cache meta state")
                b = {**b, "_k": (self._kept(k[0]), k[1]), "_v": (self._kept(v[0]), v[1])}
            self.whole[i] = b
            return
        if cache["class"] == "QuantizedKVCache":
            sides = []
            for side in ("keys", "values"):
                blobs = b.get(side)
                if not isinstance(blobs, list) or len(blobs) != 3:
                    raise CheckpointError(f"{where}: quantized {side} must be 3 tensors")
                self._admit(sum(self._declared(x, f"{where} {side}[{j}]", t1 - t0, packed=True)
                                for j, x in enumerate(blobs)), where)
                arrs = [(self._kept(codecs.decode(x, f"{where} {side}[{j}]")), x["dtype"]) for j, x in enumerate(blobs)]
                for a, _ in arrs:
                    if a.ndim != 4 or a.shape[1] != heads or a.shape[2] != t1 - t0:
                        raise CheckpointError(f"{where}: {side} shape {list(a.shape)} does not fit "
                                              f"{heads} heads x {t1 - t0} tokens")
                sides.append(arrs)
            meta = b.get("meta") or {}
            self.chunks[i].append((t0, t1, ("q", sides, meta)))
            return
        nbytes = sum(self._declared(b.get(side), f"{where} {side}", t1 - t0) for side in ("keys", "values"))
        c = self.caches[i]
        if t0 != c.offset:
            raise CheckpointError(f"{where}: token range {t0}..{t1} does not continue layer {i} "
                                  f"(it holds {c.offset} tokens)")
        self._admit(nbytes, where)  # before anything is decompressed
        (k, kd), (v, vd) = self._side(b, "keys", where), self._side(b, "values", where)
        for name, a in (("keys", k), ("values", v)):
            if a.ndim != 4 or a.shape[1] != heads or a.shape[2] != t1 - t0 or a.shape[3] != hd:
                raise CheckpointError(f"{where}: {name} shape {list(a.shape)} does not fit "
                                      f"[1, {heads}, {t1 - t0}, {hd}]")
        # Append straight into the layer's cache as frames arrive, so a streamed
        # (live) restore has nothing left to assemble at commit time.
        import mlx.core as mx

        direct = host_memory() and np_kind(getattr(mx, kd)) is not None  # a final batch too
        # on a GPU, by the copy engine straight into the room (unified.land); a final batch,
        # a few tokens a layer under the lock, goes with the step's one evaluation
        dma = not host_memory() and pending is None and unified.available()
        if not dma:
            # a room's host view keeps its buffer referenced, and MLX writes a referenced buffer by
            # copying it whole: a live pause's last delta would copy every layer under the lock
            self._views.pop(i, None)
        with oom(where):
            # else on a GPU, the bits go up before the lock: their pages reach the device in one DMA
            sides = None if direct or dma else _mx_sides(k, kd, v, vd)
            # on a CPU, a layer's first room is written before the lock: its pages are new to
            # the process, and a VM charges each one's first write (up to ~2.5 ms a MB on
            # this project's machines), which under the lock would stall the host's other sessions
            room = self._room(c, t1, k.shape, kd, v.shape, vd, where) if direct and pending is None else None
        with oom(where), self.lock if pending is None else contextlib.nullcontext():
            if room is not None:  # (only this restorer writes this layer's cache)
                c.state = (*room, c.offset)
            self._reserve(c, t1, k.shape, kd, v.shape, vd, where)
            if direct or dma:
                mx.eval(c.keys, c.values)  # the room, allocated: written below without the lock
            else:
                c.update_and_fetch(*sides)
                if pending is None:
                    mx.eval(c.keys, c.values)
                else:
                    pending += [c.keys, c.values]
        if dma and not self._dma(i, c, k, v, t0):  # the runtime failed: through MLX after all
            self._views.pop(i, None)
            with oom(where), self.lock:
                c.update_and_fetch(*_mx_sides(k, kd, v, vd))
                mx.eval(c.keys, c.values)
        elif dma:
            c.offset = t1
        if direct:
            # numpy copies the range straight into the cache's buffer: one copy, no MLX
            # op, and no hold of the compute lock (this session is not running yet)
            for dst, src in ((c.keys, k), (c.values, v)):
                view = np.array(dst, copy=False)
                view.view(src.dtype)[..., t0:t1, :] = src
                del view
            c.offset = t1
        self.chunks[i].append((t0, t1, None))

    def _dma(self, i: int, c, k: np.ndarray, v: np.ndarray, t0: int) -> bool:
        """Layer ``i``'s keys and values at token ``t0`` by the copy engine (False: not made).
        Each room's view is made once (MLX moves the room into unified memory then, a copy
        on the device) and kept while the room is the cache's."""
        views = self._views.get(i)
        if views is None or views[0] is not c.keys or views[1] is not c.values:
            bits = [np.array(mx_bits_lazy(a)[0], copy=False) for a in (c.keys, c.values)]
            self._views[i] = views = (c.keys, c.values, *bits)
        return unified.land(views[2], k, t0) and unified.land(views[3], v, t0)

    def _kept(self, a: np.ndarray) -> np.ndarray:
        """A decoded blob that outlives its frame: its own copy if the frame's payloads
        were borrowed (a lane's buffer is reused once the frame has landed)."""
        return a.copy() if self.borrowed and not a.flags.owndata else a

    def _side(self, b: dict, side: str, where: str) -> tuple[np.ndarray, str]:
        """A float KV blob's bits (keys or values), in the dtype this host computes in."""
        return cast_bits(codecs.decode(b.get(side), f"{where} {side}"), b[side]["dtype"], self.kv_dtype,
                         f"{where} {side}")

    def _declared(self, blob: Any, where: str, tokens: int | None, packed: bool = False) -> int:
        """The bytes a KV blob declares, once its shape and dtype are checked against
        this model's KV, ``[1, kv_heads, tokens, head_dim]`` (``tokens`` None: at most
        the context; ``packed``: a quantized part, at most head_dim wide)."""
        shape = blob.get("shape") if isinstance(blob, dict) else None
        dtype = blob.get("dtype") if isinstance(blob, dict) else None
        hd = self.head_dim
        if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(d, int) for d in shape)
                and shape[0] == 1 and shape[1] == self.kv_heads
                and (shape[2] == tokens if tokens is not None else 0 < shape[2] <= self.context)
                and (0 < shape[3] <= hd if packed else shape[3] == hd)
                and dtype in (codecs.DTYPES if packed else codecs.FLOATS)):
            want = f"[1, {self.kv_heads}, {tokens if tokens is not None else '<=' + str(self.context)}, {hd}]"
            raise CheckpointError(f"{where}: declares {dtype}{shape}, this model's KV is {want}")
        return shape[1] * shape[2] * shape[3] * codecs.DTYPES[dtype][1]

    def _capacity(self, c, t1: int, kshape, kdtype: str, vshape, vdtype: str, where: str) -> int:
        """The tokens :meth:`_reserve` grows a layer to for token ``t1`` (0: it has room),
        charged to the KV budget."""
        cap = 0 if c.keys is None else c.keys.shape[2]
        if t1 <= cap:
            return 0
        hint = self.header["cache"].get("tokens")
        hint = hint if isinstance(hint, int) and 0 <= hint <= self.context else 0  # the model's, not the file's
        new = max(t1, hint + c.step if cap == 0 else 2 * cap)
        new = -(-new // c.step) * c.step
        per_token = kshape[1] * kshape[3] * codecs.DTYPES[kdtype][1] + vshape[1] * vshape[3] * codecs.DTYPES[vdtype][1]
        self._admit(0, where, reserve=(new - cap) * per_token)
        return new

    def _room(self, c, t1: int, kshape, kdtype: str, vshape, vdtype: str, where: str) -> tuple | None:
        """A layer's first room, as :meth:`_reserve` makes it, made without an MLX op:
        numpy's zeros copied into new MLX arrays (None: the layer has a room already)."""
        if c.keys is not None:
            return None
        new = self._capacity(c, t1, kshape, kdtype, vshape, vdtype, where)
        return tuple(mx_from_bits(np.zeros((shape[0], shape[1], new, shape[3]), codecs.DTYPES[dt][0]), dt)
                     for shape, dt in ((kshape, kdtype), (vshape, vdtype)))

    def _reserve(self, c, t1: int, kshape, kdtype: str, vshape, vdtype: str, where: str) -> None:
        """Grow a layer's cache ahead of token ``t1``, once, to the token count the
        header announces (never past the session's context; charged to the KV
        budget), so a chunked stream appends in place instead of re-copying the
        layer every 256 tokens as ``KVCache`` would; past it, by doubling."""
        import mlx.core as mx

        new = self._capacity(c, t1, kshape, kdtype, vshape, vdtype, where)
        if not new:
            return
        grown = []
        for old, shape, dt in ((c.keys, kshape, kdtype), (c.values, vshape, vdtype)):
            dt = getattr(mx, dt)
            if old is None:
                grown.append(mx.zeros((shape[0], shape[1], new, shape[3]), dt))
            else:
                grown.append(mx.concatenate(
                    [old[..., :c.offset, :], mx.zeros((shape[0], shape[1], new - c.offset, shape[3]), dt)], axis=2))
        c.state = (*grown, c.offset)
