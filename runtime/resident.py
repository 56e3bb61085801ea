"""Resident rows: the KV of the sessions in a decode batch, in one buffer per layer.

Per-session caches (:class:`kvferry.batch_attention.RowCaches`) give every row of a decode
step its own cache update and attention: about a dozen small ops per row and layer,
23,000 kernel launches a step at 64 rows on a GPU, where the forward pass was 94 %
of the step. Here a session that decodes beside others *joins* its host's
buffers, ``[rows, kv_heads, tokens, head_dim]`` per layer (its KV copied in once),
and a decode step writes every row's new K/V with one scatter and attends over all
rows with one masked attention per layer, as mlx-lm's ``BatchKVCache`` does.

The session keeps its cache objects. While it is resident they are
:class:`ResidentKV`, whose ``keys``/``values`` are views of its row and whose
``update_and_fetch`` writes into it, so checkpoints, live pre-copy, trims and
prompt chunks read and write the row as they would a cache of its own. When its
turn ends or it closes it leaves: its KV is copied back into a ``KVCache`` of its
own and the row is free for the next. The buffers are padded to the longest
resident session (grown ``GROW`` tokens at a time, so that they seldom grow); a
step's attention reads them only up to its longest row, and masks each row at
its own length.

On by default on every device (``serve --batch-kv``). A row's attention runs over the
step's longest row, masked, so its floats may round differently from its solo
attention's (docs/sessions.md measures by how much).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

GROW = 256  # tokens the buffers grow by (every row: they share the length)


class ResidentKV(KVCache):
    """A session's cache of one layer while its KV lives in a row of the host's
    buffers (the class of its ``KVCache`` objects from join to leave)."""

    checkpoint_kind = "KVCache"  # what a checkpoint records, and what it lands as
    _rows: "ResidentRows"
    _layer: int
    _row: int

    @property
    def keys(self):
        return self._rows.k[self._layer][self._row:self._row + 1]

    @property
    def values(self):
        return self._rows.v[self._layer][self._row:self._row + 1]

    # sizes answer without the buffers: other threads ask at any moment (a metrics scrape,
    # admission's KV budget), while the step thread may be replacing or giving them back
    token_bytes: int  # one token's K and V in this layer

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.token_bytes * self._rows.tokens  # the row, as its views would count it

    def update_and_fetch(self, keys, values):
        prev, n = self.offset, keys.shape[2]
        self._rows.fit(prev + n)
        r, j = self._row, self._layer
        self._rows.k[j][r:r + 1, :, prev:prev + n, :] = keys
        self._rows.v[j][r:r + 1, :, prev:prev + n, :] = values
        self.offset += n
        return self._rows.k[j][r:r + 1, :, :self.offset, :], self._rows.v[j][r:r + 1, :, :self.offset, :]


class Bare:
    """What the rows need of a session, for measuring them without one: its caches."""

    def __init__(self, cache: list) -> None:
        self.cache, self.closed = cache, False


class ResidentRows:
    """One host's resident buffers. Used on the step thread, under the compute lock."""

    def __init__(self) -> None:
        self.k: list = []  # per layer [rows, kv_heads, tokens, head_dim]
        self.v: list = []
        self.owner: list = []  # the session in each row, or None
        self.tokens = 0  # the buffers' length
        self.join_s = 0.0  # time spent joining sessions (the step trace's join_ms)

    def resident(self, session: Any) -> bool:
        caches = session.cache
        return bool(caches) and type(caches[0]) is ResidentKV and caches[0]._rows is self

    def owns(self, session: Any) -> bool:
        return any(o is session for o in self.owner)

    def take(self, sessions: list, stats: dict | None = None) -> bool:
        """Make every one of ``sessions`` resident (joining those that are not);
        False, and nobody joins, when one cannot (its rows then run per session)."""
        if not all(self.can_join(s) for s in sessions):
            return False
        for s in sessions:
            if not self.resident(s):
                self.join(s)
                if stats is not None and self.resident(s):
                    stats["resident_joins"] += 1
        return all(self.resident(s) for s in sessions)

    def can_join(self, session: Any) -> bool:
        """A plain float KV cache on every layer, of this buffer's dtype."""
        caches = session.cache
        if caches and type(caches[0]) is ResidentKV:  # (every layer joined with the first: no need to look)
            return caches[0]._rows is self
        if not caches or not all(type(c) in (KVCache, ResidentKV) for c in caches):
            return False
        keys = caches[0].keys
        return keys is None or not self.k or keys.dtype == self.k[0].dtype

    def fit(self, tokens: int) -> None:
        """Grow every row to hold ``tokens`` tokens."""
        if tokens <= self.tokens:
            return
        new = -(-tokens // GROW) * GROW
        for bufs in (self.k, self.v):
            for j, b in enumerate(bufs):
                r, h, t, d = b.shape
                bufs[j] = mx.concatenate([b, mx.zeros((r, h, new - t, d), b.dtype)], axis=2)
        self.tokens = new

    def open(self, layers: int, keys: tuple, values: tuple, dtype: Any) -> None:
        """Empty buffers of ``layers`` layers whose rows hold keys and values of
        ``(kv_heads, head_dim)`` each, in ``dtype``."""
        self.k = [mx.zeros((0, keys[0], 0, keys[1]), dtype) for _ in range(layers)]
        self.v = [mx.zeros((0, values[0], 0, values[1]), dtype) for _ in range(layers)]
        self.owner, self.tokens = [], 0

    def _free_row(self) -> int:
        if None in self.owner:
            return self.owner.index(None)
        n = len(self.owner)
        grow = max(4, n)
        for bufs in (self.k, self.v):
            for j, b in enumerate(bufs):
                _, h, t, d = b.shape
                bufs[j] = mx.concatenate([b, mx.zeros((grow, h, t, d), b.dtype)], axis=0)
        self.owner += [None] * grow
        return n

    def join(self, session: Any) -> None:
        """Copy ``session``'s KV into a free row; its caches become views of it."""
        t0 = time.perf_counter()
        try:
            self._join(session)
        finally:
            self.join_s += time.perf_counter() - t0

    def _join(self, session: Any) -> None:
        caches = session.cache
        if not self.k:
            ref = next((c for c in caches if c.keys is not None), None)
            if ref is None:
                return  # nothing to take the shapes from yet: it joins after its first token
            self.open(len(caches), ref.keys.shape[1::2], ref.values.shape[1::2], ref.keys.dtype)
        for i, o in enumerate(self.owner):
            if o is session:  # a row its earlier caches held (they were reset since)
                self.owner[i] = None
        self.fit(max(c.offset for c in caches) + 1)
        row = self._free_row()
        for j, c in enumerate(caches):
            if c.offset:
                self.k[j][row:row + 1, :, :c.offset, :] = c.keys[..., :c.offset, :]
                self.v[j][row:row + 1, :, :c.offset, :] = c.values[..., :c.offset, :]
        # not evaluated here: the step that takes the session evaluates the buffers with
        # its own work, so a join never waits for the step before it to finish
        # in this order, because other threads read these caches at any moment (a metrics
        # scrape, a checkpoint): the row's place is set before the class whose properties read
        # it, and the session's own buffers are dropped only once the properties shadow them
        for j, c in enumerate(caches):
            k, v = self.k[j], self.v[j]
            c.token_bytes = (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.dtype.size
            c._rows, c._layer, c._row = self, j, row
            c.__class__ = ResidentKV  # the properties answer from the row from here on
            c.__dict__.pop("keys", None)
            c.__dict__.pop("values", None)
        self.owner[row] = session

    def leave(self, session: Any, caches: list) -> None:
        """Copy a resident session's KV back into caches of its own and free its row
        (``caches``: its cache objects; a closed session's are dropped, not copied)."""
        rows = [i for i, o in enumerate(self.owner) if o is session]  # (a reset cache left its old row)
        mine = bool(caches) and type(caches[0]) is ResidentKV and caches[0]._rows is self
        if mine and not session.closed:
            row = caches[0]._row
            own = []
            for c in caches:
                cap = -(-(c.offset + 1) // c.step) * c.step  # a buffer of its own, with room to grow
                sides = []
                for buf in (self.k[c._layer], self.v[c._layer]):
                    _, h, _, d = buf.shape
                    own_side = mx.zeros((1, h, cap, d), buf.dtype)
                    own_side[..., :c.offset, :] = buf[row:row + 1, :, :c.offset, :]
                    sides.append(own_side)
                own.append(sides)
            mx.eval(own)
            for c, (k, v) in zip(caches, own):
                c.__dict__["keys"], c.__dict__["values"] = k, v  # shadowed until the class changes
                c.__class__ = KVCache
        for row in rows:
            self.owner[row] = None
        if all(o is None for o in self.owner):  # nobody resident: give the memory back
            self.k, self.v, self.owner, self.tokens = [], [], [], 0

    def step(self, sessions: list) -> list["StepLayer"]:
        """The model's caches for one decode step of resident ``sessions`` (one token
        each); call :meth:`advance` once the forward pass is built."""
        rows = [s.cache[0]._row for s in sessions]
        offsets = [s.cache[0].offset for s in sessions]
        self.fit(max(offsets) + 1)
        used = max(i for i, o in enumerate(self.owner) if o is not None) + 1
        lengths = [1] * used  # a row not stepping attends to one token: its output is dropped
        for r, o in zip(rows, offsets):
            lengths[r] = o + 1
        shared = _Step(rows, offsets, lengths, used, self.k[0].shape[1])
        return [StepLayer(self, j, shared) for j in range(len(self.k))]

    @staticmethod
    def advance(sessions: list) -> None:
        for s in sessions:
            for c in s.cache:
                c.offset += 1


class _Step:
    """What every layer of one resident decode step shares (index arrays, the mask)."""

    def __init__(self, rows: list[int], offsets: list[int], lengths: list[int], used: int, heads: int) -> None:
        self.used = used
        self.count = len(rows)  # the rows stepping
        # attention reads the rows up to the longest, not the buffers' whole padded length (up
        # to GROW - 1 tokens more): on a CPU at 64 tokens that padding cost ~10 % of a step
        self.length = max(lengths)
        self.gather = rows != list(range(used))  # rows not in order, or rows not stepping
        self.rows = mx.array(rows, dtype=mx.int32)
        self.offset = mx.array(offsets, dtype=mx.int32)  # RoPE: each row's own position
        self.r_idx = self.rows[:, None]
        self.h_idx = mx.arange(heads, dtype=mx.int32)[None, :]
        self.t_idx = self.offset[:, None]
        self.mask = (mx.arange(self.length, dtype=mx.int32)[None, :]
                     < mx.array(lengths, dtype=mx.int32)[:, None])[:, None, None, :]


class StepLayer:
    """One layer of a resident decode step, as the model sees its cache."""

    def __init__(self, rows: ResidentRows, layer: int, step: _Step) -> None:
        self.rows, self.layer, self.s = rows, layer, step

    @property
    def offset(self):
        return self.s.offset

    @property
    def count(self) -> int:
        """The rows stepping (each one token)."""
        return self.s.count

    def update_and_fetch(self, keys, values):
        s, j = self.s, self.layer
        self.rows.k[j][s.r_idx, s.h_idx, s.t_idx] = keys[:, :, 0, :]
        self.rows.v[j][s.r_idx, s.h_idx, s.t_idx] = values[:, :, 0, :]
        return keys, values  # placeholders: attention() reads the buffers

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        return None  # attention() masks each row at its own length

    def attention(self, queries, scale: float, sinks=None):
        s, j = self.s, self.layer
        q = queries
        if s.gather:  # each query in its row; the other rows' outputs are dropped
            q = mx.zeros((s.used, *queries.shape[1:]), queries.dtype)
            q[s.rows] = queries
        kw = {"sinks": sinks} if sinks is not None else {}
        n = s.length
        out = mx.fast.scaled_dot_product_attention(q, self.rows.k[j][:s.used, :, :n], self.rows.v[j][:s.used, :, :n],
                                                   scale=scale, mask=s.mask, **kw)
        return out[s.rows] if s.gather else out
