"""Speculating the greedy step (a mixin of :class:`kvferry.batching.StepScheduler`).

While the guests of a decode step sample, the accelerator already runs the next
step on each row's greedy token, as mlx-lm's ``generate_step`` overlaps step n+1
with step n: a guest-driven step must otherwise wait for the guest's token before
the next forward pass can even be built. A guest that picks that token finds its
logits computed; one that picks another costs a step computed again, and a guest
that turns guesses down ``MISSES`` times in a row (one restricted to some tokens)
is no longer speculated. Only rows whose sessions sample greedily are, so a
greedy reply is the same tokens either way. The speculated K/V sit one past each
cache's offset, where the next write lands anyway: nothing to undo.

The next step is built on the device's own argmax of this step's logits, before
this step is waited for (mlx-lm's order): the accelerator queues both, and runs
the next one while the host reads this one's logits, its guests sample and its
sessions come back. Built after the wait instead, the next step's graph (~1 ms of
Python for 16 layers) ran while the accelerator sat idle.

On by default on a GPU (``serve --speculate``); on a CPU the forward pass is the
whole step and a wasted one would cost as much.
"""

from __future__ import annotations

from typing import Any

MISSES = 2  # guesses a session's guest may turn down in a row before it is no longer speculated


class _Guess:
    """A speculated next step of one session, on row ``row`` of ``tokens`` (the
    guessed tokens of the step that made it, a device array): valid while its cache
    is where it was, also when its session comes back a step or more late."""
    __slots__ = ("tokens", "row", "logits", "offset", "epoch", "n", "prefilled", "step")

    def __init__(self, tokens: Any, row: int, logits: Any, session: Any, prefilled: bool = False,
                 step: Any = None) -> None:
        self.tokens, self.row, self.logits, self.prefilled = tokens, row, logits, prefilled
        self.step = step  # the speculated step's RowLogits (row ``row`` is ours), where one made it
        self.offset, self.epoch, self.n = session.cache[0].offset, session.kv_epoch, len(session.history)

    def still(self, session: Any) -> bool:
        """Whether ``session``'s cache and history are where they were when it was made."""
        return (not session.closed and bool(session.cache) and session.cache[0].offset == self.offset
                and session.kv_epoch == self.epoch and len(session.history) == self.n)

    def holds(self, session: Any, token: int, read: dict) -> bool:
        """Still valid (:meth:`still`) and guessed ``token``. ``read``: each step's guessed
        tokens as a list, by id, filled as needed."""
        if not self.still(session):
            return False
        guessed = read.get(id(self.tokens))
        if guessed is None:  # every row's guess in one read: computed by now, before its step
            guessed = read[id(self.tokens)] = self.tokens.tolist()
        return token == guessed[self.row]


