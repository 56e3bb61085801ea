"""Burst prefill: a step's short prompt chunks as one batch over the shared resident rows.

When many sessions start at once (64 chat clients sending their first turn), a step
takes dozens of short prompts. Packed side by side (:class:`kvferry.batch_attention.PackedCaches`)
each chunk still runs its own RoPE, cache write and attention in every layer, then
joins the shared rows (:mod:`kvferry.resident`) at its first decode with a copy per
layer: ~450 MLX operations a newcomer, at ~30 us each on a GPU. On an H100 steps that
took 20 and 43 newcomers ran 278 and 722 ms, against ~25 ms for a decode step of 64 rows,
and the first token of such a burst was ~40 % of a 64-session bench's wall.

Here the chunks go straight into their sessions' rows, right-padded to the longest:
every layer runs one RoPE, one scatter of K/V and one masked attention for all of
them, as mlx-lm's ``BatchGenerator`` prefills a batch (it pads on the left). A padded
position's K/V land past its row's length, where every mask hides them and the row's
next token overwrites them. A new session's cached prompt prefix (:mod:`kvferry.prefix_cache`)
is written into its row the same way, one write per layer for every session that
shares it, and the prompts a burst leaves for others are copied out in one gather per layer.
On the H100, 52 newcomers then took one step of 112 ms, and the first token at 64
sessions came 2.7x sooner (docs/performance-log.md, "Bursts of newcomers").

On where a step's prompts run apart from its decode rows (split prefill: the GPU
default). ``KVFERRY_BURST=1`` turns it on elsewhere (the CPU tests, whose host then
splits too), ``0`` off.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from .prefix_cache import Stacked
from .resident import StepLayer

SHORT = 64  # prompt tokens a chunk has at most to go in a burst (padding grows with the longest)


def enabled(default: bool) -> bool:
    """Whether a host bursts: ``default`` unless KVFERRY_BURST says otherwise."""
    flag = os.environ.get("KVFERRY_BURST", "")
    return default if flag not in ("0", "1") else flag == "1"


def fits(rows: Any, session: Any, dtype: str) -> bool:
    """Whether ``session`` can go in a burst: its caches join the rows, and an empty
    one's KV (``dtype``, the host's) is the buffers' dtype."""
    if not rows.can_join(session):
        return False
    return session.cache[0].keys is not None or not rows.k or rows.k[0].dtype == getattr(mx, dtype)


def admit(rows: Any, model: Any, dtype: str, sessions: list, stats: dict) -> list:
    """Make those of ``sessions`` resident that can be (rows for the new ones, counted in
    ``stats``' resident_joins); return them. Empty buffers get the model's shapes (a
    burst on an idle host has no session's KV to take them from), in the dtype of the
    first session's KV, else ``dtype``, the host's."""
    if not rows.k:
        attn = model.layers[0].self_attn
        held = next((c.keys.dtype for s in sessions for c in s.cache[:1] if c.keys is not None), None)
        shape = (attn.n_kv_heads, attn.head_dim)
        rows.open(len(model.layers), shape, shape, held if held is not None else getattr(mx, dtype))
    for s in sessions:
        if rows.can_join(s) and not rows.resident(s):
            rows.join(s)
            stats["resident_joins"] += rows.resident(s)
    return [s for s in sessions if rows.resident(s)]


def write_prefix(rows: Any, sessions: list, layers: list, n: int) -> None:
    """A cached prefix's first ``n`` tokens (``layers``: per layer (keys, values), from
    :meth:`kvferry.prefix_cache.PrefixCache.match`) into the rows of resident
    ``sessions`` whose caches are empty: one write per layer for all of them."""
    at = [s.cache[0]._row for s in sessions]
    rows.fit(n + 1)
    idx = _rows_index(at)
    for j, (k, v) in enumerate(layers):
        rows.k[j][idx, :, :n, :] = k[..., :n, :]
        rows.v[j][idx, :, :n, :] = v[..., :n, :]
    for s in sessions:
        for c in s.cache:
            c.offset = n


