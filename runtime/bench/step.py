"""``kvferry bench step``: one decode step's forward pass, three ways, same caches.

The scheduler's two KV layouts (``serve --batch-kv``) against mlx-lm's own batched
cache, in one process on one model: ``shared`` (kvferry.resident: one buffer per
layer, one scatter and one masked attention for every row), ``per_session``
(RowCaches: each row's own cache and attention) and ``mlx_lm`` (``BatchKVCache``).
Each row holds a ``context``-token prompt; a figure is the median step of
``steps``, after ``warmup`` (on a GPU the first steps compile kernels). Guests,
streams and the step loop are left out: ``bench serve`` measures those.

Each layout's figure is a step waited for. ``*_pipelined`` splits a step run as a
served host and mlx-lm's generator run it, the next step queued on the device's
argmax before this one is waited for: ``build_ms`` (the graph, in Python),
``submit_ms`` (``mx.async_eval``: MLX hands the graph's kernels to the device,
host time), ``wait_ms`` (what the host still waits for the device) and
``step_ms``. On a GPU a step is host-bound when ``wait_ms`` is near zero.
"""

from __future__ import annotations

import time


def run(model: str | None = None, rows: tuple[int, ...] = (1, 8), context: int = 64, steps: int = 20,
        warmup: int = 3, progress=print) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from .. import batch_attention as batching, resident
    from ..device import current
    from ..models import load

    lm = load(model, progress=False)
    m = lm.model
    if not (batching.install(m) and batching.install_packed(m)):
        raise RuntimeError(f"{lm.name}: its attention cannot run batched")

    def prompts(n: int) -> list[list[int]]:
        return [[(17 * i + t) % 1000 + 100 for t in range(context)] for i in range(n)]

    def timed(step) -> float:
        times = []
        for i in range(warmup + steps):
            t = time.perf_counter()
            step()
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1000)
        return round(sorted(times)[len(times) // 2], 3)

    def pipelined(step, n: int) -> dict:
        """Steps queued one ahead, as a pipelined decode runs them (see the docstring)."""
        tok, prev, rec = mx.array([[5]] * n, dtype=mx.int32), None, []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            logits, state = step(tok)
            ids = mx.argmax(logits, axis=-1)
            t1 = time.perf_counter()
            mx.async_eval([logits, ids] + state)
            t2 = time.perf_counter()
            if prev is not None:
                prev.tolist()  # the host reads the step before (a sampler's token)
            t3 = time.perf_counter()
            prev, tok = ids, ids[:, None]
            if i >= warmup:
                rec.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        mx.eval(prev)
        med = [sorted(x[k] for x in rec)[len(rec) // 2] * 1000 for k in range(4)]
        return dict(zip(("build_ms", "submit_ms", "wait_ms", "step_ms"), (round(v, 3) for v in med)))

    points = []
    for n in rows:
        tok = mx.array([[5]] * n, dtype=mx.int32)
        caches = []
        for p in prompts(n):
            c = make_prompt_cache(m)
            m(mx.array([p]), cache=c)
            mx.eval([x.state for x in c])
            caches.append(c)
        stand = [resident.Bare(c) for c in caches]
        shared = resident.ResidentRows()

        def shared_step():
            assert shared.take(stand)
            out = m(tok, cache=shared.step(stand))[:, -1]
            shared.advance(stand)
            mx.eval([out] + shared.k + shared.v)

        def per_session_step():
            layers = [batching.RowCaches([c[j] for c in caches]) for j in range(len(caches[0]))]
            out = m(tok, cache=layers)[:, -1]
            mx.eval([out] + [x.state for c in caches for x in c])

        bkv = [BatchKVCache([0] * n) for _ in range(len(caches[0]))]
        m(mx.array(prompts(n)), cache=bkv)
        mx.eval([c.state for c in bkv])

        def mlx_lm_step():
            out = m(tok, cache=bkv)[:, -1]
            mx.eval([out] + [c.state for c in bkv])

        def shared_pipelined(tok):
            assert shared.take(stand)
            out = m(tok, cache=shared.step(stand))[:, -1].astype(mx.float32)
            shared.advance(stand)
            return out, shared.k + shared.v

        def mlx_lm_pipelined(tok):
            out = m(tok, cache=bkv)[:, -1].astype(mx.float32)
            return out, [x for c in bkv for x in c.state if isinstance(x, mx.array)]

        point = {"rows": n, "shared_ms": timed(shared_step), "shared_pipelined": pipelined(shared_pipelined, n)}
        for s in stand:
            shared.leave(s, s.cache)  # per-session steps on from the KV handed back
        point["per_session_ms"] = timed(per_session_step)
        point["mlx_lm_ms"] = timed(mlx_lm_step)
        point["mlx_lm_pipelined"] = pipelined(mlx_lm_pipelined, n)
        point["shared_over_mlx_lm"] = round(point["shared_ms"] / point["mlx_lm_ms"], 3)
        point["per_session_over_mlx_lm"] = round(point["per_session_ms"] / point["mlx_lm_ms"], 3)
        progress(f"{n} rows: shared {point['shared_ms']} ms, per-session {point['per_session_ms']} ms, "
                 f"mlx-lm {point['mlx_lm_ms']} ms a step")
        points.append(point)
    return {"model": lm.name, "context": context, "steps": steps, "warmup": warmup, "points": points,
            "device": current().as_dict()}