class Speculation:
    """The scheduler's guesses: ``speculate``, ``guesses`` (session -> _Guess) and
    ``missed`` (session -> misses in a row) are set up by the scheduler; these methods run on its thread, under the
    compute lock."""

    def _step(self, rows: list, plan: list, wait: bool = True) -> list:
        """This step's logits per decode row: a row whose token was guessed takes the
        speculated step's (its K/V already sit at its cache's offset); the others,
        and the prompt chunks, run a forward pass. ``wait`` False: scheduled, not
        waited for (the next step is guessed first)."""
        import mlx.core as mx

        for r in rows:
            if getattr(r.session, "landed_step", None) is not None:
                self._land(r.session)
        if not self.guesses:
            return self._forward(rows, plan, wait=wait)
        hit, read = {}, {}
        for r in rows:
            g = self.guesses.pop(r.session, None)
            if g is not None and g.holds(r.session, r.tokens[-1], read):
                hit[r] = g
                self.missed[r.session] = 0
            elif g is not None:
                self.missed[r.session] = self.missed.get(r.session, 0) + 1
        # a session not in this step keeps its guess: its K/V sit past its offset, where no
        # other row's step writes, until it comes back (a stream slow to send) or leaves
        if not hit:
            return self._forward(rows, plan, wait=wait)
        others = [r for r in rows if r not in hit]
        rest = iter(self._forward(others, plan, wait=wait) if others or plan else [])
        for r in hit:  # (after the others' pass: a failed step leaves every cache as it was)
            for c in r.session.cache:
                c.offset += 1
        prefilled = sum(g.prefilled for g in hit.values())
        self.stats["speculation_hits"] += len(hit) - prefilled
        self.stats["prefill_logits"] += prefilled  # (a first token's, from the prefill thread)
        steps = {id(g.step) for g in hit.values()}
        if not others and len(steps) == 1 and hit[rows[0]].step is not None:
            # every row from one speculated step: its rows, still one batch for the top-1
            out = hit[rows[0]].step.taken([hit[r].row for r in rows])
        else:
            out = [hit[r].logits if r in hit else next(rest) for r in rows]
        if wait:
            mx.eval(out)
        return out

    def held_guess(self, session: Any) -> tuple[Any, Any] | None:
        """(Any thread, ``session`` held still.) The step this host already ran for
        ``session``'s next token, on its guess: (the guessed token, the logits), device
        arrays not read here, whose K/V sit one past each cache's offset; None when there
        is none. A migration's pause takes it along where the guess is the guest's token
        (kvferry.checkpoint.snapshot's ``ahead``): the token is read with the rest, not
        alone (on MLX CUDA a read waits for the device). The token is a one-element slice,
        not ``tokens[row]``: that is a gather, whose kernel no served step compiles, so a
        fresh GPU host's first migration compiled it inside its pause (2.1 s on an H100)."""
        g = self.guesses.get(session)
        return (g.tokens[g.row:g.row + 1], g.logits) if g is not None and g.still(session) else None

    def _land(self, session: Any) -> None:
        """A landed session's step run by the host it came from (``landed_step``: the
        token and its logits; its K/V were written one past each cache's offset): its
        guessed step here, so its first step on this host runs no forward pass."""
        import mlx.core as mx

        token, logits = session.landed_step
        session.landed_step = None
        self.guesses[session] = _Guess(mx.array([token], dtype=mx.int32), 0, logits, session)
        self.stats["landed_steps"] += 1

    def first_logits(self, req: Any, logits: Any) -> None:
        """A prompt prefilled with its last token on the prefill thread
        (:mod:`kvferry.prefill_thread`): that token's logits (evaluated) become its
        session's guessed step, whose K/V already sit one past its offset."""
        import mlx.core as mx

        self.guesses[req.session] = _Guess(mx.array([req.tokens[-1]], dtype=mx.int32), 0, logits,
                                           req.session, prefilled=True)

    def guessing(self, rows: list, plan: list) -> bool:
        """Whether this step's next one is guessed (:meth:`_guess`, before this step's
        logits are waited for)."""
        return bool(self.speculate and rows and not plan)

    def _guess(self, rows: list, logits: list, top: Any) -> None:
        """Start the next step on each decode row's greedy token, not waited for: it
        runs on the accelerator while the guests sample (see the module docstring).
        ``logits`` may still be computing: the guess is the device's argmax of them
        (``top``, their :class:`kvferry.top1.StepTop1`)."""
        import mlx.core as mx

        # greedy sessions on plain caches, unless their guest keeps choosing otherwise
        # (a guest restricted to some tokens, say): each miss costs a step
        pick = [i for i, r in enumerate(rows) if r.session.sampling.temperature == 0 and r.session.plain_kv()
                and self.missed.get(r.session, 0) < MISSES]
        if not pick:
            return
        guess = self._greedy(logits, top, pick).astype(mx.int32)  # lazy: nothing waits for it here
        rows = [rows[i] for i in pick]
        offsets = [[c.offset for c in r.session.cache] for r in rows]
        try:
            nxt = self._forward([self.request(r.session, [-1]) for r in rows], [], wait=False, tokens=guess[:, None])
        except Exception:  # noqa: BLE001 - only a head start: the step itself goes on
            self._settle(rows)  # (what it built so far is not left lazy on this thread)
            nxt = None
        for r, offs in zip(rows, offsets):
            for c, o in zip(r.session.cache, offs):
                c.offset = o  # the guess's K/V stay one past the offset until it is taken
        if nxt is None:
            return
        for i, (r, lo) in enumerate(zip(rows, nxt)):
            self.guesses[r.session] = _Guess(guess, i, lo, r.session, step=nxt)
        self.stats["speculated"] += len(rows)

    @staticmethod
    def _greedy(logits: list, top: Any, pick: list[int]) -> Any:
        """Rows ``pick``'s greedy tokens, as a device array (not evaluated)."""
        import mlx.core as mx

        return top.ids if len(pick) == len(logits) else top.ids[mx.array(pick)]
