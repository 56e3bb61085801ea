"""Attention for prompt chunks on a CPU, with an exp that MLX runs vectorized.

MLX's CPU ``exp`` is scalar on x86 (~12 ns a float on a 2-core CI machine), and a
prompt chunk's softmax over its scores is most of a long prompt's prefill there: at
2k tokens of context, 28.5 ms a layer for a 128-token chunk of SmolLM2 against
2.4 ms for the scores' matmul (``bench/cpu_softmax.py``, docs/performance.md).

Here e^x is 2^n · 2^f, with n = round(x · log2 e) written into a float's exponent
bits and 2^f on [-1/2, 1/2] by a degree-6 polynomial (a relative fit of 1.9e-9,
so float32's own rounding is the error): a handful of elementwise ops that
``mx.compile`` fuses into one vectorized pass. Decode steps (one query a row) keep
MLX's attention: their softmax is small, and their numerics stay mlx-lm's.
``KVFERRY_CPU_ATTENTION=mlx`` keeps MLX's attention for prompt chunks too.
"""

from __future__ import annotations

import os

LOG2E = 1.4426950408889634
POLY = (0.00015337576753261537, 0.001339986036366092, 0.009618519534616595, 0.05550328997516163,
        0.24022646608712273, 0.6931472056005118, 1.0000000005920209)  # 2^f on [-1/2, 1/2], Horner order

_exp = None


def _compiled_exp():
    global _exp
    if _exp is None:
        import mlx.core as mx

        def exp(x):
            t = mx.clip(x * LOG2E, -126.0, 127.0)  # past these, float32's e^x is 0 or inf anyway
            n = mx.round(t)
            f = t - n
            p = POLY[0]
            for c in POLY[1:]:
                p = p * f + c
            return p * mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
        _exp = mx.compile(exp)
    return _exp


def exp(x):
    """e^x for a float32 array, within float32 rounding of ``mx.exp``."""
    return _compiled_exp()(x)


def wanted() -> bool:
    """Whether this process's prompt chunks use :func:`attention` (a CPU, not turned off)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu and os.environ.get("KVFERRY_CPU_ATTENTION", "") != "mlx"


def applies(queries, keys, cache, mask, sinks) -> bool:
    """Whether :func:`attention` computes this call exactly as MLX's would (up to
    rounding): a prompt chunk, float32, no sinks or quantized cache, a mask that
    does not differ between a KV head's query heads."""
    import mlx.core as mx

    if queries.shape[2] < 2 or queries.dtype != mx.float32 or keys.dtype != mx.float32:
        return False
    if sinks is not None or hasattr(cache, "bits"):
        return False
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    return mask.ndim <= 2 or (mask.ndim == 4 and mask.shape[1] == 1)


def attention(queries, keys, values, scale: float, mask):
    """Softmax(q·kᵀ·scale + mask)·v with :func:`exp`; grouped-query heads share their
    KV head's scores' pass. Shapes as ``mx.fast.scaled_dot_product_attention``."""
    import mlx.core as mx

    b, h, n, d = queries.shape
    kh, s = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(b, kh, h // kh, n, d)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # (b, kh, h/kh, n, s)
    if isinstance(mask, str):  # "causal": the chunk's queries are the last n of the s keys
        mask = (mx.arange(n)[:, None] + (s - n)) >= mx.arange(s)[None]
    if mask is not None:
        if mask.ndim == 4:
            mask = mask[:, :, None]  # (b, 1, 1, n, s): the same for every head
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    e = exp(scores - scores.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return (p @ values[:, :, None]).reshape(b, h, n, values.shape[-1])
