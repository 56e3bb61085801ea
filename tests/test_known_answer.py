"""The real SmolLM2 model answers a factual question (greedy, chat template)."""

import pytest

from kvferry.chat import stream_chat


@pytest.mark.parametrize("question,word", [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
])
def test_capital(smollm, question, word):
    reply = "".join(c.text for c in stream_chat(
        smollm, [{"role": "user", "content": question}], max_tokens=24, temp=0.0))
    assert word in reply, reply


def test_fast_path_is_default_on_cpu(smollm):
    import mlx.core as mx

    from kvferry import blas

    assert smollm.dtype == "float32"
    assert smollm.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    assert blas.status()["kind"] != "reference"
