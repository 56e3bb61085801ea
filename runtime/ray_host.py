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


def init_local(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Connect to ``address``/``$RAY_ADDRESS`` or start an in-process local Ray on 127.0.0.1."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env = {"env_vars": blas.worker_env()}
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus,
                 runtime_env=env, log_to_driver=True, configure_logging=False)


def _model_host_cls():
    import ray

    @ray.remote(num_cpus=1)
    class ModelHost:
        def __init__(self, model: str | None, dtype: str = "auto"):
            import runtime  # noqa: F401  (optimized BLAS before MLX)
            from .models import load

            self.lm = load(model, dtype=dtype, progress=False)
            warmup(self.lm)

        def info(self) -> dict:
            from . import blas as b
            return {"model": self.lm.name, "dtype": self.lm.dtype, "blas": b.status()["kind"],
                    "pid": os.getpid()}

        def chat(self, messages: list[dict], max_tokens: int = 128, temp: float = 0.0,
                 seed: int = 0) -> Iterator[dict]:
            from .chat import stream_chat

            for c in stream_chat(self.lm, messages, max_tokens=max_tokens, temp=temp, seed=seed):
                yield {"text": c.text, "token": c.token, "finish_reason": c.finish_reason,
                       "prompt_tps": c.prompt_tps, "generation_tps": c.generation_tps,
                       "generation_tokens": c.generation_tokens}

    return ModelHost


def model_host(model: str | None = None, dtype: str = "auto"):
    return _model_host_cls().remote(model, dtype)
