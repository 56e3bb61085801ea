"""A model host: one loaded model, one guest engine, many sessions.

This is the in-process core that a Ray ``SessionHost`` actor wraps. Creating a
session never reloads weights; each session reports its own KV and arena bytes.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

from .abi import V1
from .admission import Admission
from .batching import StepScheduler
from .prefix_cache import PrefixCache
from .errors import ConfigError, GuestError, HostFullError, SessionExistsError, UnknownSessionError
from .guest import GuestEngine, GuestModule
from .guests import GUESTS_DIR
from .collector import PauseClock
from .metrics import HostMetrics
from .device import current
from .models import LoadedModel, load
from .params import SamplingParams, SessionOptions
from .policy import MAX_BATCH, HostPolicy
from .session import Session

DEFAULT_GUEST = GUESTS_DIR / "chat.wasm"
WARM_GATHER_S = 1.0  # how long a warm-up step waits for its round's prompts at most


def warmup(lm: LoadedModel) -> None:
    """One tiny generation so the first user request does not pay for kernel JIT."""
    from .chat import stream_chat

    for _ in stream_chat(lm, [{"role": "user", "content": "hi"}], max_tokens=2):
        pass


def apply_placement(model, attn_cpu: float, has_gpu: bool) -> dict:
    """Seed 003's hybrid placement: attention of the first ``attn_cpu`` fraction of
    layers on the CPU stream, everything else on the GPU stream.

    On a machine without a GPU the policy is accepted and reported as a no-op.
    """
    import mlx.core as mx
    import mlx.nn as nn

    if not 0.0 <= attn_cpu <= 1.0:
        raise ConfigError(f"--attn-cpu {attn_cpu}: must be a fraction in [0, 1]")
    layers = model.layers
    n = round(attn_cpu * len(layers))
    report = {"attn_cpu": attn_cpu, "layers": len(layers), "attention_layers_on_cpu": n,
              "gpu": has_gpu, "active": bool(has_gpu and n)}
    if not has_gpu:
        report["note"] = "no GPU on this machine: everything runs on the CPU, placement is a no-op"
        return report

    class OnDevice(nn.Module):
        # A device, not a stream: MLX streams belong to the thread that made them, and
        # the step scheduler runs the model on its own thread.
        def __init__(self, inner, device):
            super().__init__()
            self.inner = inner
            self._device = device

        def __call__(self, *args, **kwargs):
            with mx.stream(self._device):
                return self.inner(*args, **kwargs)

    for layer in layers[:n]:
        layer.self_attn = OnDevice(layer.self_attn, mx.cpu)
    return report


class FairLock:
    """A first-come, first-served lock: a session prefilling a long prompt chunk by
    chunk lets the sessions already waiting run their step between two chunks
    (a plain Lock would hand itself straight back to the thread that released it)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._next = self._serving = 0

    def acquire(self) -> bool:
        with self._cv:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cv.wait()
        return True

    def release(self) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ModelHost:
    """Hosts sessions on one model (loaded once)."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", attn_cpu: float = 0.0,
                 lm: LoadedModel | None = None, progress: bool = True, max_kv_bytes: int | None = None,
                 policy: HostPolicy | None = None):
        self.lm = lm or load(model, dtype=dtype, progress=progress)
        self.device = current()
        self.policy = policy or HostPolicy()
        self.placement = apply_placement(self.lm.model, attn_cpu, self.device.is_gpu)
        _ = self.lm.fingerprint  # hash the model files now, not in the middle of a migration
        self.engine = GuestEngine(V1)
        self.engine.max_modules = max(self.engine.max_modules, self.policy.max_modules)
        self.sessions: dict[str, Session] = {}
        self._modules: dict[str, GuestModule] = {}  # by path, in order of last use
        self._token_bytes: dict[int, bytes] = {}
        self.lock = threading.RLock()
        # MLX work is serialised (host functions take it for each model call; guest code
        # itself runs outside it, so a slow guest slows only its own session)
        self.compute = FairLock()
        self.engine.compute = self.compute
        self.max_kv_bytes = max_kv_bytes or self.policy.kv_budget_bytes  # restored / migrated-in KV
        self.kv_reserved = 0  # KV bytes promised to restores in flight (under self.lock)
        self.metrics = HostMetrics(self)
        # the clock holds the histogram, never the host: an unclosed host can still be
        # collected, and its clock goes with it
        hist = self.metrics.gc_pause
        self.gc_clock = PauseClock(lambda gen, s: hist.labels(str(gen)).observe(s)).install()
        weakref.finalize(self, self.gc_clock.remove)
        p = self.policy
        gpu = self.device.is_gpu
        self.max_batch = p.max_batch or MAX_BATCH["gpu" if gpu else "cpu"]
        self.admission = Admission(self.max_batch, p.max_queue, self.max_kv_bytes, self.kv_bytes)
        self.prefix = PrefixCache(p.prefix_cache_bytes)  # new sessions' shared prompt heads
        drive = gpu if p.drive_guests is None else p.drive_guests
        # the next step queued on the device's greedy guess before this one is waited for
        # (mlx-lm's order): on a GPU the next graph is built while the device runs
        self.steps = StepScheduler(self, max_batch=self.max_batch, guest_step_ms=p.guest_step_ms,
                                   step_tokens=p.step_tokens,
                                   speculate=gpu if p.speculate is None else p.speculate,
                                   # shared rows on every device (auto: None); docs/performance-log.md says why on a CPU
                                   shared_kv=p.shared_kv is not False,
                                   split_prefill=gpu, drive=drive,
                                   prefill_thread=gpu if p.prefill_thread is None else p.prefill_thread)

    def warm(self) -> None:
        """Run, once, every path a reply takes through the step scheduler, so that a GPU
        compiles their kernels now and not in some user's first token (MLX caches them
        on disk, kvferry.device.keep_kernels). On a fresh H100 each path that missed
        this cost its first request 50-73 s (docs/accelerator.md). In turn:

        1. three short replies at once: solo and batched decode steps, rows in order and
           with a gap once the first ends, and their prompts as one burst where the host
           bursts (kvferry.burst);
        2. one prompt longer than a burst takes, alone: the plain prefill path;
        3. eight short prompts of different lengths at once, from the prefix the first
           ones kept: a padded burst written from a kept prefix, and more rows a step.

        A session migrating in mid-reply would pay for a missed kernel in its pause."""
        # (prompt, tokens) a reply; each round's first ends sooner, leaving a gap in the rows
        rounds = ([("hi", 4), ("hi", 8), ("hi", 8)], [(" ".join(["warm"] * 100), 4)],
                  [(" ".join(["up"] * (k + 1)), 4 if k == 0 else 8) for k in range(8)])

        def reply(s: Session, prompt: str) -> None:
            try:
                for _ in s.send(prompt):
                    pass
            finally:
                self.close_session(s.id)
        for replies in rounds:
            sessions = [self.create_session(None, SamplingParams(max_tokens=n, ignore_eos=True)) for _, n in replies]
            # the prompts of a round together: one step takes them all, even where their threads
            # start later than a step's gather window (a loaded machine)
            self.steps.expect_soon(sessions, within_s=WARM_GATHER_S)
            threads = [threading.Thread(target=reply, args=(s, p)) for s, (p, _) in zip(sessions, replies)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def preload(self) -> None:
        """Compile the default guest and import the restore path now, so the first
        session or migration landing on this host does not pay for them (~15 ms)
        while a conversation is paused."""
        from .checkpoint import restore  # noqa: F401

        try:
            self.guest_module(None)
        except GuestError:
            pass  # reported to the first session that asks for it

    def cached_module(self, sha256: str) -> GuestModule | None:
        """A guest module this host has compiled, by hash (None if it has not)."""
        return next((m for m in self._modules.values() if m.sha256 == sha256), None)

    def guest_module(self, guest: str | Path | None) -> GuestModule:
        path = str(guest or DEFAULT_GUEST)
        gm = self._modules.pop(path, None)
        if gm is None:
            gm = self.engine.compile(path)
            if gm.kind != "chat":
                raise GuestError(f"{gm.label}: not a chat guest (it must export kvferry_buffer, "
                                 "kvferry_chat_config, kvferry_chat_begin, kvferry_chat_step)")
        self._modules[path] = gm
        while len(self._modules) > self.policy.max_modules:
            self._modules.pop(next(iter(self._modules)))
        return gm

    def token_bytes(self, token: int) -> bytes:
        """UTF-8 bytes of one token (byte-level BPE tokens decode to raw bytes)."""
        b = self._token_bytes.get(token)
        if b is None:
            tok = self.lm.tokenizer
            piece = tok.convert_ids_to_tokens(int(token))
            try:
                from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
                dec = {v: k for k, v in bytes_to_unicode().items()}
                b = bytes(dec[c] for c in piece) if piece and all(c in dec for c in piece) else None
            except ImportError:
                b = None
            if b is None:
                b = tok.decode([int(token)]).encode()
            self._token_bytes[token] = b
        return b

    def create_session(self, guest: str | Path | None = None, sampling: SamplingParams | None = None,
                       options: SessionOptions | None = None, session_id: str | None = None,
                       owner: str = "") -> Session:
        if session_id in self.sessions:  # fail before building a guest; adopt decides under the lock
            raise SessionExistsError(f"session {session_id} already exists on this host")
        s = Session(self, guest, sampling or SamplingParams(), options or SessionOptions(), session_id)
        s.owner = owner
        return self.adopt(s)

    def adopt(self, session: Session) -> Session:
        """Register a session: the one place a session joins this host (created,
        restored, or landed by a migration). On an id already here the newcomer is
        closed and refused."""
        with self.lock:
            if session.id in self.sessions:
                session.close()
                raise SessionExistsError(f"session {session.id} already exists on this host")
            if len(self.sessions) >= self.policy.max_sessions:
                session.close()
                raise HostFullError(f"this host holds {len(self.sessions)} sessions, its limit "
                                    "(serve --max-sessions); close one or use another host")
            self.sessions[session.id] = session
            return session

    def restore(self, chunks, **kw) -> Session:
        """Restore (and register) a session from checkpoint bytes; see kvferry.checkpoint.restore."""
        from .checkpoint import restore

        return restore.restore(self, chunks, **kw)

    def load(self, path, **kw) -> Session:
        """Restore (and register) a session from a checkpoint file."""
        from .checkpoint import restore

        return restore.load(self, path, **kw)

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown session '{session_id}'") from None

    def detach(self, session_id: str) -> Session:
        """Stop listing a session; it stays usable until closed (a migration frees
        the source's copy only after the target's first token)."""
        with self.lock:
            s = self.get(session_id)
            del self.sessions[session_id]
            return s

    def close_session(self, session_id: str) -> None:
        self.detach(session_id).close()

    def memory(self) -> dict[str, Any]:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        weights = sum(v.nbytes for _, v in tree_flatten(self.lm.model.parameters()))
        return {"weights_bytes": int(weights), "mlx_active_bytes": int(mx.get_active_memory()),
                "sessions": {sid: s.memory() for sid, s in self.sessions.items()}}

    def close(self) -> None:
        for sid in list(self.sessions):
            self.close_session(sid)
        self.steps.close()
        self.engine.close()
        self.gc_clock.remove()

    def kv_bytes(self) -> int:
        """KV cache bytes held by all sessions."""
        with self.lock:
            return sum(s.memory()["kv_bytes"] for s in self.sessions.values() if not s.closed)
