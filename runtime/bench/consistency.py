"""Batched against solo: how far a decode batch moves each session's numbers
(``bench serve``'s ``consistency`` block; docs/sessions.md#determinism)."""

from __future__ import annotations

from .. import batch_attention as batching


def consistency(model, prompts: list[list[int]], tokens: int, shared: bool = False) -> dict:
    """How far batching moves the numbers (the matmuls see B rows; with ``shared``
    KV rows, attention runs over the rows' padded length too).

    ``greedy_equal_solo``: the share of prompts whose greedy reply in one decode
    batch of all of them equals their solo reply. ``teacher_forced_top1``: fed the
    solo reply's tokens, the share of steps where the batched and solo logits agree
    on the top token."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    batching.install(model)
    if shared:
        from .. import resident

        rows = {}  # id of a caches list -> its ResidentRows and stand-in

    def prefilled():
        caches, last = [], []
        for p in prompts:
            c = make_prompt_cache(model)
            last.append(model(mx.array(p)[None], cache=c)[:, -1])
            caches.append(c)
        return caches, mx.concatenate(last, axis=0)

    def batched_step(caches, toks):
        x = mx.array(toks, dtype=mx.int32)[:, None]
        if shared:
            if id(caches) not in rows:
                rr, stand = resident.ResidentRows(), [resident.Bare(c) for c in caches]
                assert rr.take(stand)
                rows[id(caches)] = rr, stand
            rr, stand = rows[id(caches)]
            out = model(x, cache=rr.step(stand))[:, -1]
            rr.advance(stand)
            return out
        rc = [batching.RowCaches([c[j] for c in caches]) for j in range(len(caches[0]))]
        return model(x, cache=rc)[:, -1]

    solo_caches, logits = prefilled()
    first = mx.argmax(logits, axis=-1).tolist()
    solo = [[t] for t in first]
    for reply, c in zip(solo, solo_caches):  # solo greedy replies
        for _ in range(tokens - 1):
            reply.append(mx.argmax(model(mx.array([[reply[-1]]]), cache=c)[:, -1], axis=-1).item())
    forced, free = prefilled()[0], prefilled()[0]
    agree = total = 0
    batch = [[t] for t in first]
    for k in range(tokens - 1):
        top = mx.argmax(batched_step(forced, [s[k] for s in solo]), axis=-1).tolist()
        agree += sum(int(a == s[k + 1]) for a, s in zip(top, solo))  # fed solo's token k, solo said k + 1
        total += len(top)
        nxt = mx.argmax(batched_step(free, [b[-1] for b in batch]), axis=-1).tolist()
        for b, t in zip(batch, nxt):
            b.append(t)
    return {"prompts": len(prompts), "tokens": tokens, "kv": "shared" if shared else "per-session",
            "greedy_equal_solo": sum(a == b for a, b in zip(batch, solo)) / len(prompts),
            "teacher_forced_top1": agree / max(1, total)}
