"""How a model sees a batch: its attention hooked so one forward pass can carry
many sessions' tokens (mlx-lm's models, unchanged, with these caches).

- :class:`RowCaches`: a decode batch of one token per session, each row's K/V in
  its own session's cache and its attention run against it (``--batch-kv
  per-session``); a layer of shared resident rows (:mod:`kvferry.resident`) is
  recognised by its ``attention`` method.
- :class:`PackedCaches`: several sessions' tokens side by side in one sequence
  (decode rows of one token and prompt chunks of several), each segment attending
  through its own cache: one read of the weights for all of them. Llama-shaped
  attention only (:data:`PACKABLE`).

The step scheduler (:mod:`kvferry.batching`) decides what goes into a pass; this
module only makes the model able to run it.
"""

from __future__ import annotations

import sys


class RowMasks(tuple):
    """Per-row attention masks of a batch whose rows need one (sliding windows)."""


class RowCaches:
    """One layer's caches of the sessions in a decode batch, seen by the model as one
    batched cache: RoPE gets each row's own offset, each row's K/V go into its own
    cache, and the attention below (:func:`_batched_sdpa`) reads them row by row."""

    def __init__(self, rows: list) -> None:
        self.rows = rows
        self.fetched: list = []

    @property
    def offset(self):
        import mlx.core as mx

        return mx.array([c.offset for c in self.rows], dtype=mx.int32)

    def update_and_fetch(self, keys, values):
        import mlx.core as mx

        n = len(self.rows)  # one split op per tensor, not a slice per row: the graph stays small
        self.fetched = [c.update_and_fetch(k, v) for c, k, v in
                        zip(self.rows, mx.split(keys, n, axis=0), mx.split(values, n, axis=0))]
        return keys, values  # placeholders: the attention reads self.fetched

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        masks = [c.make_mask(n, window_size=window_size, return_array=return_array) for c in self.rows]
        return None if all(m is None for m in masks) else RowMasks(masks)


_solo_sdpa = None


def _batched_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    import mlx.core as mx

    if hasattr(cache, "attention"):  # a layer of a shared-rows step (kvferry.resident.StepLayer)
        return cache.attention(queries, scale, sinks)
    if not isinstance(cache, RowCaches):
        return _solo_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    outs = []
    qs = mx.split(queries, len(cache.rows), axis=0)
    for i, (c, q, (k, v)) in enumerate(zip(cache.rows, qs, cache.fetched)):
        m = mask[i] if isinstance(mask, RowMasks) else mask
        outs.append(_solo_sdpa(q, k, v, cache=c, scale=scale, mask=m, sinks=sinks))
    return mx.concatenate(outs, axis=0)


PACKABLE = ("llama", "qwen2", "qwen3", "mistral")  # mlx-lm attention modules of one shape (below)


class PackedCaches:
    """One layer's caches of a packed step: the step's tokens side by side in one
    sequence (decode rows of one token, prompt chunks of several), each segment
    attending through its own session's cache. The model's linear layers read the
    weights once for all of them; only attention (_packed_attention) splits."""

    def __init__(self, segments: list, rows: object = None) -> None:
        self.segments = segments  # (cache, n_tokens), in sequence order
        # the leading one-token segments' layer of a shared-rows step (kvferry.resident.StepLayer),
        # where they are resident: one scatter and one attention for all of them
        self.rows = rows

    @classmethod
    def of(cls, sessions: list, rows: list | None = None) -> list["PackedCaches"]:
        """Every layer's PackedCaches for ``sessions``: (session, n_tokens) in sequence order;
        ``rows``: each layer's StepLayer of the leading decode rows, where they are resident."""
        return [cls([(s.cache[j], n) for s, n in sessions], rows[j] if rows else None)
                for j in range(len(sessions[0][0].cache))]

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        return None  # each segment makes its own (_packed_attention)


def _packed_attention(attn, x, cache: PackedCaches):
    """Llama-shaped attention (q/k/v/o projections, RoPE, optional q/k norms) over a
    packed sequence: projections on all tokens at once, then RoPE, cache and
    attention as each session would run alone. The leading one-token segments (the
    decode rows) go as one batch, as in a plain decode step (RowCaches): segment by
    segment they cost a CPU step of 4 rows 102 ms against 77 (SmolLM2)."""
    import mlx.core as mx

    _, t, _ = x.shape
    q = attn.q_proj(x).reshape(1, t, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(1, t, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(1, t, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    if cache.rows is not None:  # resident rows: a one-token prompt chunk after them is a segment of its own
        rows = cache.rows.count
    else:
        rows = 0
        while rows < len(cache.segments) and cache.segments[rows][1] == 1:
            rows += 1
    outs = []
    if rows:
        # resident rows as a plain shared-rows step runs them; their caches' own writes
        # (a slice each into the shared buffers) copied a layer's buffer once a row on a CPU
        batch = cache.rows or RowCaches([c for c, _ in cache.segments[:rows]])
        qr, kr, vr = (a[0, :rows, None].transpose(0, 2, 1, 3) for a in (q, k, v))  # (rows, heads, 1, dim)
        offset = batch.offset
        qr, kr = attn.rope(qr, offset=offset), attn.rope(kr, offset=offset)
        batch.update_and_fetch(kr, vr)
        outs.append(_batched_sdpa(qr, kr, vr, batch, attn.scale, None).transpose(2, 1, 0, 3))
    q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    at = rows
    for c, n in cache.segments[rows:]:
        qs, ks, vs = q[:, :, at:at + n], k[:, :, at:at + n], v[:, :, at:at + n]
        at += n
        qs, ks = attn.rope(qs, offset=c.offset), attn.rope(ks, offset=c.offset)
        ks, vs = c.update_and_fetch(ks, vs)
        mask = c.make_mask(n, window_size=None, return_array=False) if n > 1 else None
        outs.append(_solo_sdpa(qs, ks, vs, cache=c, scale=attn.scale, mask=mask))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, t, -1))


def install_packed(model) -> bool:
    """Let ``model``'s attention take PackedCaches (a llama-shaped attention only)."""
    layers = getattr(model, "layers", None) or []
    classes = {type(getattr(layer, "self_attn", None)) for layer in layers}
    if len(classes) != 1:
        return False
    cls = classes.pop()
    if cls.__module__.rsplit(".", 1)[-1] not in PACKABLE:
        return False
    if not getattr(cls, "_kvferry_packed", False):
        solo = cls.__call__

        def call(self, x, mask=None, cache=None):
            if isinstance(cache, PackedCaches):
                return _packed_attention(self, x, cache)
            return solo(self, x, mask=mask, cache=cache)
        cls.__call__ = call
        cls._kvferry_packed = True
    return True


def install(model) -> bool:
    """Let ``model`` run decode batches over RowCaches. False for an architecture
    whose attention does not call mlx-lm's ``scaled_dot_product_attention``: its
    sessions then step one at a time, correct but unbatched."""
    global _solo_sdpa
    from mlx_lm.models import base

    if _solo_sdpa is None:
        _solo_sdpa = base.scaled_dot_product_attention
    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", None) or []
    mods = {type(getattr(layer, "self_attn", None)).__module__ for layer in layers}
    if not layers or None in mods or type(None).__module__ in mods:
        return False
    for name in mods:
        mod = sys.modules.get(name)
        if getattr(mod, "scaled_dot_product_attention", None) not in (_solo_sdpa, _batched_sdpa):
            return False
    for name in mods:
        sys.modules[name].scaled_dot_product_attention = _batched_sdpa
    return True
