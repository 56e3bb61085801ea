"""kvferry.cpu_attention: a prompt chunk's attention on a CPU with a vectorized exp,
against MLX's own (docs/performance.md, "A long prompt's prefill on a CPU")."""

import mlx.core as mx
import numpy as np
import pytest

from kvferry import cpu_attention


def test_exp_is_within_float32_rounding_of_mlx():
    x = mx.concatenate([mx.linspace(-87.0, 88.0, 200_001), mx.array([0.0, -1e-8, 1e-8, -0.5, 0.5])])
    ref = np.exp(np.array(x, dtype=np.float64))
    err = np.abs(np.array(cpu_attention.exp(x), dtype=np.float64) - ref) / ref
    mlx_err = np.abs(np.array(mx.exp(x), dtype=np.float64) - ref) / ref
    small = np.abs(np.array(x)) <= 10
    assert np.max(err[small]) < 1e-6 and np.max(err[small]) < 1.5 * np.max(mlx_err[small]) + 1e-7
    # far out, a float32 x itself carries ~|x| * 6e-8 of e^x's error: MLX's exp as much
    assert np.max(err) < 1.5 * np.max(mlx_err) and np.max(mlx_err) < 1e-5
    far = np.array(cpu_attention.exp(mx.array([-1e30, -mx.inf, -200.0])))
    assert np.all(far < 1e-37) and np.all(np.isfinite(far))  # no NaN from a masked score


@pytest.mark.parametrize("mask", [None, "causal", "bool2d", "bool4d", "additive"])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_attention_matches_mlx_fast(mask, heads):
    h, kh = heads
    n, s, d = 37, 300, 64
    q, k, v = (mx.random.normal(shape, key=mx.random.key(i)) for i, shape in
               enumerate([(2, h, n, d), (2, kh, s, d), (2, kh, s, d)]))
    causal = (mx.arange(n)[:, None] + (s - n)) >= mx.arange(s)[None]
    m = {"bool2d": causal, "bool4d": mx.broadcast_to(causal, (2, 1, n, s)),
         "additive": mx.where(causal, 0.0, -1e9).astype(mx.float32)}.get(mask, mask)
    assert cpu_attention.applies(q, k, None, m, None)
    got = cpu_attention.attention(q, k, v, d ** -0.5, m)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask=m)
    assert got.shape == ref.shape and mx.abs(got - ref).max().item() < 1e-5


def test_applies_only_where_it_is_exact():
    q, k = mx.zeros((1, 4, 8, 16)), mx.zeros((1, 2, 8, 16))
    assert cpu_attention.applies(q, k, None, "causal", None)
    assert not cpu_attention.applies(q[:, :, :1], k, None, None, None)  # a decode row: MLX's own
    assert not cpu_attention.applies(q.astype(mx.float16), k.astype(mx.float16), None, None, None)
    assert not cpu_attention.applies(q, k, None, None, mx.zeros((4,)))  # attention sinks
    assert not cpu_attention.applies(q, k, None, mx.zeros((1, 4, 8, 8), dtype=mx.bool_), None)  # per-head mask

    class Quantized:
        bits = 4
    assert not cpu_attention.applies(q, k, Quantized(), None, None)


def test_a_long_prompt_through_the_host_attention_gives_mlx_replies(smollm, monkeypatch):
    """SmolLM2 with the host's attention installed: a 400-token prompt is prefilled in
    chunks through cpu_attention, and the greedy reply is MLX's attention's."""
    from mlx_lm.generate import generate_step

    from kvferry import batch_attention

    assert batch_attention.install(smollm.model)
    prompt = mx.array(smollm.tokenizer.encode(" ".join(["The ferry crossed the strait at dawn."] * 45))[:400])
    calls = []
    real = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))

    def reply(fast: bool) -> list[int]:
        monkeypatch.setattr(batch_attention, "_cpu_chunks", fast)
        return [int(t) for t, _ in generate_step(prompt, smollm.model, max_tokens=24, prefill_step_size=128)]
    ours, mlx = reply(True), reply(False)
    # 128 + 128 + 128 + 15 prompt tokens a layer (the last goes in with the first decode step)
    assert set(calls) == {128, 15} and len(calls) == 30 * 4
    assert ours == mlx and len(ours) == 24
