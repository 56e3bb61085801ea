"""``kvferry bench checkpoint``: KV codecs on SmolLM2's real KV cache.

For each context length the model prefills real text; the KV cache is then
encoded per mode:

- ``ratio``: raw float16 KV bytes / stored bytes, with the KV cast to float16 (as
  a Metal session holds it) — the issue's yardstick;
- ``ratio_own_dtype``: the session's own KV dtype (float32 on a CPU) / stored;
- ``lossless_bf16_ratio``: the same lossless codec on the KV cast to bfloat16;
- ``encode_mb_s`` / ``decode_mb_s``: raw KV bytes per second, one thread;
- ``top1_agreement``: teacher-forced over 64 positions: the same reference
  continuation is fed after the original and after the restored KV; fraction
  of positions whose argmax agrees; the mean over ``windows`` windows of the
  text spread across it (each in ``top1_agreement_windows``, the worst in
  ``top1_agreement_min``): one window's 64 positions swing by ±0.06 at int4;
- ``bit_exact``: the restored KV equals the original bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..checkpoint import codecs, quant

REFERENCE_TOKENS = 64


def _text() -> str:
    root = Path(__file__).resolve().parents[2]
    parts = [p.read_text() for p in sorted((root / "docs").glob("*.md"))]
    parts += [p.read_text() for p in sorted((root / "runtime").glob("*.py"))]
    return "\n".join(parts)


def _encode_all(arrs: list[np.ndarray], dtype: str, mode: str) -> tuple[list[dict], float, int]:
    half = len(arrs) // 2  # keys first, then values
    t = time.perf_counter()
    blobs = [codecs.encode(a, dtype, mode, "keys" if i < half else "values") for i, a in enumerate(arrs)]
    dt = time.perf_counter() - t
    size = sum(sum(len(p) for p in b["parts"]) + sum(len(v) for v in b["meta"].values()
                                                       if isinstance(v, bytes)) for b in blobs)
    return blobs, dt, size


def _decode_all(blobs: list[dict]) -> tuple[list[np.ndarray], float]:
    t = time.perf_counter()
    out = [codecs.decode(b, "bench") for b in blobs]
    return out, time.perf_counter() - t


def _window(lm, prompt: list[int]):
    """Prefill ``prompt`` and let the model continue it greedily (the reference).
    Returns its KV as raw float32 bits (keys then values), the KV dtype's name,
    and ``agree(arrs)``: the fraction of the reference's positions, fed back in
    after KV ``arrs``, whose argmax equals the one after the original KV."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    ctx = len(prompt)
    cache = [KVCache() for _ in lm.model.layers]
    logits = lm.model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    # the reference continuation: what the original session itself says next (greedy)
    ref_in, tok = [], int(mx.argmax(logits[0, -1]).item())
    gen = [KVCache() for _ in lm.model.layers]
    for c, g in zip(cache, gen):
        g.keys, g.values, g.offset = c.keys[..., :ctx, :], c.values[..., :ctx, :], ctx
    for _ in range(REFERENCE_TOKENS):
        ref_in.append(tok)
        tok = int(mx.argmax(lm.model(mx.array([[tok]]), cache=gen)[0, -1]).item())
    keys = [np.array(c.keys[..., :ctx, :]) for c in cache]
    vals = [np.array(c.values[..., :ctx, :]) for c in cache]
    f32 = [np.ascontiguousarray(a).view(np.uint32) for a in keys + vals]
    n = len(cache)

    def argmaxes(arrs32: list[np.ndarray]) -> np.ndarray:
        caches = []
        for i in range(n):
            c = KVCache()
            c.keys, c.values = mx.array(arrs32[i].view(np.float32)), mx.array(arrs32[n + i].view(np.float32))
            c.offset = ctx
            caches.append(c)
        return np.array(mx.argmax(lm.model(mx.array(ref_in)[None], cache=caches)[0], axis=-1))

    reference = argmaxes(f32)
    own = str(cache[0].keys.dtype).split(".")[-1]
    return f32, own, lambda arrs: float(np.mean(argmaxes(arrs) == reference))


def run(model: str | None = None, contexts=(512, 2048), modes=codecs.MODES, windows: int = 8) -> dict:
    """``windows``: text windows per context for ``top1_agreement`` (their mean;
    each window in ``top1_agreement_windows``); ratios and speeds use the first."""
    from ..models import load

    lm = load(model, progress=False)
    ids = lm.tokenizer.encode(_text(), add_special_tokens=False)
    results = {"model": lm.name, "session_kv_dtype": None, "contexts": {}}
    for ctx in contexts:
        span = max(0, len(ids) - ctx)
        starts = [span * w // max(1, windows) for w in range(max(1, windows))]
        f32, own, agree = _window(lm, ids[:ctx])
        results["session_kv_dtype"] = own
        keys_vals = [a.view(np.float32) for a in f32]
        f16 = [np.ascontiguousarray(a.astype(np.float16)).view(np.uint16) for a in keys_vals]
        bf16 = [quant.from_float32(a, "bfloat16") for a in keys_vals]
        raw16 = sum(a.nbytes for a in f16)
        raw_own = sum(a.nbytes for a in f32)
        others = [_window(lm, ids[s:s + ctx]) for s in starts[1:]]
        row = {}
        for mode in modes:
            blobs16, enc16, size16 = _encode_all(f16, "float16", mode)
            dec16, dec16_t = _decode_all(blobs16)
            blobs32, enc32, size32 = _encode_all(f32, "float32", mode)
            dec32, dec32_t = _decode_all(blobs32)
            agreements = [agree(dec32)] + [ag(_decode_all(_encode_all(w, "float32", mode)[0])[0])
                                           for w, _, ag in others]
            r = {
                "ratio": round(raw16 / size16, 3),
                "ratio_own_dtype": round(raw_own / size32, 3),
                "encode_mb_s": round(raw16 / enc16 / 1e6, 1),
                "decode_mb_s": round(raw16 / dec16_t / 1e6, 1),
                "encode_mb_s_own_dtype": round(raw_own / enc32 / 1e6, 1),
                "decode_mb_s_own_dtype": round(raw_own / dec32_t / 1e6, 1),
                "top1_agreement": round(float(np.mean(agreements)), 4),
                "top1_agreement_min": round(min(agreements), 4),
                "top1_agreement_windows": [round(a, 4) for a in agreements],
                "window_starts": starts,
            }
            if mode == "lossless":
                r["bit_exact"] = all(np.array_equal(a, b) for a, b in zip(dec16, f16)) and \
                    all(np.array_equal(a, b) for a, b in zip(dec32, f32))
                bb, _, sizeb = _encode_all(bf16, "bfloat16", mode)
                r["lossless_bf16_ratio"] = round(sum(a.nbytes for a in bf16) / sizeb, 3)
                r["bit_exact_bf16"] = all(np.array_equal(codecs.decode(b, "x"), a) for b, a in zip(bb, bf16))
            row[mode] = r
        row["raw_kv_bytes_float16"] = raw16
        row["raw_kv_bytes_own_dtype"] = raw_own
        results["contexts"][str(ctx)] = row
    return results
