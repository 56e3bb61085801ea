"""Snapshot a live session into frames, and rebuild a session from frames.

Frame order: header, KV frames (token ranges per layer, any number of stages),
state (token history, messages, sampling), guest (memory pages, globals,
module), trailer. A :class:`Snapshotter` can emit the KV of the tokens so far,
later the KV of tokens generated since (deltas), and finally the small state:
that is what live migration streams. A :class:`Restorer` verifies and applies
frames as they arrive but registers the session only after the trailer checks
out, so a failed restore never leaves half a session behind.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from . import codecs
from .errors import CheckpointError, OutOfMemoryError
from .frames import GUEST, HEADER, KV, STATE, TRAILER, Frame, FrameWriter, iter_frames

if TYPE_CHECKING:
    from runtime.host import ModelHost
    from runtime.session import Session

PAGE = 65536
MAX_GUEST_BYTES = 4 << 30
MAX_TOKENS = 1 << 22


def _mx_bits(a) -> tuple[np.ndarray, str]:
    """An MLX array -> (its bits as an unsigned numpy array, dtype name)."""
    import mlx.core as mx

    name = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16",
            mx.uint32: "uint32", mx.int32: "int32", mx.uint8: "uint8"}[a.dtype]
    view = {"float32": mx.uint32, "float16": mx.uint16, "bfloat16": mx.uint16}.get(name)
    return np.array(a.view(view) if view is not None else a), name


def _np_kind(dtype) -> tuple[type, str] | None:
    """(unsigned numpy type, name) to read an MLX dtype's bits through the buffer
    protocol without an MLX op; None where numpy has no such dtype (bfloat16)."""
    import mlx.core as mx

    return {mx.float32: (np.uint32, "float32"), mx.float16: (np.uint16, "float16")}.get(dtype)


def _mx_from_bits(u: np.ndarray, dtype: str):
    import mlx.core as mx

    a = mx.array(u)
    if dtype in ("float32", "float16", "bfloat16"):
        a = a.view(getattr(mx, dtype))
    return a


@contextlib.contextmanager
def _oom(where: str) -> Iterator[None]:
    """MLX reports a failed allocation as RuntimeError: name it."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, MemoryError) or "alloc" in str(e).lower():
            raise OutOfMemoryError(f"{where}: out of memory on this host ({e})") from None
        raise


def _cache_kind(c) -> str:
    return type(c).__name__


