"""Where a step's prompts go (a mixin of :class:`kvferry.batching.StepScheduler`).

A prompt reaches the step loop as a request of many tokens. Before a step runs,
a new session's first prompt starts from the longest prefix this host has kept
(:mod:`kvferry.prefix_cache`; where its rest goes in a burst, :mod:`kvferry.burst`,
straight into its row of the shared buffers); a long prompt arriving beside running decodes goes
to the prefill thread (:mod:`kvferry.prefill_thread`) with a private copy of its
caches; and what is left is cut into this step's chunks (vLLM's chunked prefill):
with nobody decoding, up to ``ALONE_TOKENS``; beside decodes, a token budget steered
from step times (:mod:`kvferry.prompt_budget`), short newcomers whole on top.
"""

from __future__ import annotations

from typing import Any

from . import burst
from .errors import SessionError
from .prefill_thread import eligible, private_copy

SHORT_PROMPT = 64  # prompt tokens a step prefills whole even beside decodes (a newcomer's turn)
ALONE_TOKENS = 2048  # prompt tokens of a step with nobody decoding, in chunks of each one's prefill_step
NEWCOMER_TOKENS = 512  # short prompts a step takes whole beside decodes, in all (a burst of newcomers)


class PromptPlacement:
    """Prefix reuse, offload to the prefill thread and the chunk plan of a step's prompts.
    Reads the scheduler's ``host``, ``cv``, ``prefills``/``decodes``, ``prefiller``,
    ``packed``, ``shared``, ``bursting``, ``stats``, ``step_tokens``, ``budget`` and ``_late``."""

    def _plan(self, rows: list, prompts: list[Any]) -> list[tuple[Any, list[int]]]:
        """The prompt chunks of this step, first come first served. With nobody
        decoding, up to ALONE_TOKENS (a chunk of ``prefill_step`` of each prompt, side
        by side where the model packs, as vLLM's ``max_num_batched_tokens``); beside
        decodes, a token budget steered from step times (:mod:`kvferry.prompt_budget`), and
        short prompts whole on top (up to NEWCOMER_TOKENS where the model packs, else
        one), so a burst of newcomers joins in a step or two, not one a step."""
        plan = []
        alone = not (rows or self._late)  # nobody decoding: ALONE_TOKENS, several prompts if they pack
        budget = ALONE_TOKENS if alone else self.step_tokens or self.budget.tokens
        # a burst (kvferry.burst) costs a newcomer a few of its tokens' work, not ~450 ops of its own
        newcomers = ALONE_TOKENS if self.bursting else NEWCOMER_TOKENS if self.packed else SHORT_PROMPT
        for req in prompts:
            left = len(req.tokens) - 1  # the last token is decoded in a batch
            if not alone and len(req.tokens) == req.n0 and left <= SHORT_PROMPT:  # untouched and short
                if left > newcomers:
                    break  # the next step's newcomers, in order
                newcomers -= left
                plan.append((req, req.tokens[:left]))
                continue
            n = min(left, req.session.options.prefill_step, budget)
            if n > 0:
                plan.append((req, req.tokens[:n]))
                budget -= n
            if alone and not self.packed:
                break
        return plan

    def _reuse(self, prompts: list[Any]) -> None:
        """New sessions' first prompts start from the longest prefix this host has
        seen (kvferry.prefix_cache): what is left to prefill is their own part. Where
        that part goes in a burst, the prefix goes into the session's row of the shared
        buffers, one write a layer for all who share it (kvferry.burst.write_prefix)."""
        fresh = [r for r in prompts if r.fresh and not r.looked]
        if not fresh or not self.host.prefix.budget:
            return
        import mlx.core as mx

        prefix = self.host.prefix
        with self.host.compute:
            groups: dict = {}  # id of a prefix's layers -> (its layers, its length, the requests)
            for r in fresh:
                r.looked = True
                if r.session.closed or r.session.history:
                    continue
                if self.bursting and burst.fits(self.shared, r.session, self.host.lm.dtype):
                    n, layers = prefix.match(r.session, r.tokens)
                    if n and len(r.tokens) - n - 1 <= burst.SHORT:
                        groups.setdefault((id(layers), n), (layers, n, []))[2].append(r)
                        continue
                    n = n and prefix.fill_from(r.session, layers, n)
                else:
                    n = prefix.fill(r.session, r.tokens)
                if n:
                    self._reused(r, n)
            if groups:
                model = self.host.lm.model
                for layers, n, reqs in groups.values():
                    sessions = [r.session for r in reqs]
                    joined = set(burst.admit(self.shared, model, self.host.lm.dtype, sessions, self.stats))
                    burst.write_prefix(self.shared, [r.session for r in reqs if r.session in joined], layers, n)
                    for r in reqs:
                        if r.session in joined:
                            self._reused(r, n)
                        else:
                            self._reused(r, prefix.fill_from(r.session, layers, n))
                # evaluated here, under the lock: another thread may read these rows before the step
                mx.eval(self.shared.k + self.shared.v)

    def _keep(self, sessions: list) -> None:
        """New sessions' whole prompts into the prefix cache; those in the shared rows
        copied out together (kvferry.burst.copies: one gather a layer, not a copy a layer each)."""
        if not sessions or not self.host.prefix.budget:
            return
        rows = [s for s in sessions if self.shared is not None and self.shared.resident(s)] if self.bursting else []
        copied = burst.copies(self.shared, rows) if len(rows) > 1 else {}
        for s in sessions:
            self.host.prefix.keep(s, copied.get(s))

    def _reused(self, r: Any, n: int) -> None:
        """``r``'s first ``n`` prompt tokens are in its cache now: the rest is its own part."""
        if not n:
            return
        r.session.history.extend(r.tokens[:n])
        r.tokens = r.tokens[n:]
        r.n0 = len(r.tokens)  # a newcomer of its own length now (_plan)
        if len(r.tokens) == 1:
            with self.cv:
                self.prefills.remove(r)
                self.decodes.append(r)

    def _offload(self, rows: list[Any], prompts: list[Any]) -> list[Any]:
        """Hand long prompts that arrive while others decode to the prefill thread,
        each with a private copy of its caches made here; returns the prompts left
        for this thread's steps."""
        if self.prefiller is None or not (rows or self._late) or not prompts:
            return prompts
        keep = []
        for r in prompts:
            if len(r.tokens) - 1 <= SHORT_PROMPT or r.session.closed or not eligible(r.session):
                keep.append(r)
                continue
            with self.cv:
                self.prefills.remove(r)
            try:
                with self.host.compute:
                    caches = private_copy(r.session.cache)
                self.prefiller.submit(r, caches)
            except Exception as e:  # noqa: BLE001 - that session hears it
                self._fail([r], e if isinstance(e, SessionError) else SessionError(f"prompt prefill failed: {e}"))
        return keep
