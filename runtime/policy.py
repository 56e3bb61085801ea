"""A host's limits: what any one client, session or checkpoint may ask of it.

One :class:`HostPolicy` per host (``kvferry serve`` flags). It is applied where a
session is born, however it comes (create, restore, migration landing), so a
checkpoint cannot choose its own sandbox and a client cannot choose a bigger
one. Every default is listed in ``docs/security.md``. Pure Python: a client may
import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .errors import ConfigError


def machine_memory() -> int:
    """Physical memory of this machine, in bytes (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


SPECULATE = {"auto": None, "on": True, "off": False}  # --speculate -> HostPolicy.speculate
BATCH_KV = {"auto": None, "shared": True, "per-session": False}  # --batch-kv -> HostPolicy.shared_kv
GUEST_THREAD = {"auto": None, "step": True, "session": False}  # --guest-thread -> HostPolicy.drive_guests
PREFILL_THREAD = {"auto": None, "on": True, "off": False}  # --prefill-thread -> HostPolicy.prefill_thread
# --max-batch by device. A CPU's decode step grows with its rows (it reads the weights
# once, but attention and the guests' work scale), and 8 rows already reach mlx-lm's
# batch speed there. A GPU's step is launch-bound: on the H200, 64 sessions under a
# limit of 32 ran as two waves of 32 rows (923-967 tok/s) where one wave of 64 gave 1,266.
MAX_BATCH = {"cpu": 32, "gpu": 128}


@dataclass(frozen=True)
class HostPolicy:
    max_sessions: int = 256  # sessions held at once (created, restored or landed)
    session_ttl_s: float = 3600.0  # idle seconds before a session is closed (0: never)
    max_deadline_ms: float = 5000.0  # guest time per call, at most
    max_guest_bytes: int = 64 << 20  # a guest's memory cap, at most
    max_tokens: int = 4096  # one reply, at most
    max_message_bytes: int = 1 << 20  # one message's text, at most (checked before tokenizing)
    max_modules: int = 16  # compiled guest modules kept (least recently used dropped)
    unread_grace_s: float = 30.0  # a landed turn nobody reads stops generating after this
    max_concurrent_rpcs: int = 256  # calls served at once; beyond, gRPC answers RESOURCE_EXHAUSTED
    calls_per_key: int = 16  # calls one client key may have in flight (admin and peer keys: no limit)
    stream_idle_s: float = 300.0  # a follower stream with nothing to send ends after this
    kv_budget_bytes: int = 0  # KV the host may hold (restores, landings); 0: half the machine's memory
    max_batch: int | None = None  # replies generated at once (one decode batch; None: MAX_BATCH by device);
    # more wait in a FIFO queue
    max_queue: int = 256  # replies waiting for a place; beyond, RESOURCE_EXHAUSTED
    guest_step_ms: float = 20.0  # a guest's own time in one step, at most; a step waits no longer for it
    step_tokens: int = 0  # prompt tokens a step adds beside its decodes (0: adaptive, ~half a decode step)
    speculate: bool | None = None  # queue the greedy next step before waiting for this one (None: on a GPU)
    shared_kv: bool | None = None  # decode rows' KV in one buffer per layer (kvferry.resident; None: on)
    drive_guests: bool | None = None  # decode steps call the guests on the step thread (None: on a GPU)
    prefill_thread: bool | None = None  # long prompts beside decodes prefilled on their own thread (None: on a GPU)
    prefix_cache_bytes: int = 64_000_000  # recent prompts' KV that new sessions start from (0: off)
    stream_interval: int = 1  # tokens a streamed chunk carries at most (the first always alone; vLLM's)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_guest_bytes", "max_tokens", "max_message_bytes", "max_modules",
                     "max_concurrent_rpcs", "calls_per_key", "max_batch", "max_queue", "stream_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        for name in ("session_ttl_s", "unread_grace_s", "stream_idle_s", "kv_budget_bytes", "step_tokens",
                     "prefix_cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)}")
        if not self.guest_step_ms > 0:
            raise ConfigError(f"--guest-step-ms must be > 0, not {self.guest_step_ms}")
        if not self.max_deadline_ms > 0:
            raise ConfigError(f"--max-deadline-ms must be > 0, not {self.max_deadline_ms}")
        if not self.kv_budget_bytes:
            object.__setattr__(self, "kv_budget_bytes", machine_memory() // 2)

    def check(self, sampling, options) -> None:
        """A client's request: refused, in one line, when it asks past a limit."""
        if sampling.max_tokens > self.max_tokens:
            raise ConfigError(f"max_tokens {sampling.max_tokens} is over this host's limit of {self.max_tokens}")
        if options.deadline_ms > self.max_deadline_ms:
            raise ConfigError(f"deadline_ms {options.deadline_ms:g} is over this host's limit of "
                              f"{self.max_deadline_ms:g}")
        if options.memory_cap > self.max_guest_bytes:
            raise ConfigError(f"guest memory cap {options.memory_cap} bytes is over this host's limit of "
                              f"{self.max_guest_bytes}")

    def clamp(self, sampling, options):
        """A session arriving from elsewhere (a checkpoint, a peer): held to this host's limits."""
        return (replace(sampling, max_tokens=min(sampling.max_tokens, self.max_tokens)),
                replace(options, deadline_ms=min(options.deadline_ms, self.max_deadline_ms),
                        memory_cap=min(options.memory_cap, self.max_guest_bytes)))


