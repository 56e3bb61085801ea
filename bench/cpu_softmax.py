"""Where a long prompt's prefill goes on a CPU: MLX's exp, and what a faster one buys.

    python bench/cpu_softmax.py [--context 2280] [--chunk 128] [--rounds 2] [--json]

First the parts of one layer's attention for a 128-token chunk at 2k tokens of
context (SmolLM2's 9 query and 3 KV heads), each alone: the two score matmuls,
MLX's ``mx.softmax`` and ``mx.exp`` over the scores, the max, and ``fast_exp``
below (compiled); and one of the MLP's matmuls for scale. Then SmolLM2 (as this
device's policy loads it) prefills ``--context`` tokens in chunks of ``--chunk``
and decodes 10 tokens, with mlx-lm's attention (``mx.fast.scaled_dot_product_attention``)
and with a plain one whose softmax uses ``fast_exp``, alternated ``--rounds``
times; both runs' last logits are compared. The figures in docs/performance-log.md
("A long prompt's prefill on a CPU") came from it.

``fast_exp`` is e^x as 2^n · 2^f (n = floor(x·log2 e), f in [0, 1)), 2^f by a
degree-6 polynomial and 2^n written into the float's exponent bits: eight
elementwise ops that MLX runs vectorized, against its scalar ``exp`` on x86.
A measurement, not kvferry's model path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOG2E = 1.4426950408889634
POLY = (1.5403530393381606e-4, 1.3333558146428443e-3, 9.6181291076284772e-3, 5.5504108664821580e-2,
        2.4022650695910071e-1, 6.9314718055994531e-1, 1.0)  # 2^f on [0, 1), Horner order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2280, help="prompt tokens prefilled (the bench serve long prompt's)")
    ap.add_argument("--chunk", type=int, default=128, help="prompt tokens a forward pass")
    ap.add_argument("--rounds", type=int, default=2, help="model runs of each attention, alternated")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import kvferry  # noqa: F401  (the BLAS first)
    import mlx.core as mx
    from mlx_lm.models import base, llama
    from mlx_lm.models.cache import make_prompt_cache

    from kvferry.device import current
    from kvferry.models import load

    def fast_exp(x):
        t = mx.maximum(x * LOG2E, -126.0)  # below 2^-126 a float32 is subnormal: e^x is 0 to softmax anyway
        n = mx.floor(t)
        f = t - n
        p = POLY[0]
        for c in POLY[1:]:
            p = p * f + c
        return p * mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
    fast_exp = mx.compile(fast_exp)

    def attention(q, k, v, cache, scale, mask, sinks=None):
        b, h, n, d = q.shape
        kh = k.shape[1]
        s = (q * scale).reshape(b, kh, h // kh, n, d) @ k[:, :, None].swapaxes(-1, -2)
        if isinstance(mask, str):  # "causal": the chunk's rows end at the cache's end
            mask = (mx.arange(n)[:, None] + (k.shape[2] - n)) >= mx.arange(k.shape[2])[None]
        if mask is not None:
            s = mx.where(mask, s, -1e30) if mask.dtype == mx.bool_ else s + mask
        e = fast_exp(s - s.max(axis=-1, keepdims=True))
        return ((e / e.sum(axis=-1, keepdims=True)) @ v[:, :, None]).reshape(b, h, n, d)

    def timed(f, n: int = 20) -> float:
        mx.eval(f())
        t0 = time.perf_counter()
        for _ in range(n):
            mx.eval(f())
        return round((time.perf_counter() - t0) / n * 1e3, 2)

    q = mx.random.normal((1, 3, 3 * a.chunk, 64))
    k = mx.random.normal((1, 3, 2048, 64))
    s = q @ k.swapaxes(-1, -2)
    x, w = mx.random.normal((a.chunk, 576)), mx.random.normal((576, 1536))
    parts = {"scores_matmul_ms": timed(lambda: q @ k.swapaxes(-1, -2)),
             "mx_softmax_ms": timed(lambda: mx.softmax(s, axis=-1)),
             "mx_exp_ms": timed(lambda: mx.exp(s)),
             "fast_exp_ms": timed(lambda: fast_exp(s)),
             "max_ms": timed(lambda: s.max(axis=-1)),
             "mlp_matmul_ms": timed(lambda: x @ w),
             "elements": s.size}
    got, ref = fast_exp(s - 8), mx.exp(s - 8)
    parts["fast_exp_max_rel_err"] = float((mx.abs(got - ref) / ref).max())
    if not a.json:
        print("one layer's attention parts:", parts, flush=True)

    lm = load(None, progress=False)
    model = lm.model
    ids = lm.tokenizer.encode(" ".join(["The ferry crossed the strait at dawn."] * (a.context // 8 + 8)))
    toks = mx.array(ids[:a.context])

    def run(label: str):
        cache, chunks = make_prompt_cache(model), []
        for i in range(0, a.context, a.chunk):
            t0 = time.perf_counter()
            y = model(toks[None, i:i + a.chunk], cache=cache)
            mx.eval(y)
            chunks.append(time.perf_counter() - t0)
        steps, tok = [], mx.argmax(y[:, -1:], axis=-1)
        for _ in range(10):
            t0 = time.perf_counter()
            y = model(tok, cache=cache)
            mx.eval(y)
            steps.append(time.perf_counter() - t0)
            tok = mx.argmax(y[:, -1:], axis=-1)
        row = {"attention": label, "prefill_s": round(sum(chunks), 2), "first_chunk_s": round(chunks[0], 3),
               "last_full_chunk_s": round(chunks[-2] if len(chunks) > 1 else chunks[0], 3),
               "decode_ms_p50": round(statistics.median(steps) * 1e3, 1)}
        if not a.json:
            print(row, flush=True)
        return row, y

    rows, last = [], {}
    for _ in range(a.rounds):
        for label, fn in (("mx.fast", base.scaled_dot_product_attention), ("fast_exp", attention)):
            llama.scaled_dot_product_attention = fn
            row, last[label] = run(label)
            rows.append(row)
    llama.scaled_dot_product_attention = base.scaled_dot_product_attention
    agree = {"last_logits_max_abs_diff": float(mx.abs(last["mx.fast"] - last["fast_exp"]).max()),
             "last_argmax_equal": bool((mx.argmax(last["mx.fast"], -1) == mx.argmax(last["fast_exp"], -1)).all())}
    out = {"device": current().as_dict(), "context": a.context, "chunk": a.chunk, "parts": parts, "rows": rows,
           "agreement": agree}
    print(json.dumps(out, indent=1) if a.json else agree)


if __name__ == "__main__":
    main()
