"""Long prompts prefilled beside the decode steps, on a thread of their own.

In-step chunking (:mod:`kvferry.batching`) puts a prompt chunk into a decode step.
On a GPU a prompt pass is launch-bound: it costs about 2x a decode step whatever
its size (docs/performance-log.md), so every step that carries a chunk is slow for
every decoder. Here a long prompt that arrives while others decode is prefilled by
a second thread instead. MLX gives each thread its own stream, so the GPU runs
the chunks beside the decode steps, and ``mx.eval`` releases the GIL, so the step
thread never waits for them (vLLM splits prefill from decode for the same reason).
Its chunks are mlx-lm's default prefill size (or the session's larger
``prefill_step``): on a stream of its own a chunk holds no decode step back, while
each chunk costs the step thread about one chunk's kernel submission beside it,
so fewer chunks slow fewer steps (on an H200 a 2,280-token prompt went in in
0.13-0.15 s in 2 chunks, against 0.25-0.37 s in chunks of 128).

The chunks go into private copies of the session's caches, which are published
with the history under the compute lock once the prompt is in. A pre-copy or a
checkpoint therefore never sees a half-built cache: only arrays that are already
evaluated ever cross threads. The prompt's last token goes in with its last chunk
too, and its logits are handed to the step thread as that session's guessed step
(:mod:`kvferry.speculation`). Its first decode step then takes them like any
guess: it costs that step no forward pass of its own. Decoded on the step thread
instead, it was a second pass beside the other rows' guessed one, which made
that step about 2x (38 against 11-18 ms on an H200, docs/performance-log.md).

On by default on a GPU (``serve --prefill-thread``). On a CPU the two threads
would share the same cores, so in-step chunks stay the default there.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Any

from .errors import SessionError
from .step_forward import vocab_head

# CPython hands the GIL to a waiting thread only every switch interval (5 ms by
# default): a decode step waiting for it behind this thread's Python took 11.8 ms
# instead of 6.1 on an H200, and 5.4 ms with 0.5 ms (docs/performance-log.md)
SWITCH_S = 0.0005
CHUNK = 2048  # prompt tokens a chunk (mlx-lm's prefill_step_size; llama.cpp's -b)


def eligible(session: Any) -> bool:
    """Plain mlx-lm ``KVCache`` layers only (not resident rows, sliding or quantized
    caches): those are what a private copy can stand in for."""
    from mlx_lm.models.cache import KVCache

    return bool(session.cache) and all(type(c) is KVCache for c in session.cache)


def private_copy(caches: list) -> list:
    """Private caches holding the same tokens, evaluated (new buffers: nothing
    shared that the prefill could write through). Made on the step thread, under
    the compute lock: its evaluation also settles any lazy op on the session's
    caches there (a prefix filled in), so only evaluated arrays cross threads."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        p = KVCache()
        if c.offset:
            p.update_and_fetch(c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
        out.append(p)
    mx.eval([x for p in out if p.offset for x in (p.keys, p.values)])
    return out


class PrefillThread:
    """One host's prefill thread. :meth:`submit` takes a prompt request of the
    step scheduler (all its tokens but the last, which the scheduler decodes) with
    its session's :func:`private_copy`; the request goes back to the scheduler's
    decode queue when its prompt is in."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps
        self.cv = threading.Condition()
        self.queue: deque = deque()
        self.closed = False
        self.busy = None  # the request being prefilled, with its caches
        self.stats = {"prompts": 0, "tokens": 0}
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_S))  # (process-wide)
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvferry-prefill")
        self.thread.start()

    def submit(self, req: Any, caches: list) -> None:
        with self.cv:
            if self.closed:
                raise SessionError("this host is shutting down")
            self.queue.append((req, caches))
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        import mlx.core as mx

        try:
            while True:
                with self.cv:
                    while not (self.queue or self.closed):
                        self.cv.wait()
                    if self.closed:
                        break
                    req, caches = self.busy = self.queue.popleft()
                try:
                    self._prefill(req, caches)
                except Exception as e:  # noqa: BLE001 - that session hears it; the thread goes on
                    err = e if isinstance(e, SessionError) else SessionError(f"prompt prefill failed: {e}")
                    self.steps.fail_request(req, err)
                finally:
                    with self.cv:
                        self.busy = None
        finally:
            with self.cv:
                left, self.queue = list(self.queue), deque()
            for req, _ in left:
                self.steps.fail_request(req, SessionError("this host is shutting down"))
            mx.clear_streams()  # this thread's MLX streams go with it (see StepScheduler._run)

    def _prefill(self, req: Any, caches: list) -> None:
        import mlx.core as mx

        s, host = req.session, self.steps.host
        model = host.lm.model
        body = getattr(model, "model", None) if self.steps.packed else None  # no vocabulary projection
        tokens = req.tokens  # the last one too: its logits come from here (see first_logits)
        step = max(1, s.options.prefill_step, CHUNK)
        logits = None
        for at in range(0, len(tokens), step):
            if s.closed or self.closed:
                raise SessionError("the session was closed during its prompt")
            chunk = mx.array(tokens[at:at + step], dtype=mx.int32)[None]
            if at + step < len(tokens):
                (body or model)(chunk, cache=caches)
            elif body is not None:
                logits = vocab_head(model)(body(chunk, cache=caches)[:, -1])[0].astype(mx.float32)
            else:
                logits = model(chunk, cache=caches)[0, -1].astype(mx.float32)
            mx.eval([x for c in caches for x in (c.keys, c.values)] + ([logits] if logits is not None else []))
            # (the GIL is free while it runs)
        with host.compute:  # the history moves with the cache (pre-copy reads both under it)
            if s.closed:
                raise SessionError("the session was closed during its prompt")
            for c, p in zip(s.cache, caches):
                # the last token's K/V sit one past the offset, as a speculated step's do
                c.keys, c.values, c.offset = p.keys, p.values, p.offset - 1
            s.history.extend(tokens[:-1])
            req.tokens = req.tokens[-1:]
            if req.fresh:  # its prompt is in: others may start from it (kvferry.prefix_cache)
                host.prefix.keep(s)
            self.steps.first_logits(req, logits)
        self.stats["prompts"] += 1
        self.stats["tokens"] += len(tokens)
        self.steps.decode_next(req)
