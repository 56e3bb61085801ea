"""Plain chat generation on a loaded model (mlx-lm's generator, no guest).

This is the foundation path the demo and benchmarks use as the baseline; guest-
driven sessions (``kvferry.session``) replace it as the runtime's main path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .models import LoadedModel


@dataclass
class Chunk:
    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    finish_reason: str | None


def chat_prompt(lm: LoadedModel, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's own chat template."""
    return list(lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def stream_chat(lm: LoadedModel, messages: list[dict], *, max_tokens: int = 128,
                temp: float = 0.0, seed: int = 0) -> Iterator[Chunk]:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    prompt = chat_prompt(lm, messages)
    for r in stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=max_tokens,
                             sampler=make_sampler(temp=temp)):
        yield Chunk(r.text, r.token, r.prompt_tokens, r.prompt_tps, r.generation_tokens,
                    r.generation_tps, r.finish_reason)
