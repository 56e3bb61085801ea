"""What a caller chooses for a session: sampling and options, with their one set of
defaults. The CLI, the server and the SDK all read these (pure Python: a client
imports it for free)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

KV_BITS = (2, 3, 4, 5, 6, 8)
MAX_STOPS, MAX_STOP_BYTES = 4, 64


class _Params:
    @classmethod
    def defaults(cls) -> dict:
        return asdict(cls())

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass
class SamplingParams(_Params):
    """How the guest picks tokens (sent to it through ``kvferry_chat_config``)."""
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        from .errors import ConfigError

        if not (self.temperature >= 0):
            raise ConfigError(f"--temp {self.temperature}: must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens {self.max_tokens}: must be >= 1")
        if not 0 <= self.seed < 2**64:
            raise ConfigError(f"--seed {self.seed}: must be in 0..2^64-1")
        if len(self.stop) > MAX_STOPS:
            raise ConfigError(f"{len(self.stop)} stop strings: at most {MAX_STOPS}")
        for s in self.stop:
            if not 1 <= len(s.encode()) <= MAX_STOP_BYTES:
                raise ConfigError(f"stop string {s!r}: must be 1..{MAX_STOP_BYTES} bytes")
        return self


@dataclass
class SessionOptions(_Params):
    """Per-session limits and cache layout."""
    ctx: int | None = None  # maximum context (RotatingKVCache); None: the model's
    # prompt chunk size, like llama.cpp -b; each chunk holds the host's compute lock, so
    # other sessions wait at most one chunk (128 prefills as fast as 512 on a 2-core CPU)
    prefill_step: int = 128
    kv_bits: int | None = None  # QuantizedKVCache bits
    kv_group_size: int = 64
    deadline_ms: float = 5000.0  # guest time per step
    memory_cap: int = 16 << 20  # guest arena cap

    def validate(self, model_context: int) -> "SessionOptions":
        from .errors import ConfigError

        if self.ctx is not None and not 16 <= self.ctx <= model_context:
            raise ConfigError(f"--ctx {self.ctx}: must be in 16..{model_context} (the model's context)")
        if self.prefill_step < 1:
            raise ConfigError(f"--prefill-step {self.prefill_step}: must be >= 1")
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise ConfigError(f"--kv-bits {self.kv_bits}: choose from {', '.join(map(str, KV_BITS))}")
        if self.kv_bits is not None and self.ctx is not None:
            raise ConfigError("--kv-bits cannot be combined with --ctx: mlx-lm has no quantized "
                              "rotating KV cache")
        if self.kv_group_size not in (32, 64, 128):
            raise ConfigError(f"kv group size {self.kv_group_size}: choose from 32, 64, 128")
        if self.deadline_ms <= 0:
            raise ConfigError(f"deadline {self.deadline_ms} ms: must be > 0")
        return self


SAMPLING = SamplingParams()
OPTIONS = SessionOptions()

MIGRATE_MODES = ("auto", "raw", "lossless", "int8", "int4")
DRAIN_TIMEOUT = 45.0  # s: inside systemd's default 90 s stop timeout (and the units' own), with Ray's shutdown after
MIGRATE_DEFAULTS = {"mode": "auto", "live": True, "rate_mb_s": 0.0, "allow_lossy": False, "lane": True}
