"""Continuous batching: one forward pass a step for every session with a token pending.

Sessions keep their own mlx-lm caches (what checkpoints, pre-copy and restores
read). A step stacks their pending tokens into one ``(B, 1)`` batch: the linear
layers, which read every weight, run once for the whole batch, while attention
runs per session on its own cache, or over shared resident rows
(:mod:`kvferry.batch_attention`, :mod:`kvferry.resident`). So a session joins or
leaves a running batch without stopping it.

Prompts are prefilled in chunks next to the decode batch under a per-step token
budget (vLLM's chunked prefill): a long prompt arriving costs the running
sessions a bounded share of each step, never a stall. Short new prompts join
whole, several in one pass (on a GPU, as one batch into the shared rows: :mod:`kvferry.burst`).

The guests keep the control plane and ABI v1 is unchanged. Either a guest runs
on its session's thread, its ``kv_decode`` handing its token to this scheduler
and waiting for the step, and a step waits for guests still sampling at most
``guest_step_ms``; or (``drive``, the GPU default) this thread decodes the token
each guest returned and then calls the guest's step itself (:meth:`guest_step`),
one thread switch a token instead of several.

A GPU host also queues each greedy row's next step on the device's argmax
before it waits for the step (:mod:`kvferry.speculation`), as mlx-lm does.

Driven, a step also *runs on* (:mod:`kvferry.run_on`; ``KVFERRY_RUN_ON=0``: not): the
decode of each token a guest chose is queued for the next step at once.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any

from . import burst
from .batch_attention import install, install_packed
from .collector import paused_seconds
from .errors import ConfigError, SessionError
from .prefill_thread import PrefillThread
from .prompt_placement import PromptPlacement
from .run_on import RunOn
from .top1 import StepTop1
from .prompt_budget import CPU_FLOOR, FLOOR, PromptBudget
from .speculation import Speculation
from .step_forward import StepForward


log = logging.getLogger("kvferry.steps")

_LIVE: "weakref.WeakSet[StepScheduler]" = weakref.WeakSet()


def _open_trace(folder: str | None):
    """KVFERRY_STEP_TRACE=DIR: one JSON line a step in DIR/steps-PID.jsonl (docs/performance.md)."""
    if not folder:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        return open(os.path.join(folder, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)
    except OSError as e:
        raise ConfigError(f"KVFERRY_STEP_TRACE={folder}: cannot write a step trace there ({e.strerror})") from None


@atexit.register
def _close_all() -> None:
    """Stop every host's step thread before the interpreter goes (see StepScheduler._run)."""
    for s in list(_LIVE):
        s.close()


class _Request:
    """Tokens a session needs run: a prompt (prefilled in chunks, its last token
    decoded in a batch) or one token to decode. Done when its logits are known, or
    for a driven decode when its guest has chosen the next token from them."""
    __slots__ = ("session", "tokens", "n0", "done", "logits", "top1", "error", "driven", "token", "fresh",
                 "looked", "unattended", "attached", "ran", "gone")

    def __init__(self, session: Any, tokens: list[int], driven: bool = False) -> None:
        self.session, self.tokens, self.n0 = session, tokens, len(tokens)
        self.done = threading.Event()
        self.logits = self.top1 = self.error = self.token = None  # top1: (StepTop1, row)
        self.driven = driven
        # a new session's first prompt: it may start from a cached prefix, and is kept for others
        self.fresh = (len(tokens) > 1 and not session.history and session.plain_kv()
                      and session.cache[0].empty())
        self.looked = False  # the prefix cache was asked for it
        # run on (a driven decode this thread queued itself): its session's thread attaches when it
        # comes back; one that comes back after the step finds it ``ran`` and calls its guest itself
        self.unattended = self.attached = self.ran = self.gone = False  # gone: retracted, never driven


