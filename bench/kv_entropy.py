"""How far can KV compression go? Empirical entropy bounds on SmolLM2's real KV.

    python bench/kv_entropy.py [--tokens 1024] [--json]

Prefills the benchmark text (as ``kvferry bench checkpoint`` does), casts the KV
to float16 and measures, per channel (layer x KV head x head-dim index), the
empirical conditional entropy of:

- float16 values as a high byte (sign, exponent, top mantissa bits) given the
  channel, and a low byte given the high byte: what any coder that codes each
  value given its channel can reach, with its per-channel tables for free
  (so the bound is optimistic);
- int8 codes as the ``int8`` mode makes them (symmetric, per-token groups along
  the head dim, one byte of scale per group) given the channel, for groups of
  64 (the codec's) and 192 (all KV heads of a token).

Prints the bounds as ratios against raw float16, the yardstick of issue 5.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def entropy(x: np.ndarray) -> float:
    _, c = np.unique(x.ravel(), return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def conditional(x: np.ndarray, given: np.ndarray) -> float:
    """H(x | given) in bits, both integer arrays of one shape, x < 65536."""
    x, g = x.astype(np.int64).ravel(), np.broadcast_to(given, x.shape).astype(np.int64).ravel()
    return entropy(g * 65536 + x) - entropy(g)


def kv(tokens: int) -> tuple[np.ndarray, np.ndarray]:
    from kvferry import blas

    blas.enable()
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvferry.bench.checkpoint import _text
    from kvferry.models import load

    lm = load(None, progress=False)
    ids = lm.tokenizer.encode(_text(), add_special_tokens=False)[:tokens]
    cache = [KVCache() for _ in lm.model.layers]
    lm.model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    k = np.stack([np.array(c.keys[0, :, :tokens, :]) for c in cache])  # [L, H, T, D]
    v = np.stack([np.array(c.values[0, :, :tokens, :]) for c in cache])
    return k, v


def bounds(k: np.ndarray, v: np.ndarray) -> dict:
    out: dict = {"float16": {}, "int8": {}}
    f16_bits, q_bits = [], {64: [], 192: []}
    for name, x in (("keys", k), ("values", v)):
        L, H, T, D = x.shape
        f = x.astype(np.float16).view(np.uint16)
        chan = np.arange(L * H * D).reshape(L, H, 1, D)
        hi, lo = f >> 8, f & 255
        h_hi, h_lo = conditional(hi, chan), conditional(lo, hi)
        out["float16"][name] = {"high_byte_given_channel": round(h_hi, 3),
                                "low_byte_given_high_byte": round(h_lo, 3)}
        f16_bits.append(h_hi + h_lo)
        tok = x.astype(np.float16).astype(np.float32).transpose(0, 2, 1, 3).reshape(L, T, H * D)
        ch = np.arange(L * H * D).reshape(L, 1, H * D)
        for g in (64, 192):
            xg = tok.reshape(L, T, -1, g)
            s = np.abs(xg).max(-1, keepdims=True) / 127
            q = np.rint(xg / np.where(s > 0, s, 1)).astype(np.int64).reshape(L, T, H * D) + 128
            bits = conditional(q, ch) + 8 / g  # + one byte of scale per group
            out["int8"].setdefault(f"group_{g}", {})[name] = round(bits, 3)
            q_bits[g].append(bits)
    out["float16"]["lossless_bound_ratio"] = round(32 / sum(f16_bits), 3)
    for g, b in q_bits.items():
        out["int8"][f"group_{g}"]["bound_ratio"] = round(32 / sum(b), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = {"tokens": a.tokens, **bounds(*kv(a.tokens))}
    if a.json:
        print(json.dumps(r, indent=2))
        return
    f = r["float16"]
    print(f"float16, bits per value given the channel: keys {f['keys']} values {f['values']}")
    print(f"  lossless bound: {f['lossless_bound_ratio']}x against raw float16")
    for g in (64, 192):
        q = r["int8"][f"group_{g}"]
        print(f"int8 group {g}: keys {q['keys']} values {q['values']} bits per value -> bound {q['bound_ratio']}x")


if __name__ == "__main__":
    main()
