"""Rebuild a session from checkpoint frames.

A :class:`Restorer` verifies and applies frames as they arrive (KV straight into
the layer caches, :mod:`kvferry.checkpoint.kv_landing`, so a streamed live
migration has nothing left to assemble at commit) and builds the session only
after the trailer checks out; the caller registers it (``ModelHost.adopt``), so
a failed restore never leaves half a session behind. Every size is checked against the model before it is allocated.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Iterable

import numpy as np

from ..errors import GuestError, SessionExistsError
from ..guest import MemoryImage
from ..params import SamplingParams, SessionOptions
from ..session import Session, SessionState, make_guest
from . import codecs, step_ahead
from .errors import CheckpointError, CheckpointModelError
from .frames import GUEST, HEADER, KV, STATE, TRAILER, Frame, iter_frames, read_file_chunks
from .kv_landing import MAX_TOKENS, KVLanding
from .mlxbits import mx_from_bits, oom

PAGE = 65536
MAX_GUEST_BYTES = 4 << 30


def _release(host: Any, charged: list) -> None:
    if charged[0]:
        with host.lock:
            host.kv_reserved -= charged[0]
            charged[0] = 0


class Restorer(KVLanding):
    """Applies verified frames; :meth:`commit` creates the session on ``host``."""

    def __init__(self, host: Any, *, expect_guest_sha: str | None = None,
                 session_id: str | None = None, owner: str | None = None):
        """``owner``: whose the session is (None: the checkpoint's word, for a peer or a drain)."""
        self.host = host
        self.owner = owner
        self.expect_guest_sha = expect_guest_sha
        self.session_id = session_id
        self.header: dict | None = None
        self.chunks: list[list[tuple[int, int, Any]]] = []
        self.whole: dict[int, dict] = {}
        self.state: dict | None = None
        self.guest: dict | None = None
        self.done = False
        self.frames = 0
        self.caches: list = []
        self.lock = getattr(host, "compute", None) or threading.Lock()
        self.borrowed = False  # the KV frame being applied holds views of a buffer its caller reuses
        self.kv_bytes = 0  # KV received so far
        self.reserved = 0  # cache room allocated (tokens received and to come)
        self._charged = [0]  # reserved in the host's count (ModelHost.kv_reserved)
        self._views: dict = {}  # layer -> its room, as KVLanding._dma writes it
        self._guest = None  # the session's guest, instantiated at the header (see _guest_ahead)
        weakref.finalize(self, _release, host, self._charged)  # an abandoned restore gives it back too

    def apply(self, f: Frame) -> None:
        self.frames += 1
        where = f.name
        if not isinstance(f.body, dict):
            raise CheckpointError(f"{where}: body is not a map")
        if f.kind == HEADER:
            self._header(f.body, where)
        elif self.header is None:
            raise CheckpointError(f"{where}: arrives before the header")
        elif f.kind == KV:
            self.borrowed = f.borrowed  # its payloads are views of the caller's buffer: what is kept is copied
            batch = f.body.get("batch")
            if batch is None:
                self._kv(f.body, where)
            elif not (isinstance(batch, list) and 0 < len(batch) <= len(self.chunks)
                      and all(isinstance(b, dict) and "batch" not in b for b in batch)):
                raise CheckpointError(f"{where}: malformed KV batch")
            else:  # a final delta: one hold of the lock and one evaluation for all layers
                import mlx.core as mx

                pending: list = []
                with self.lock:
                    for j, b in enumerate(batch):
                        self._kv(b, f"{where} entry {j}", pending)
                    with oom(where):
                        mx.eval(pending)
        elif f.kind == STATE:
            self.state = f.body
        elif f.kind == GUEST:
            self.guest = f.body
        elif f.kind == TRAILER:
            self.done = True

    def release(self) -> None:
        """Give back this restore's reservation (its session, once adopted, counts as held KV)."""
        _release(self.host, self._charged)
        if self._guest is not None:  # made ahead and not taken
            self._guest.close()
            self._guest = None

    def _guest_ahead(self, h: dict) -> None:
        """Instantiate the session's guest now, from the module this host already has
        (by the header's hash), so the commit of a migration (the session's pause)
        only loads its memory: instantiating took 4-8 ms of every handoff."""
        find = getattr(self.host, "cached_module", None)
        gm = find((h.get("guest") or {}).get("sha256")) if find else None
        if gm is None or gm.kind != "chat":
            return
        try:
            _, opts = self.host.policy.clamp(SamplingParams(), SessionOptions(**h["session"]["options"]))
            self._guest = make_guest(self.host, gm, opts, self.session_id or h["session"].get("id"))
        except Exception:  # noqa: BLE001 - only a head start: the commit builds it and reports
            self._guest = None

    def _header(self, h: dict, where: str) -> None:
        if self.header is not None:
            raise CheckpointError(f"{where}: a second header")
        if h.get("format") != 1:
            raise CheckpointError(f"{where}: unknown checkpoint format version {h.get('format')!r}")
        lm = self.host.lm
        model = h.get("model") or {}
        if model.get("fingerprint") != lm.fingerprint:
            raise CheckpointModelError(
                f"{where}: checkpoint is for model '{model.get('name')}' (fingerprint "
                f"{str(model.get('fingerprint'))[:12]}…), this host serves '{lm.name}' "
                f"({lm.fingerprint[:12]}…)")
        guest = h.get("guest") or {}
        if self.expect_guest_sha and guest.get("sha256") != self.expect_guest_sha:
            raise CheckpointError(f"{where}: checkpoint was made with guest '{guest.get('label')}' "
                                  f"(sha256 {str(guest.get('sha256'))[:12]}…), not the requested guest")
        cache = h.get("cache") or {}
        n = len(lm.model.layers)
        if cache.get("layers") != n or cache.get("class") not in ("KVCache", "RotatingKVCache",
                                                                  "QuantizedKVCache"):
            raise CheckpointError(f"{where}: cache of {cache.get('layers')} layers of "
                                  f"{cache.get('class')!r} does not fit this model ({n} layers)")
        self.kv_heads, self.head_dim = lm.kv_heads, lm.head_dim
        self.kv_dtype = lm.dtype  # float KV lands in the dtype this host computes in (cast_bits)
        self.context = int(lm.config.get("max_position_embeddings") or 4096)
        if (cache.get("kv_heads"), cache.get("head_dim")) != (self.kv_heads, self.head_dim):
            raise CheckpointError(f"{where}: KV of {cache.get('kv_heads')} heads x {cache.get('head_dim')} "
                                  f"does not fit this model ({self.kv_heads} x {self.head_dim})")
        session = h.get("session")
        if not isinstance(session, dict) or not isinstance(session.get("options"), dict):
            raise CheckpointError(f"{where}: malformed session record")
        if unknown := sorted(set(map(str, session["options"])) - set(SessionOptions.names())):
            raise CheckpointError(f"{where}: unknown session option {unknown[0]!r}")
        self.header = h
        self.chunks = [[] for _ in range(n)]
        if cache.get("class") == "KVCache":
            from mlx_lm.models.cache import KVCache

            self.caches = [KVCache() for _ in range(n)]
        self._guest_ahead(h)

    def commit(self) -> Session:
        """Build the session from everything applied (not registered: the caller
        adopts it, e.g. a migration only at its commit)."""
        import mlx.core as mx
        from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

        if not self.done:
            raise CheckpointError("truncated: no verified trailer")
        self._views.clear()  # the rooms' host views: none may outlive the landing
        if self.state is None or self.guest is None:
            raise CheckpointError("checkpoint lacks its state or guest frame")
        h, st, g = self.header, self.state, self.guest
        n_tokens = st.get("n_tokens")
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= MAX_TOKENS:
            raise CheckpointError("state frame: bad token count")
        history = np.frombuffer(codecs.decode_bytes(st.get("history"), "state frame history",
                                                    4 * MAX_TOKENS), dtype=np.int32)
        if history.size != n_tokens:
            raise CheckpointError(f"state frame: history has {history.size} tokens, header says {n_tokens}")
        vocab = self.host.lm.config["vocab_size"]
        if history.size and (history.min() < 0 or history.max() >= vocab):
            raise CheckpointError("state frame: history holds token ids outside the vocabulary")
        # caches, from the states the frames carried
        kind = h["cache"]["class"]
        caches = []
        for i, chunks in enumerate(self.chunks):
            if kind == "RotatingKVCache":
                w = self.whole.get(i)
                if w is None:
                    raise CheckpointError(f"layer {i}: no KV frame")
                if w.get("keys") is not None:
                    keep, max_size, offset, idx = w["meta"]
                    if max_size != h["session"]["options"].get("ctx") or not 0 < max_size <= self.context:
                        raise CheckpointError(f"layer {i}: rotating cache of {max_size} tokens does not match the "
                                              f"session's context ({h['session']['options'].get('ctx')})")
                    c = RotatingKVCache.from_state((mx_from_bits(*w["_k"]), mx_from_bits(*w["_v"]),
                                                    offset, keep, max_size, idx))
                else:
                    c = RotatingKVCache(max_size=int(h["session"]["options"].get("ctx") or 0) or 1, keep=4)
                caches.append(c)
                continue
            chunks.sort(key=lambda x: x[0])
            at = 0
            for t0, t1, _ in chunks:
                if t0 != at:
                    raise CheckpointError(f"layer {i}: KV token ranges have a gap or overlap at {at}")
                at = t1
            if at != n_tokens:
                raise CheckpointError(f"layer {i}: KV covers {at} tokens, the history has {n_tokens}")
            if kind == "KVCache":
                c = self.caches[i]  # assembled as the frames arrived
            elif chunks:
                meta = chunks[0][2][2]

                def cat(side: int) -> tuple:
                    return tuple(mx.concatenate([mx_from_bits(*p[1][side][j]) for _, _, p in chunks], axis=2)
                                 for j in range(3))
                c = QuantizedKVCache.from_state((cat(0), cat(1), n_tokens, int(meta.get("group_size", 64)),
                                                 int(meta.get("bits", 8))))
            else:
                c = QuantizedKVCache()
            caches.append(c)
        mx.eval([c.state[:2] for c in caches if not c.empty()])
        # guest
        module_bytes = codecs.decode_bytes(g.get("module"), "guest frame module", 64 << 20)
        gm = self.host.engine.compile(module_bytes, str(g.get("label", "guest.wasm")))
        if gm.sha256 != g.get("sha256") or gm.sha256 != h["guest"]["sha256"]:
            raise CheckpointError("guest frame: module bytes do not match the recorded hash")
        if gm.kind != "chat":
            raise CheckpointError(f"guest frame: {gm.label} is not a chat guest")
        size = g.get("memory_size")
        if not isinstance(size, int) or size % PAGE or not 0 < size <= MAX_GUEST_BYTES:
            raise CheckpointError(f"guest frame: bad memory size {size!r}")
        pages = np.frombuffer(g.get("pages") or b"", dtype=np.uint32)
        if pages.size and (pages.max() >= size // PAGE or np.any(np.diff(pages.astype(np.int64)) <= 0)):
            raise CheckpointError("guest frame: page table out of range")
        data = codecs.decode_bytes(g["data"], "guest frame data", size) if pages.size else b""
        if len(data) != pages.size * PAGE:
            raise CheckpointError("guest frame: page data does not match the page table")
        globals_ = g.get("globals") or {}
        if not isinstance(globals_, dict):
            raise CheckpointError("guest frame: malformed globals")
        turn = st.get("turn")
        if turn is not None:
            if not isinstance(turn, dict):
                raise CheckpointError("state frame: malformed turn in progress")
            toks, texts = turn.get("tokens"), turn.get("texts")
            if not (isinstance(toks, list) and isinstance(texts, list) and len(toks) == len(texts)
                    and all(isinstance(t, int) and 0 <= t < vocab for t in toks)
                    and all(isinstance(t, str) for t in texts)
                    and isinstance(turn.get("max_tokens", 0), int) and turn.get("max_tokens", 0) >= 0):
                raise CheckpointError("state frame: malformed turn in progress")
            turn = {"n_prompt": int(turn.get("n_prompt", 0)), "record": bool(turn.get("record", True)),
                    "tokens": toks, "texts": texts, "max_tokens": turn.get("max_tokens", 0)}
        sampling = st.get("sampling", {})
        if not isinstance(sampling, dict):
            raise CheckpointError("state frame: malformed sampling")
        if unknown := sorted(set(map(str, sampling)) - set(SamplingParams.names())):
            raise CheckpointError(f"state frame: unknown sampling parameter {unknown[0]!r}")
        ahead = (step_ahead.land(st.get("ahead"), caches, n_tokens, turn, self.kv_dtype, self.lock, self._declared)
                 if kind == "KVCache" else None)
        try:
            s = self._session(h, st, sampling, caches, history, turn, gm, size, pages, data, globals_)
        except (TypeError, ValueError) as e:  # a field of the wrong type: the file's fault
            raise CheckpointError(f"checkpoint session record is malformed ({type(e).__name__}: {e})") from None
        s.landed_step = ahead  # its first step here takes them (kvferry.speculation)
        return s

    def _session(self, h, st, sampling, caches, history, turn, gm, size, pages, data, globals_) -> Session:
        state = SessionState(
            id=self.session_id or h["session"]["id"],
            sampling=SamplingParams(**{**sampling, "stop": tuple(sampling.get("stop", ()))}),
            options=SessionOptions(**h["session"]["options"]), context=h["session"].get("context", 0),
            caches=caches, history=history.tolist(), messages=list(st.get("messages") or []), turn=turn,
            module=gm, memory=MemoryImage(size, pages, data, globals_),
            owner=self.owner if self.owner is not None else str(h["session"].get("owner") or ""))
        guest, self._guest = self._guest, None
        try:
            return Session.from_state(self.host, state, guest=guest)
        except GuestError as e:
            raise CheckpointError(f"guest frame: {e}") from None


def restore(host: Any, chunks: Iterable[bytes], **kw) -> Session:
    """Restore and register a session on ``host`` (a ModelHost) from checkpoint bytes."""
    r = Restorer(host, **kw)
    try:
        for f in iter_frames(chunks):
            r.apply(f)
        return host.adopt(r.commit())
    except SessionExistsError as e:
        raise CheckpointError(str(e)) from None
    finally:
        r.release()


def load(host: Any, path: str | os.PathLike, **kw) -> Session:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from None
    with f:
        return restore(host, read_file_chunks(f), **kw)