class Snapshotter:
    """Emits a session's checkpoint frame by frame."""

    def __init__(self, session: "Session", mode: str = "lossless"):
        if mode not in codecs.MODES:
            raise CheckpointError(f"unknown checkpoint mode '{mode}' (choose from {', '.join(codecs.MODES)})")
        self.s, self.mode = session, mode
        self.w = FrameWriter()
        self.sent_tokens = 0  # KV of tokens [0, sent_tokens) already emitted
        self.raw_kv_bytes = 0
        self.kind = _cache_kind(session.cache[0])
        self.rate = 0.0  # live pre-copy: raw KV bytes per second at most (0 = unpaced)
        self._due = 0.0
        self.epoch = session.kv_epoch

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (sizes pre-copy chunks)."""
        total = 0
        for c in self.s.cache:
            if c.empty():
                continue
            cap = (c.keys[0] if isinstance(c.keys, (list, tuple)) else c.keys).shape[2]
            total += c.nbytes // max(1, cap)
        return total

    @property
    def incremental(self) -> bool:
        return self.kind in ("KVCache", "QuantizedKVCache")

    def header(self) -> bytes:
        import runtime

        s = self.s
        cfg = s.lm.config
        head = {
            "format": 1, "kvferry": runtime.__version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "created_on": socket.gethostname(), "mode": self.mode,
            "model": {"name": s.lm.name, "fingerprint": s.lm.fingerprint, "dtype": s.lm.dtype,
                      "vocab_size": s.vocab_size, "layers": len(s.cache)},
            "guest": {"label": s.guest.module.label, "sha256": s.guest.module.sha256},
            "session": {"id": s.id, "context": s.context, "sampling": _plain(asdict(s.sampling)),
                        "options": _plain(asdict(s.options))},
            "cache": {"class": self.kind, "layers": len(s.cache), "tokens": len(s.history),
                      "kv_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                      "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])},
        }
        return self.w.frame(HEADER, head)

    def extract(self, upto: int | None = None, lock=None, budget: float = 0.002,
                chunk: int | None = None) -> Iterator[tuple]:
        """Copy the KV of tokens [sent_tokens, upto) out of the cache, layer by layer
        (and with ``chunk``, in token ranges of at most that many tokens).

        With ``lock`` (the host's compute lock, for a session that may be
        generating) the copies happen under short holds of about ``budget``
        seconds (at least one piece each): steps only append, so the range stays
        valid between holds. Copies, not views: a view would pin the cache's
        buffer and make every later step copy the whole cache instead of
        updating it in place. Yielded pieces may live in reused scratch memory:
        use each before asking for the next (as :meth:`encode` does)."""
        import mlx.core as mx

        s = self.s
        n = len(s.history) if upto is None else upto
        t0 = self.sent_tokens
        if not self.incremental or n <= t0:
            return
        self.sent_tokens = n
        step = max(1, chunk or n - t0)
        pieces = [(i, a, min(a + step, n)) for i in range(len(s.cache)) for a in range(t0, n, step)]
        if self.kind == "KVCache" and _np_kind(s.cache[0].keys.dtype) is not None:
            yield from self._extract_np(pieces, n, lock, budget)
            return
        j = 0
        while j < len(pieces):
            out = []
            with lock if lock is not None else contextlib.nullcontext():
                start = time.perf_counter()
                while j < len(pieces) and (not out or lock is None or time.perf_counter() - start < budget):
                    i, a, b = pieces[j]
                    c = s.cache[i]
                    if c.offset < n:
                        raise CheckpointError(f"layer {i} cache holds {c.offset} tokens, history has {n}")
                    if self.kind == "KVCache":
                        k, v = c.keys[..., a:b, :], c.values[..., a:b, :]
                        mx.eval(k, v)
                        out.append((i, a, b, _mx_bits(k), _mx_bits(v), None))
                    else:  # QuantizedKVCache: (packed, scales, biases) per side, stored exactly
                        out.append((i, a, b, [_mx_bits(x[..., a:b, :]) for x in c.keys],
                                    [_mx_bits(x[..., a:b, :]) for x in c.values],
                                    {"group_size": c.group_size, "bits": c.bits}))
                    del c
                    j += 1
            yield from out  # encoded outside the hold

    def _extract_np(self, pieces: list[tuple[int, int, int]], n: int, lock, budget: float) -> Iterator[tuple]:
        """:meth:`extract` for float32/float16 ``KVCache``: numpy copies pieces
        straight out of MLX's buffers (no MLX op, so nothing is queued on the
        stream a generating session uses) into scratch memory reused from hold to
        hold, whose pages are already mapped: first-touch faults cost ~2 ms/MB on
        a VM, and inside a hold they would stall the next step. The yielded arrays
        are valid until the next piece is asked for: :meth:`encode` copies them
        into a frame first."""
        per_hold = 8 if lock is not None else 1
        pool: list[np.ndarray] = []  # keys and values scratch for each piece of a hold
        j = 0
        while j < len(pieces):
            c = self.s.cache[pieces[j][0]]
            row = max(a.shape[0] * a.shape[1] * a.shape[3] * a.dtype.size for a in (c.keys, c.values))
            del c
            need = row * max(b - a for _, a, b in pieces[j:j + per_hold])
            if len(pool) < 2 * per_hold or pool[0].nbytes < need:  # sized outside the hold
                pool = [np.zeros(need, np.uint8) for _ in range(2 * per_hold)]
            out = []
            with lock if lock is not None else contextlib.nullcontext():
                start = time.perf_counter()
                while j < len(pieces) and len(out) < per_hold and (not out or time.perf_counter() - start < budget):
                    i, a, b = pieces[j]
                    c = self.s.cache[i]
                    if c.offset < n:
                        raise CheckpointError(f"layer {i} cache holds {c.offset} tokens, history has {n}")
                    sides = []
                    for buf, arr in zip(pool[2 * len(out):], (c.keys, c.values)):
                        u, name = _np_kind(arr.dtype)
                        # a view of MLX's buffer, dropped within the hold: kept, it would
                        # stop the next step updating the cache in place
                        src = np.array(arr, copy=False)[..., a:b, :].view(u)
                        dst = buf[:src.nbytes].view(u).reshape(src.shape)
                        np.copyto(dst, src)
                        sides.append((dst, name))
                        del src
                    del c, arr
                    out.append((i, a, b, sides[0], sides[1], None))
                    j += 1
            yield from out

    def encode(self, extracted: Iterable[tuple], batch: bool = False) -> Iterator[bytes]:
        """KV frames from :meth:`extract`'s copies (no lock needed): one per layer,
        or with ``batch`` one frame for all of them (a small final delta, where
        per-frame costs would dominate)."""
        bodies = []
        for i, t0, n, k, v, meta in extracted:
            raw = self.raw_kv_bytes
            body: dict[str, Any] = {"layer": i, "start": t0, "end": n}
            if meta is None:
                body["keys"] = self._enc(*k, role="keys")
                body["values"] = self._enc(*v)
            else:
                body["keys"] = [self._enc(*x, exact=True) for x in k]
                body["values"] = [self._enc(*x, exact=True) for x in v]
                body["meta"] = meta
            if batch:
                bodies.append(body)
                continue
            frame = self.w.frame(KV, body)
            if self.rate:  # live pre-copy: a steady trickle leaves memory bandwidth to generation
                now = time.perf_counter()
                self._due = max(self._due, now) + (self.raw_kv_bytes - raw) / self.rate
                time.sleep(max(0.0, self._due - now))
            yield frame
        if bodies:
            yield self.w.frame(KV, {"batch": bodies})

    def kv(self, upto: int | None = None, batch: bool = False) -> Iterator[bytes]:
        """KV frames for tokens [sent_tokens, upto) of every layer (a delta)."""
        yield from self.encode(self.extract(upto), batch)

    def _enc(self, u: np.ndarray, dtype: str, exact: bool = False, role: str = "values") -> dict:
        self.raw_kv_bytes += u.nbytes
        return codecs.encode(u, dtype, "lossless" if exact and self.mode != "raw" else self.mode, role)

    def _blob(self, a, exact: bool = False, role: str = "values") -> dict:
        return self._enc(*_mx_bits(a), exact=exact, role=role)

    def finish(self) -> Iterator[bytes]:
        """Remaining KV, then state, guest and trailer."""
        if self.s.kv_epoch != self.epoch and self.sent_tokens:
            raise CheckpointError("the KV cache was rewritten (a new turn trimmed it) after part of "
                                  "it was sent; migrate again")
        # after pre-copy only a few tokens remain: one frame for all layers
        yield from self.kv(batch=0 < len(self.s.history) - self.sent_tokens <= 64 and self.sent_tokens > 0)
        s = self.s
        if not self.incremental:
            for i, c in enumerate(s.cache):
                body: dict[str, Any] = {"layer": i, "start": 0, "end": len(s.history), "whole": True,
                                        "meta": [int(c.keep), int(c.max_size), int(c.offset), int(c._idx)]
                                        if not c.empty() else None}
                if not c.empty():
                    body["keys"] = self._blob(c.keys, role="keys")
                    body["values"] = self._blob(c.values)
                yield self.w.frame(KV, body)
        history = np.asarray(s.history, dtype=np.int32)
        turn = None
        if s.turn is not None:
            turn = {"n_prompt": s.turn.n_prompt, "record": s.turn.record, "tokens": list(s.turn.tokens),
                    "texts": list(s.turn.texts), "max_tokens": s.turn.max_tokens}
        yield self.w.frame(STATE, {
            "n_tokens": len(s.history), "history": codecs.encode_bytes(history.tobytes()),
            "messages": s.messages, "sampling": _plain(asdict(s.sampling)), "turn": turn,
        })
        g = s.guest
        size = g.arena.size
        mem = g.arena.np[:size]
        pages = mem.reshape(-1, PAGE)
        used = np.flatnonzero(pages.any(axis=1)).astype(np.uint32)
        globals_ = {}
        for e in g.module.module.exports:
            if isinstance(e.type, __import__("wasmtime").GlobalType) and e.type.mutable:
                globals_[e.name] = g._exports[e.name].value(g.store)
        yield self.w.frame(GUEST, {
            "sha256": g.module.sha256, "label": g.module.label,
            "module": codecs.encode_bytes(g.module.wasm),
            "memory_size": size, "pages": used.tobytes(),
            "data": codecs.encode_bytes(pages[used].tobytes()) if used.size else None,
            "globals": globals_,
        })
        yield self.w.trailer()


def _plain(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def snapshot(session: "Session", mode: str = "lossless") -> Iterator[bytes]:
    """The whole checkpoint of a session (between steps), as a stream of byte chunks."""
    sn = Snapshotter(session, mode)
    yield sn.header()
    yield from sn.finish()


def save(session: "Session", path: str | os.PathLike, mode: str = "lossless") -> dict:
    """Write a checkpoint file atomically; returns sizes."""
    tmp = f"{path}.tmp{os.getpid()}"
    sn = Snapshotter(session, mode)
    with open(tmp, "wb") as f:
        f.write(sn.header())
        for chunk in sn.finish():
            f.write(chunk)
    os.replace(tmp, path)
    return {"bytes": sn.w.bytes, "raw_kv_bytes": sn.raw_kv_bytes, "frames": sn.w.count + 1}


# ----------------------------------------------------------------------------- restore

class Restorer:
    """Applies verified frames; :meth:`commit` creates the session on ``host``."""

    def __init__(self, host: "ModelHost", *, expect_guest_sha: str | None = None,
                 session_id: str | None = None):
        self.host = host
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
        self.lock = getattr(host, "compute", None) or __import__("threading").Lock()
        self.kv_bytes = 0  # KV received so far
        self.reserved = 0  # cache room allocated (tokens received and to come)

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
                    with _oom(where):
                        mx.eval(pending)
        elif f.kind == STATE:
            self.state = f.body
        elif f.kind == GUEST:
            self.guest = f.body
        elif f.kind == TRAILER:
            self.done = True

    def _admit(self, nbytes: int, where: str, reserve: int = 0) -> None:
        """Refuse KV beyond the host's budget (``serve --max-kv-mb``) before allocating
        it: ``nbytes`` received, ``reserve`` cache room (received or to come)."""
        self.kv_bytes += nbytes
        self.reserved += reserve
        limit = getattr(self.host, "max_kv_bytes", None)
        if limit and (used := self.host.kv_bytes()) + max(self.kv_bytes, self.reserved) > limit:
            raise OutOfMemoryError(
                f"{where}: out of memory on this host: the session's KV needs more than the "
                f"{limit / 1e6:.0f} MB it may use ({used / 1e6:.1f} MB already in use)")

    def _header(self, h: dict, where: str) -> None:
        if self.header is not None:
            raise CheckpointError(f"{where}: a second header")
        if h.get("format") != 1:
            raise CheckpointError(f"{where}: unknown checkpoint format version {h.get('format')!r}")
        lm = self.host.lm
        model = h.get("model") or {}
        if model.get("fingerprint") != lm.fingerprint:
            raise CheckpointError(
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
        self.header = h
        self.chunks = [[] for _ in range(n)]
        if cache.get("class") == "KVCache":
            from mlx_lm.models.cache import KVCache

            self.caches = [KVCache() for _ in range(n)]

    def _kv(self, b: dict, where: str, pending: list | None = None) -> None:
        """Apply one KV body. ``pending``: the caller holds the lock; the updated
        arrays are added to it for one evaluation of a whole batch."""
        i, t0, t1 = b.get("layer"), b.get("start"), b.get("end")
        n = len(self.chunks)
        if not (isinstance(i, int) and 0 <= i < n and isinstance(t0, int) and isinstance(t1, int)
                and 0 <= t0 <= t1 <= MAX_TOKENS):
            raise CheckpointError(f"{where}: bad layer or token range ({i}, {t0}..{t1})")
        cache = self.header["cache"]
        heads, hd = cache["kv_heads"], cache["head_dim"]
        if b.get("whole"):
            if b.get("keys") is not None:
                k = codecs.decode(b["keys"], f"{where} keys")
                v = codecs.decode(b["values"], f"{where} values")
                self._admit(k.nbytes + v.nbytes, where)
                meta = b.get("meta")
                if not (isinstance(meta, list) and len(meta) == 4 and all(isinstance(x, int) for x in meta)):
                    raise CheckpointError(f"{where}: malformed rotating-cache meta state")
                b = {**b, "_k": (k, b["keys"]["dtype"]), "_v": (v, b["values"]["dtype"])}
            self.whole[i] = b
            return
        if cache["class"] == "QuantizedKVCache":
            sides = []
            for side in ("keys", "values"):
                blobs = b.get(side)
                if not isinstance(blobs, list) or len(blobs) != 3:
                    raise CheckpointError(f"{where}: quantized {side} must be 3 tensors")
                arrs = [(codecs.decode(x, f"{where} {side}[{j}]"), x["dtype"]) for j, x in enumerate(blobs)]
                for a, _ in arrs:
                    if a.ndim != 4 or a.shape[1] != heads or a.shape[2] != t1 - t0:
                        raise CheckpointError(f"{where}: {side} shape {list(a.shape)} does not fit "
                                              f"{heads} heads x {t1 - t0} tokens")
                sides.append(arrs)
                self._admit(sum(a.nbytes for a, _ in arrs), where)
            meta = b.get("meta") or {}
            self.chunks[i].append((t0, t1, ("q", sides, meta)))
            return
        k = codecs.decode(b.get("keys"), f"{where} keys")
        v = codecs.decode(b.get("values"), f"{where} values")
        for name, a in (("keys", k), ("values", v)):
            if a.ndim != 4 or a.shape[1] != heads or a.shape[2] != t1 - t0 or a.shape[3] != hd:
                raise CheckpointError(f"{where}: {name} shape {list(a.shape)} does not fit "
                                      f"[1, {heads}, {t1 - t0}, {hd}]")
        # Append straight into the layer's cache as frames arrive, so a streamed
        # (live) restore has nothing left to assemble at commit time.
        c = self.caches[i]
        if t0 != c.offset:
            raise CheckpointError(f"{where}: token range {t0}..{t1} does not continue layer {i} "
                                  f"(it holds {c.offset} tokens)")
        import mlx.core as mx

        self._admit(k.nbytes + v.nbytes, where)
        with _oom(where), self.lock if pending is None else contextlib.nullcontext():
            self._reserve(c, t1, k.shape, b["keys"]["dtype"], v.shape, b["values"]["dtype"], where)
            c.update_and_fetch(_mx_from_bits(k, b["keys"]["dtype"]), _mx_from_bits(v, b["values"]["dtype"]))
            if pending is None:
                mx.eval(c.keys, c.values)
            else:
                pending += [c.keys, c.values]
        self.chunks[i].append((t0, t1, None))

    def _reserve(self, c, t1: int, kshape, kdtype: str, vshape, vdtype: str, where: str) -> None:
        """Grow a layer's cache ahead of token ``t1``, once, to the token count the
        header announces (never past the session's context; charged to the KV
        budget), so a chunked stream appends in place instead of re-copying the
        layer every 256 tokens as ``KVCache`` would; past it, by doubling."""
        import mlx.core as mx

        cap = 0 if c.keys is None else c.keys.shape[2]
        if t1 <= cap:
            return
        hint = self.header["cache"].get("tokens")
        limit = (self.header.get("session") or {}).get("context")
        hint = hint if isinstance(hint, int) and isinstance(limit, int) and 0 <= hint <= min(limit, MAX_TOKENS) else 0
        new = max(t1, hint + c.step if cap == 0 else 2 * cap)
        new = -(-new // c.step) * c.step
        per_token = kshape[1] * kshape[3] * codecs.DTYPES[kdtype][1] + vshape[1] * vshape[3] * codecs.DTYPES[vdtype][1]
        self._admit(0, where, reserve=(new - cap) * per_token)
        grown = []
        for old, shape, dt in ((c.keys, kshape, kdtype), (c.values, vshape, vdtype)):
            dt = getattr(mx, dt)
            if old is None:
                grown.append(mx.zeros((shape[0], shape[1], new, shape[3]), dt))
            else:
                grown.append(mx.concatenate(
                    [old[..., :c.offset, :], mx.zeros((shape[0], shape[1], new - c.offset, shape[3]), dt)], axis=2))
        c.keys, c.values = grown

    def commit(self, register: bool = True) -> "Session":
        """Build the session from everything applied; only now is it registered
        (``register=False``: built but not registered — a migration's prepare phase)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

        from runtime.session import SamplingParams, Session, SessionOptions

        if not self.done:
            raise CheckpointError("truncated: no verified trailer")
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
        # caches
        kind = h["cache"]["class"]
        caches = []
        for i, chunks in enumerate(self.chunks):
            if kind == "RotatingKVCache":
                w = self.whole.get(i)
                if w is None:
                    raise CheckpointError(f"layer {i}: no KV frame")
                opts = h["session"]["options"]
                c = RotatingKVCache(max_size=int(opts.get("ctx") or 0) or 1, keep=4)
                if w.get("keys") is not None:
                    c.keys = _mx_from_bits(*w["_k"])
                    c.values = _mx_from_bits(*w["_v"])
                    c.keep, c.max_size, c.offset, c._idx = w["meta"]
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
            else:
                meta = chunks[0][2][2] if chunks else {}
                c = QuantizedKVCache(group_size=int(meta.get("group_size", 64)), bits=int(meta.get("bits", 8)))
                if chunks:
                    def cat(side: int) -> tuple:
                        return tuple(mx.concatenate([_mx_from_bits(*p[1][side][j]) for _, _, p in chunks], axis=2)
                                     for j in range(3))
                    c.keys, c.values, c.offset = cat(0), cat(1), n_tokens
            caches.append(c)
        mx.eval([c.state for c in caches if not c.empty()])
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
        sampling = SamplingParams(**{**st.get("sampling", {}), "stop": tuple(st.get("sampling", {}).get("stop", ()))})
        options = SessionOptions(**h["session"]["options"])
        session = Session(self.host, gm, sampling, options, self.session_id or h["session"]["id"],
                          configure=False)
        try:
            guest = session.guest
            if size > guest.arena.cap:
                raise CheckpointError(f"guest frame: {size} bytes of memory exceed this host's cap "
                                      f"({guest.arena.cap})")
            grow = (size - guest.memory_size) // PAGE
            if grow > 0 and guest.memory.grow(guest.store, grow) < 0:
                raise CheckpointError("guest frame: cannot grow guest memory to its saved size")
            guest.arena.np[:guest.memory_size] = 0
            view = guest.arena.np[:size].reshape(-1, PAGE)
            if pages.size:
                view[pages] = np.frombuffer(data, dtype=np.uint8).reshape(-1, PAGE)
            for name, value in (g.get("globals") or {}).items():
                glob = guest._exports[name] if name in guest.module.exports else None
                if glob is None:
                    raise CheckpointError(f"guest frame: global '{name}' not exported by the guest")
                glob.set_value(guest.store, value)
            session.cache = caches
            session.history = history.tolist()
            session.messages = list(st.get("messages") or [])
            turn = st.get("turn")
            if turn is not None:
                toks, texts = turn.get("tokens"), turn.get("texts")
                if not (isinstance(toks, list) and isinstance(texts, list) and len(toks) == len(texts)
                        and all(isinstance(t, int) and 0 <= t < vocab for t in toks)
                        and all(isinstance(t, str) for t in texts)
                        and isinstance(turn.get("max_tokens", 0), int) and turn.get("max_tokens", 0) >= 0):
                    raise CheckpointError("state frame: malformed turn in progress")
                session.restore_turn(int(turn.get("n_prompt", 0)), bool(turn.get("record", True)),
                                     toks, texts, turn.get("max_tokens", 0))
        except BaseException:
            session.close()
            raise
        if not register:
            return session
        with self.host.lock:
            if session.id in self.host.sessions:
                session.close()
                raise CheckpointError(f"session {session.id} already exists on this host")
            self.host.sessions[session.id] = session
        return session


def restore(host: "ModelHost", chunks: Iterable[bytes], **kw) -> "Session":
    r = Restorer(host, **kw)
    for f in iter_frames(chunks):
        r.apply(f)
    return r.commit()


def load(host: "ModelHost", path: str | os.PathLike, **kw) -> "Session":
    from .frames import read_file_chunks

    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from None
    with f:
        return restore(host, read_file_chunks(f), **kw)