class StepScheduler(PromptPlacement, RunOn, Speculation, StepForward):
    """The step loop of one host (one thread). See the module docstring."""

    def __init__(self, host: Any, *, max_batch: int, guest_step_ms: float, step_tokens: int = 0,
                 speculate: bool = False, shared_kv: bool = False, split_prefill: bool = False,
                 drive: bool = False, prefill_thread: bool = False) -> None:
        self.host = host
        self.drive = drive  # decode steps run the guests on this thread (guest_step)
        self.speculate = speculate
        # greedy guests answered from the step's device top-1 (kvferry.top1) where reading
        # the logits on the host costs a move out of device memory; on a CPU numpy reads
        # them in place, faster than MLX's argmax over a batch (9 against 0.5 ms at 64 rows here)
        import mlx.core as mx

        gpu = mx.default_device() != mx.cpu
        self.device_top1 = gpu
        self.guesses: dict[Any, Any] = {}  # session -> its speculated next step (kvferry.speculation)
        self.missed: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # guesses missed in a row
        self.max_batch = max_batch
        self.gather_s = guest_step_ms / 1000
        self.step_tokens = step_tokens  # prompt tokens a step may add next to decodes (0: adaptive)
        self.batched = install(host.lm.model)
        self.packed = self.batched and install_packed(host.lm.model)  # prompt chunks in the same pass
        self.shared = None  # kvferry.resident.ResidentRows: decode rows' KV in one buffer per layer
        if shared_kv and self.packed:  # (llama-shaped attention, as PackedCaches)
            from . import resident

            self.shared = resident.ResidentRows()
        # short prompts as one batch into the shared rows (kvferry.burst): where a step's ops cost most
        self.bursting = self.shared is not None and burst.enabled(split_prefill)
        # A step with decode rows and prompt chunks: one pass over both (the weights read
        # once: a CPU's bound), or two (GPU: the decode rows keep their batched attention;
        # a burst goes in a pass of its own)
        self.split = split_prefill or self.bursting
        self.departing: dict = {}  # resident session -> its caches, to leave the buffers at the next step
        self.cv = threading.Condition()
        self.decodes: deque[_Request] = deque()
        self.prefills: deque[_Request] = deque()
        self.expect: set = set()  # sessions given logits by the last step and not back yet
        self._init_run_on(drive)
        self.closed = False
        self._last = time.monotonic()
        self._expect_until = 0.0  # a step waits for expected sessions until then at least (expect_soon)
        # prompt tokens beside decodes, steered from step times; on a CPU down to one a step
        self.budget = PromptBudget(floor=FLOOR if gpu else CPU_FLOOR)
        self._late = False
        self.stats = {"steps": 0, "decode_rows": 0, "prefill_tokens": 0, "max_batch_seen": 0,
                      "forward_s": 0.0,  # time in forward passes (the rest: guests and waiting)
                      "speculated": 0, "speculation_hits": 0, "prefill_logits": 0,
                      "landed_steps": 0,  # first steps a migrated session took from its source (speculation)
                      "resident_joins": 0, "resident_steps": 0,  # shared KV rows (kvferry.resident)
                      "burst_steps": 0, "burst_chunks": 0,  # short prompts prefilled as one batch (kvferry.burst)
                      # decodes queued before their sessions' threads came back, those they came back
                      # too late to drive (their guests called on their own threads), and those taken back
                      "run_on": 0, "run_on_late": 0, "run_on_retracted": 0}
        self.last_rows = 0  # rows of the last decode step (a gauge)
        self._trace = _open_trace(os.environ.get("KVFERRY_STEP_TRACE"))
        # long prompts arriving beside decodes: prefilled on a thread of their own (kvferry.prefill_thread)
        self.prefiller = PrefillThread(self) if prefill_thread else None
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvferry-steps")
        self.thread.start()
        _LIVE.add(self)

    # -- the sessions' side --------------------------------------------------------
    def run(self, session: Any, tokens: list[int]):
        """Run ``tokens`` through ``session``'s model state in the next steps (called
        from the session's own thread, inside its guest's kv_prefill/kv_decode);
        return the logits after the last one, and their greedy token's source
        ((StepTop1, row), or None)."""
        req = _Request(session, list(tokens))
        if threading.current_thread() is self.thread:  # a driven guest decoding another token
            if len(tokens) != 1:
                raise SessionError("a driven guest step prefills nothing")
            with self.host.compute:
                try:
                    logits = self._forward([req], [])
                except Exception:
                    self._settle([req])
                    raise
                session.history.append(tokens[0])
            return logits[0], None
        self._enqueue(req)
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.logits, req.top1

    def _enqueue(self, req: _Request) -> None:
        with self.cv:
            if self.closed:
                raise SessionError("this host is shutting down")
            idle = not (self.decodes or self.prefills)
            self.expect.discard(req.session)
            (self.prefills if len(req.tokens) > 1 else self.decodes).append(req)
            # the step thread waits for an idle host's first request or for a step's last
            # session to come back: waking it for each one between only hands it the GIL
            if idle or not self.expect:
                self.cv.notify_all()

    def guest_step(self, session: Any, last: int | None) -> int:
        """``session``'s next guest step (from its own thread): its token or a stop code.
        Driven, a decode of ``last`` (the token its guest returned before, which a chat
        guest decodes next) joins the next step, and this thread then calls the guest
        itself: one thread switch a token instead of several, and no guest waits for
        the GIL to read its logits. A prompt step, or a cache that cannot take a
        token back, runs the guest on the session's thread as before."""
        if not (self.drive and last is not None and last >= 0 and not session._prompt_left
                and session.plain_kv()):
            return session.guest_step()
        req = self._attach(session, last)
        if req is None:
            req = _Request(session, [last], driven=True)
            self._enqueue(req)
        elif req.ran:  # it ran before this thread came back: the guest is called here, on its logits
            if req.error is not None:
                raise req.error
            return session.guest_step((last, req.logits, req.top1))
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.token

    def _drive(self, reqs: list[_Request]) -> None:
        """Run the guests of this step's driven rows, each on its logits (on this
        thread, under a deadline of a few budgets: a guest that spins is cut off)."""
        deadline = max(5 * self.gather_s, 0.1) * 1000
        reqs = self._drivable(reqs)
        for r in reqs:
            try:
                r.token = r.session.guest_step((r.tokens[-1], r.logits, r.top1), deadline_ms=deadline)
            except BaseException as e:  # noqa: BLE001 - it is that session's error, told on its thread
                r.error = e
        if self.runs_on:
            self._run_on(reqs)
        # woken only now: a session thread woken earlier takes the GIL from this loop at
        # every crossing into a guest (64 sessions on a CPU proxy: 227 against 355 us a guest)
        for r in reqs:
            r.done.set()

    def expect_soon(self, sessions: list, within_s: float = 0.0) -> None:
        """``sessions`` send their requests within a gather window from now (or
        ``within_s``, where longer): the next step waits for them as for its decoders
        (so their prompts go in together)."""
        with self.cv:
            self.expect |= set(sessions)
            self._last = time.monotonic()
            self._expect_until = self._last + within_s

    def leave(self, session: Any) -> None:
        """``session`` has no token coming this step (its turn ended or paused)."""
        self.guesses.pop(session, None)  # nor the guessed one: drop it (and the cache it holds)
        with self.cv:
            undo = self._unhold(session)
            if self.shared is not None and self.shared.owns(session):
                self.departing[session] = list(session.cache)  # its KV goes back to it at the next step
                self.cv.notify_all()
            if session in self.expect:
                self.expect.discard(session)
                self.cv.notify_all()
        self._undo(session, undo)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.prefiller is not None:
            self.prefiller.close()
        self.thread.join(timeout=5)

    # -- the prefill thread's side ---------------------------------------------------
    def decode_next(self, req: _Request) -> None:
        """A prompt prefilled elsewhere: its last token joins the next decode batch."""
        with self.cv:
            if not self.closed:
                self.decodes.append(req)
                self.cv.notify_all()
                return
        self._fail([req], SessionError("this host is shutting down"))

    def fail_request(self, req: _Request, err: Exception) -> None:
        self._fail([req], err)

    # -- the step loop ---------------------------------------------------------------
    def _next(self) -> tuple[list[_Request], list[_Request]]:
        with self.cv:
            while not (self.decodes or self.prefills or self.closed or self.departing):
                self.cv.wait()
            # sessions still sampling get until gather_s after the last step to join this one
            deadline = max(self._last + self.gather_s, self._expect_until)
            while self.expect and not self.closed and (left := deadline - time.monotonic()) > 0:
                self.cv.wait(left)
            if self.closed:
                return [], []
            self._expect_until = 0.0  # (for this step only: the next waits for its rows as usual)
            rows = [self.decodes.popleft() for _ in range(min(len(self.decodes), self.max_batch))]
            self._late = bool(self.expect)  # decoders still sampling: a prompt chunk stays small anyway
            return rows, list(self.prefills)

    def _run(self) -> None:
        import mlx.core as mx

        try:
            self._loop()
        finally:
            self.guesses.clear()
            if self._trace:
                self._trace.close()
            try:
                mx.synchronize()  # a speculated step may still run: let it finish before its stream goes
            except Exception:  # noqa: BLE001 - shutting down either way
                pass
            # MLX made this thread its own streams; they must go with it, before the
            # interpreter exits (else the process aborts at exit: ml-explore/mlx#3395)
            mx.clear_streams()

    def _loop(self) -> None:
        import mlx.core as mx

        while True:
            rows, prompts = self._next()
            if self.closed:
                break
            if self.departing:
                self._depart(rows, prompts)
            if not rows and not prompts:
                continue
            self._reuse(prompts)
            prompts = self._offload(rows, prompts)
            plan = self._plan(rows, [r for r in prompts if len(r.tokens) > 1])
            for req, chunk in plan:
                req.tokens = req.tokens[len(chunk):]
                if len(req.tokens) == 1:  # its last token joins the next decode batch
                    with self.cv:
                        self.prefills.remove(req)
                        self.decodes.append(req)
            t0 = time.perf_counter()
            t_lock, gc0, hits0 = t0, paused_seconds(), self.stats["speculation_hits"]
            join0 = self._join_s
            try:
                with self.host.compute:
                    t_lock = time.perf_counter()
                    try:
                        rows, plan = self._open_only(rows, plan)
                        guessing = self.guessing(rows, plan)  # the next step is queued before this one is waited for
                        logits = self._step(rows, plan, wait=not guessing)
                        # greedy guests read this, not the logits; a guess is its argmax
                        top = StepTop1(logits) if logits and (guessing or self.device_top1) else None
                        for r in rows:  # the history moves with the cache, under the compute lock
                            r.session.history.append(r.tokens[-1])  # (pre-copy reads both)
                        for req, chunk in plan:
                            req.session.history.extend(chunk)
                        # prompts now in: others may start from them
                        self._keep([req.session for req, _ in plan if req.fresh and len(req.tokens) == 1])
                        if guessing:
                            self._guess(rows, logits, top)
                            mx.eval(logits, top.pairs)
                        elif top is not None:
                            mx.eval(top.pairs)  # (the logits are evaluated by now)
                    except Exception:
                        self._settle(rows + [req for req, _ in plan])
                        raise
            except Exception as e:  # noqa: BLE001 - the sessions of this step hear it, the loop goes on
                err = e if isinstance(e, SessionError) else SessionError(f"model step failed: {e}")
                self._fail(rows + [req for req, _ in plan], err)
                continue
            t1 = time.perf_counter()
            self._account(rows, sum(len(c) for _, c in plan), t1 - t0)
            with self.cv:
                self.expect = {r.session for r in rows}
            for i, (r, lo) in enumerate(zip(rows, logits)):
                r.logits, r.top1 = lo, (top, i) if top is not None else None
                if not r.driven:
                    r.done.set()
            self._drive([r for r in rows if r.driven])
            if self._trace:
                self._trace.write(json.dumps({
                    "t": round(t0, 6), "forward_ms": round((t1 - t0) * 1e3, 2),
                    "lock_ms": round((t_lock - t0) * 1e3, 2),  # of forward_ms: waiting for the compute lock
                    "guessed": self.stats["speculation_hits"] - hits0,  # rows that took their speculated step
                    "ran_on": sum(r.unattended for r in rows),  # rows queued before their threads came back
                    "guests_ms": round((time.perf_counter() - t1) * 1e3, 2),
                    "gc_ms": round((paused_seconds() - gc0) * 1e3, 2),  # collections (any thread's) in both
                    "join_ms": round((self._join_s - join0) * 1e3, 2),
                    "rows": [[r.session.id, len(r.session.history)] for r in rows],
                    "prompts": [[q.session.id, len(c)] for q, c in plan]}) + "\n")
            with self.cv:  # the gather window opens once every row has its logits or its token
                self._last = time.monotonic()
        self._fail(list(self.prefills) + list(self.decodes), SessionError("this host is shutting down"))

    def _settle(self, reqs: list) -> None:
        """After a step failed (or its guess): what it built before it failed (the K/V
        of the layers it reached) is lazy on this thread's stream, in the shared buffers
        and in the caches of ``reqs``' sessions, where no other thread can evaluate it:
        a checkpoint or a pre-copy would fail with "There is no Stream(cpu, N) in current
        thread". Evaluated here, before the lock goes. (Own caches may be left with the
        layers it reached one chunk further on; their sessions' guests heard the failure
        midway and are unusable, and a checkpoint reads only the history's tokens.)"""
        import mlx.core as mx

        arrays = list(self.shared.k + self.shared.v) if self.shared is not None else []
        for r in reqs:
            for c in r.session.cache:
                for name in ("keys", "values"):  # a resident cache has none of its own: its row is in the buffers
                    x = c.__dict__.get(name)
                    arrays.extend(x if isinstance(x, (list, tuple)) else [] if x is None else [x])
        try:
            mx.eval(arrays)
        except Exception as e:  # noqa: BLE001 - the step's own error is the one reported
            log.warning("the caches could not be evaluated after a failed step: %s", e)

    def _depart(self, rows: list[_Request], prompts: list[_Request]) -> None:
        """Sessions whose turn ended leave the resident buffers (their KV copied back),
        unless they have a token in this step."""
        with self.cv:
            stepping = {r.session for r in rows} | {r.session for r in prompts}
            going = [(s, c) for s, c in self.departing.items() if s not in stepping or s.closed]
            self.departing = {}
        if going:
            with self.host.compute:
                for s, caches in going:
                    self.shared.leave(s, caches)

    def _fail(self, reqs: list[_Request], err: Exception) -> None:
        with self.cv:
            for r in reqs:
                for q in (self.prefills, self.decodes):
                    if r in q:
                        q.remove(r)
        for r in reqs:
            r.error = err
            r.done.set()

    def _open_only(self, rows: list[_Request], plan: list) -> tuple[list[_Request], list]:
        """This step's work without sessions closed by another thread while they
        waited: those alone hear of it."""
        closed = [r for r in rows if r.session.closed] + [r for r, _ in plan if r.session.closed]
        if not closed:
            return rows, plan
        for r in closed:  # (a guess made while it closed, after its close dropped the others)
            self.guesses.pop(r.session, None)
        self._fail(closed, SessionError("the session was closed during its step"))
        return [r for r in rows if r not in closed], [(r, c) for r, c in plan if r not in closed]

    @property
    def _join_s(self) -> float:
        """Seconds spent joining sessions to the shared rows so far (the step trace's join_ms)."""
        return self.shared.join_s if self.shared is not None else 0.0

    @staticmethod
    def request(session: Any, tokens: list[int], driven: bool = False) -> _Request:
        return _Request(session, tokens, driven)

    def _account(self, rows: list, n_prompt: int, dt: float) -> None:
        s = self.stats
        s["steps"] += 1
        s["decode_rows"] += len(rows)
        s["prefill_tokens"] += n_prompt
        s["max_batch_seen"] = max(s["max_batch_seen"], len(rows))
        self.last_rows = len(rows)
        s["forward_s"] += dt
        if not self.step_tokens:
            self.budget.observe(len(rows), n_prompt, dt)