def prefill(rows: Any, model: Any, chunks: list[tuple[Any, list[int]]]) -> list:
    """Run ``chunks`` ((resident session, tokens)) through the model as one batch,
    their K/V into the sessions' rows and their offsets moved on; return the
    arrays to evaluate (the buffers). No logits: a prompt's last token is decoded in a batch."""
    at = [s.cache[0]._row for s, _ in chunks]
    offsets = [s.cache[0].offset for s, _ in chunks]
    sizes = [len(c) for _, c in chunks]
    width = max(sizes)
    rows.fit(max(o + width for o in offsets))
    tokens = mx.array([c + [0] * (width - len(c)) for _, c in chunks], dtype=mx.int32)
    shared = _Burst(at, offsets, sizes, rows.k[0].shape[1])
    model.model(tokens, cache=[BurstLayer(rows, j, shared) for j in range(len(rows.k))])
    for (s, _), n in zip(chunks, sizes):
        for c in s.cache:
            c.offset += n
    return list(rows.k + rows.v)


def copies(rows: Any, sessions: list) -> dict:
    """Per session, its row's KV up to its offset, copied out of the buffers as a
    :class:`kvferry.prefix_cache.Stacked` of its own (what the prefix cache keeps):
    a gather a layer for all of them, then two takes each, not a copy a layer each."""
    idx = mx.array([s.cache[0]._row for s in sessions], dtype=mx.int32)
    longest = max(s.cache[0].offset for s in sessions)
    # [layers, sessions, heads, longest, dim]: gathers, so nothing here is a view of the rows
    k = mx.stack([b[:, :, :longest][idx] for b in rows.k])
    v = mx.stack([b[:, :, :longest][idx] for b in rows.v])
    out = {}
    for i, s in enumerate(sessions):
        n = s.cache[0].offset
        at = mx.array([i], dtype=mx.int32)
        # a take is a copy: each entry holds a buffer of its own, freed when it goes
        out[s] = Stacked(mx.take(k, at, axis=1), mx.take(v, at, axis=1), n)
    return out


def _rows_index(at: list[int]) -> Any:
    """Rows to index the buffers' first axis with: a slice where they run in order (no gather)."""
    if at == list(range(at[0], at[0] + len(at))):
        return slice(at[0], at[0] + len(at))
    return mx.array(at, dtype=mx.int32)


class _Burst:
    """What every layer of one burst shares (index arrays, the mask; ``offset`` for RoPE)."""

    def __init__(self, at: list[int], offsets: list[int], sizes: list[int], heads: int) -> None:
        width = max(sizes)
        self.rows = _rows_index(at)
        self.offset = mx.array(offsets, dtype=mx.int32)  # RoPE: each row's own positions
        pos = self.offset[:, None] + mx.arange(width, dtype=mx.int32)[None, :]  # (rows, width)
        self.r_idx = mx.array(at, dtype=mx.int32)[:, None, None]
        self.h_idx = mx.arange(heads, dtype=mx.int32)[None, :, None]
        self.t_idx = pos[:, None, :]
        # keys up to the longest real end; a padded query sees up to its own position, never nothing
        self.length = max(o + n for o, n in zip(offsets, sizes))
        self.mask = (mx.arange(self.length, dtype=mx.int32)[None, None, :] <= pos[:, :, None])[:, None]


class BurstLayer(StepLayer):
    """One layer of a burst, as the model sees its cache: a resident decode step's
    layer (kvferry.resident.StepLayer) whose rows take several tokens each."""

    def update_and_fetch(self, keys, values):
        b, j = self.s, self.layer
        self.rows.k[j][b.r_idx, b.h_idx, b.t_idx] = keys
        self.rows.v[j][b.r_idx, b.h_idx, b.t_idx] = values
        return keys, values  # placeholders: attention() reads the buffers

    def attention(self, queries, scale: float, sinks=None):
        b, j = self.s, self.layer
        n = b.length
        k, v = self.rows.k[j][b.rows, :, :n], self.rows.v[j][b.rows, :, :n]
        kw = {"sinks": sinks} if sinks is not None else {}
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=b.mask, **kw)
