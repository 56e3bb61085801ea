"""Ray glue: start a loopback-bound local Ray and host a model in an actor.

A ``ModelHost`` actor loads its model once and streams chat replies back with
Ray's streaming generators (``num_returns="streaming"``).
"""

from __future__ import annotations

import os
from typing import Iterator

from . import blas


def warmup(lm) -> None:
    """One tiny generation so the first user request does not pay for kernel JIT."""
    from .chat import stream_chat

    for _ in stream_chat(lm, [{"role": "user", "content": "hi"}], max_tokens=2):
        pass


def init_local(address: str | None = None) -> None:
    """Connect to ``address``/``$RAY_ADDRESS`` or start an in-process local Ray on 127.0.0.1."""
    from .cluster import init_ray

    init_ray(address)


def _model_host_cls():
    import ray

    @ray.remote(num_cpus=1)
    class ModelHost:
        def __init__(self, model: str | None, dtype: str = "auto"):
            import runtime  # noqa: F401  (optimized BLAS before MLX)
            from .host import ModelHost

            self.host = ModelHost(model, dtype=dtype, progress=False)
            self.lm = self.host.lm
            warmup(self.lm)

        def info(self) -> dict:
            from . import blas as b
            return {"model": self.lm.name, "dtype": self.lm.dtype, "blas": b.status()["kind"],
                    "pid": os.getpid()}

        def chat(self, text: str, max_tokens: int = 128, temp: float = 0.0,
                 seed: int = 0) -> Iterator[dict]:
            """One user turn of the actor's conversation, driven by the chat guest."""
            from .session import SamplingParams

            if not hasattr(self, "session"):
                self.session = self.host.create_session(
                    sampling=SamplingParams(temperature=temp, seed=seed, max_tokens=max_tokens))
            for ev in self.session.send(text):
                st = self.session.last
                yield {"text": ev.text, "token": ev.token, "finish_reason": ev.finish_reason,
                       "generation_tps": st.generation_tps if ev.finish_reason else 0.0,
                       "generation_tokens": st.generation_tokens if ev.finish_reason else ev.index + 1}

    return ModelHost


def model_host(model: str | None = None, dtype: str = "auto"):
    return _model_host_cls().remote(model, dtype)
