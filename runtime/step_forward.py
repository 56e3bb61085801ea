"""A step's model work (a mixin of :class:`kvferry.batching.StepScheduler`): the
decode rows' forward pass, over shared resident rows (:mod:`kvferry.resident`),
per-session caches side by side (:class:`kvferry.batch_attention.RowCaches`) or
packed with prompt chunks in one pass (:class:`kvferry.batch_attention.PackedCaches`),
and the prompt chunks' prefill. Which steps run, and when, is the scheduler's.
"""

from __future__ import annotations

from typing import Any

from . import burst
from .batch_attention import PackedCaches, RowCaches


class StepForward:
    """The forward passes of a step. ``host``, ``batched``, ``packed``, ``split``,
    ``shared`` (the host's :class:`kvferry.resident.ResidentRows`, or None) and
    ``stats`` are set up by the scheduler; these methods run on its thread, under
    the compute lock."""

    def _forward(self, rows: list, plan: list, wait: bool = True, tokens: Any = None):
        """One step's model work; returns each decode row's logits, evaluated (with
        ``wait`` False: scheduled, still running). ``tokens``: the rows' tokens as a
        ``(B, 1)`` device array (a guess not yet computed), else their last ones."""
        import mlx.core as mx

        model = self.host.lm.model
        if self.packed and rows and plan and not self.split:
            return self._forward_packed(rows, plan)
        out, logits = [], []
        resident = False
        if rows:
            if tokens is None:
                tokens = mx.array([[r.tokens[-1]] for r in rows], dtype=mx.int32)
            sessions = [r.session for r in rows]
            if len(rows) == 1 or not self.batched:
                parts = [model(tokens[i:i + 1], cache=r.session.cache)[:, -1] for i, r in enumerate(rows)]
                batch = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
            elif (layers := self._resident_step(sessions)) is not None:
                batch = model(tokens, cache=layers)[:, -1]
                self.shared.advance(sessions)
                out.extend(self.shared.k + self.shared.v)
                resident = True
            else:
                n_layers = len(rows[0].session.cache)
                caches = [RowCaches([r.session.cache[j] for r in rows]) for j in range(n_layers)]
                batch = model(tokens, cache=caches)[:, -1]
            # one evaluated float32 array per row: the guest's kv_logits then only reads it
            # (a lazy op made on this thread's stream could not be evaluated on the guest's)
            logits = RowLogits(batch.astype(mx.float32))
            out.extend(logits)
        if plan:
            out.extend(self._prefill(plan))
        if not wait:
            # a row's own caches too, so none is left lazy on this thread's stream; a
            # resident row's are views of the buffers already in ``out`` (slicing them
            # all was half the step thread's time at 64 rows on a GPU)
            mx.async_eval(out if resident else out + [c.state for r in rows for c in r.session.cache])
            return logits
        mx.eval(out)
        return logits

    def _prefill(self, plan: list) -> list:
        """Prompt chunks into their sessions' caches; returns the arrays to evaluate. No
        logits: a prompt's last token is decoded in a batch. Several short chunks go as
        one batch into the shared rows (a burst, :mod:`kvferry.burst`), others side by side
        in one pass (packed)."""
        import mlx.core as mx

        model = self.host.lm.model
        out = []
        bursting = [(r, c) for r, c in plan if self._bursts(r, c)] if self.bursting else []
        if len(bursting) > 1:
            sessions = [r.session for r, _ in bursting]
            joined = set(burst.admit(self.shared, model, self.host.lm.dtype, sessions, self.stats))
            bursting = [(r, c) for r, c in bursting if r.session in joined]
        if len(bursting) > 1:
            self.stats["burst_steps"] += 1
            self.stats["burst_chunks"] += len(bursting)
            out.extend(burst.prefill(self.shared, model, [(r.session, c) for r, c in bursting]))
            went = {id(r) for r, _ in bursting}
            plan = [(r, c) for r, c in plan if id(r) not in went]
        body = getattr(model, "model", None) if self.packed else None  # no vocabulary projection
        if body is not None and len(plan) > 1:
            tokens = [t for _, chunk in plan for t in chunk]
            body(mx.array(tokens, dtype=mx.int32)[None], cache=PackedCaches.of([(r.session, len(c)) for r, c in plan]))
        else:
            for req, chunk in plan:
                (body or model)(mx.array(chunk, dtype=mx.int32)[None], cache=req.session.cache)
        return out + [c.state for req, _ in plan for c in req.session.cache]

    def _resident_step(self, sessions: list) -> list | None:
        """The shared rows' layers for one decode step of ``sessions`` (those not resident
        join), counted; None where one cannot join: their rows then run per session. The
        caller advances the rows once its pass is built."""
        if self.shared is None or not self.shared.take(sessions, self.stats):
            return None
        self.stats["resident_steps"] += 1
        return self.shared.step(sessions)

    def _bursts(self, req: Any, chunk: list) -> bool:
        """Whether ``req``'s chunk can go in a burst: short, on caches that join the shared rows."""
        return len(chunk) <= burst.SHORT and not req.session.closed and burst.fits(self.shared, req.session,
                                                                                   self.host.lm.dtype)

    def _forward_packed(self, rows: list, plan: list):
        """Decode rows and prompt chunks in one forward pass (one read of the weights);
        the vocabulary projection runs on the decode rows' positions only."""
        import mlx.core as mx

        model = self.host.lm.model
        tokens = [r.tokens[-1] for r in rows] + [t for _, chunk in plan for t in chunk]
        sessions = [r.session for r in rows]
        layers = self._resident_step(sessions)
        resident = layers is not None
        caches = PackedCaches.of([(s, 1) for s in sessions] + [(req.session, len(c)) for req, c in plan], layers)
        hidden = model.model(mx.array(tokens, dtype=mx.int32)[None], cache=caches)[:, :len(rows)]
        if resident:
            self.shared.advance(sessions)
        logits = RowLogits(vocab_head(model)(hidden)[0].astype(mx.float32))  # a row's: its token's position
        mx.eval(logits + [c.state for req, _ in plan for c in req.session.cache]
                + (self.shared.k + self.shared.v if resident else []))
        return logits


class RowLogits(list):
    """A decode step's logits, one row a session, and the step's ``batch`` (rows,
    vocabulary) they came from, for whoever needs them together
    (:class:`kvferry.top1.StepTop1`: stacking the rows back was a copy a row, 64
    kernels a step at 64 rows on a GPU). Each row is an array of its own
    (``batch[i]``), not a view: a session keeps its last row between turns, and a
    view would keep the step's whole batch alive with it."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        super().__init__(batch[i] for i in range(batch.shape[0]))
        self.batch = batch

    def taken(self, rows: list[int]) -> "RowLogits":
        """These rows (indices into this step's), in that order, as RowLogits of their own:
        the same arrays, and one Gather for their batch unless they are all of it, in order."""
        import mlx.core as mx

        out = RowLogits.__new__(RowLogits)
        list.__init__(out, (self[i] for i in rows))
        whole = rows == list(range(len(self)))
        out.batch = self.batch if whole else self.batch[mx.array(rows, dtype=mx.int32)]
        return out


def vocab_head(model: Any) -> Any:
    """An mlx-lm model's vocabulary projection: its own, or its tied embeddings."""
    return model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear
