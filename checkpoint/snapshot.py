"""Snapshot a live session into checkpoint frames (restoring is :mod:`.restore`).

Frame order: header, KV frames (token ranges per layer, any number of stages),
state (token history, messages, sampling), guest (memory pages, globals,
module), trailer. A :class:`Snapshotter` reads the session through its
``state()`` (and the caches' own ``state``): it can emit the KV of the tokens so
far, later the KV of tokens generated since (deltas), and finally the small
state: that is what live migration streams.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import asdict
from typing import Any, Iterable, Iterator

import numpy as np

from . import codecs, step_ahead
from .errors import CheckpointError
from .frames import GUEST, HEADER, KV, STATE, FrameWriter
from .kv_extract import DeviceExtract
from .mlxbits import host_memory, mx_bits, np_kind


def cache_kind(c) -> str:
    """The mlx-lm cache class a checkpoint records for ``c`` (a resident row's cache,
    kvferry.resident.ResidentKV, is a KVCache's)."""
    return getattr(type(c), "checkpoint_kind", type(c).__name__)


PACKED_BYTES = 1 << 20  # a last delta up to this many bytes of KV is packed by msgpack in one call
class Snapshotter(DeviceExtract):
    """Emits a session's checkpoint frame by frame (``session``: a
    :class:`kvferry.session.Session`; only its ``state()``, ``history``, ``lm`` and
    ``host.compute``, the lock its host's steps hold, are read)."""

    def __init__(self, session: Any, mode: str = "lossless", parts: bool = False):
        if mode not in codecs.MODES:
            raise CheckpointError(f"unknown checkpoint mode '{mode}' (choose from {', '.join(codecs.MODES)})")
        self.s, self.mode = session, mode
        self.st = session.state(memory=False)  # its caches are live: steps append to them
        self.caches = self.st.caches
        self.w = FrameWriter()
        self.sent_tokens = 0  # KV of tokens [0, sent_tokens) already emitted
        self.raw_kv_bytes = 0
        self.kind = cache_kind(self.caches[0])
        self.rate = 0.0  # live pre-copy: raw KV bytes per second at most (0 = unpaced)
        self._due = 0.0
        self.epoch = self.st.kv_epoch
        self.busy = {"extract": 0.0, "encode": 0.0}  # seconds spent copying KV out, and framing it
        self.lock = getattr(getattr(session, "host", None), "compute", None)
        # ``parts``: KV frames of pieces that stay valid (:meth:`lasting`) come as
        # frames.Parts, for scatter-gather sends
        self.parts = parts

    def shared(self) -> bool:
        """Whether the session's KV lives in buffers its host shares between sessions
        (kvferry.resident): other sessions' steps rewrite those, and leave them lazy on
        their own thread while they build a step, so even a paused session's KV is read
        under the compute lock."""
        return bool(self.caches) and cache_kind(self.caches[0]) != type(self.caches[0]).__name__

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (sizes pre-copy chunks): a buffer's
        bytes over its own length, which a KVCache's capacity (steps of 256) or, in a host's
        shared buffers, the longest session resident pads. A resident row answers without
        its views, which are lazy ops on the shared buffers (this runs on migration threads)."""
        total = 0
        for c in self.caches:
            if c.empty():
                continue
            one = getattr(c, "token_bytes", None)  # a resident row's (its views are lazy ops)
            if one is None:
                parts = [p for buf in (c.keys, c.values) for p in (buf if isinstance(buf, (list, tuple)) else [buf])]
                one = sum(p.nbytes // max(1, p.shape[2]) for p in parts)
            total += one
        return total

    def chunk_tokens(self, piece_bytes: int) -> int:
        """Tokens of one layer that make about ``piece_bytes`` of KV (at least 16): the
        ``chunk`` of :meth:`extract`."""
        return max(16, piece_bytes // max(1, self.kv_bytes_per_token() // len(self.caches)))

    @property
    def incremental(self) -> bool:
        return self.kind in ("KVCache", "QuantizedKVCache")

    def header(self) -> bytes:
        from .. import __version__

        st, lm = self.st, self.s.lm
        cfg = lm.config
        head = {
            "format": 1, "kvferry": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "created_on": socket.gethostname(), "mode": self.mode,
            "model": {"name": lm.name, "fingerprint": lm.fingerprint, "dtype": lm.dtype, "weights": lm.weights,
                      "vocab_size": int(cfg["vocab_size"]), "layers": len(self.caches)},
            "guest": {"label": st.module.label, "sha256": st.module.sha256},
            "session": {"id": st.id, "context": st.context, "sampling": _plain(asdict(st.sampling)),
                        "options": _plain(asdict(st.options)), "owner": st.owner},
            "cache": {"class": self.kind, "layers": len(self.caches), "tokens": len(st.history),
                      "kv_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                      "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])},
        }
        return self.w.frame(HEADER, head)

    def lasting(self, lock=None) -> bool:
        """Whether :meth:`extract` with ``lock`` yields pieces that stay valid after the next
        one, so that :meth:`encode` may frame them by reference: a device batch is a host
        copy of its own, and a host-memory KVCache held still (no lock) is read in place."""
        if not host_memory():
            return True
        keys = getattr(self.caches[0], "keys", None) if lock is None and self.kind == "KVCache" else None
        return keys is not None and np_kind(keys.dtype) is not None  # None: an empty cache

    def extract(self, upto: int | None = None, lock=None, budget: float = 0.002,
                chunk: int | None = None, per_hold: int | None = None, extra: list | None = None) -> Iterator[tuple]:
        """Copy the KV of tokens [sent_tokens, upto) out of the cache, layer by layer
        (and with ``chunk``, in token ranges of at most that many tokens).

        With ``lock`` (the host's compute lock, for a session that may be
        generating) the copies happen under short holds of about ``budget``
        seconds (at least one piece each, at most ``per_hold``): steps only append, so
        the range stays valid between holds. Copies, not views: a view would pin the cache's
        buffer and make every later step copy the whole cache instead of
        updating it in place. Yielded pieces may live in reused scratch memory:
        use each before asking for the next (as :meth:`encode` does). Without a
        lock the session is held still, and the pieces are views (:meth:`_views`)."""
        import mlx.core as mx

        caches = self.caches
        n = len(self.s.history) if upto is None else upto
        t0 = self.sent_tokens
        if not self.incremental or n <= t0:
            return
        self.sent_tokens = n
        step = max(1, chunk or n - t0)
        pieces = [(i, a, min(a + step, n)) for i in range(len(caches)) for a in range(t0, n, step)]
        if not host_memory():
            yield from self._extract_device(pieces, n, lock, per_hold, extra)
            return
        if self.lasting(lock):  # held still: read in place
            yield from self._views(pieces, n)
            return
        if self.kind == "KVCache" and np_kind(caches[0].state[0].dtype) is not None:
            yield from self._extract_np(pieces, n, lock, budget, per_hold)
            return
        j = 0
        while j < len(pieces):
            out = []
            with lock if lock is not None else contextlib.nullcontext():
                start = time.perf_counter()
                while j < len(pieces) and (not out or lock is None or time.perf_counter() - start < budget):
                    i, a, b = pieces[j]
                    keys, values, _, *meta = self._layer(i, n)
                    if self.kind == "KVCache":
                        k, v = keys[..., a:b, :], values[..., a:b, :]
                        mx.eval(k, v)
                        out.append((i, a, b, mx_bits(k), mx_bits(v), None))
                    else:  # QuantizedKVCache: (packed, scales, biases) per side, stored exactly
                        out.append((i, a, b, [mx_bits(x[..., a:b, :]) for x in keys],
                                    [mx_bits(x[..., a:b, :]) for x in values],
                                    {"group_size": meta[0], "bits": meta[1]}))
                    del keys, values
                    j += 1
                self.busy["extract"] += time.perf_counter() - start
            yield from out  # encoded outside the hold

    def _layer(self, i: int, n: int) -> tuple:
        """Layer ``i``'s cache state, refused if it holds fewer than ``n`` tokens."""
        state = self.caches[i].state
        if state[2] < n:
            raise CheckpointError(f"layer {i} cache holds {state[2]} tokens, history has {n}")
        return state

    def _views(self, pieces: list[tuple[int, int, int]], n: int) -> Iterator[tuple]:
        """:meth:`extract` of a session held still (paused, or between steps): views
        of the cache's own buffers, no copy. A step taken while one is held copies
        the layer instead of updating it in place (MLX never writes a buffer that
        is referenced elsewhere), so a view never changes under its reader."""
        start = time.perf_counter()
        for i, a, b in pieces:
            keys, values, _ = self._layer(i, n)
            sides = []
            for arr in (keys, values):
                u, name = np_kind(arr.dtype)
                sides.append((np.array(arr, copy=False)[..., a:b, :].view(u), name))
            del keys, values, arr
            self.busy["extract"] += time.perf_counter() - start
            yield (i, a, b, sides[0], sides[1], None)
            start = time.perf_counter()

    def _extract_np(self, pieces: list[tuple[int, int, int]], n: int, lock, budget: float,
                    per_hold: int | None = None) -> Iterator[tuple]:
        """:meth:`extract` for float32/float16 ``KVCache``: numpy copies pieces
        straight out of MLX's buffers (no MLX op, so nothing is queued on the
        stream a generating session uses) into scratch memory reused from hold to
        hold, whose pages are already mapped: first-touch faults cost ~2 ms/MB on
        a VM, and inside a hold they would stall the next step. The yielded arrays
        are valid until the next piece is asked for: :meth:`encode` copies them
        into a frame first."""
        per_hold = per_hold or (8 if lock is not None else 1)
        pool: list[np.ndarray] = []  # keys and values scratch for each piece of a hold
        j = 0
        while j < len(pieces):
            sides = self.caches[pieces[j][0]].state[:2]
            row = max(a.shape[0] * a.shape[1] * a.shape[3] * a.dtype.size for a in sides)
            del sides
            need = row * max(b - a for _, a, b in pieces[j:j + per_hold])
            if len(pool) < 2 * per_hold or pool[0].nbytes < need:  # sized outside the hold
                pool = [np.zeros(need, np.uint8) for _ in range(2 * per_hold)]
            out = []
            with lock if lock is not None else contextlib.nullcontext():
                start = time.perf_counter()
                while j < len(pieces) and len(out) < per_hold and (not out or time.perf_counter() - start < budget):
                    i, a, b = pieces[j]
                    keys, values, _ = self._layer(i, n)
                    sides = []
                    for buf, arr in zip(pool[2 * len(out):], (keys, values)):
                        u, name = np_kind(arr.dtype)
                        # a view of MLX's buffer, dropped within the hold: kept, it would
                        # stop the next step updating the cache in place
                        src = np.array(arr, copy=False)[..., a:b, :].view(u)
                        dst = buf[:src.nbytes].view(u).reshape(src.shape)
                        np.copyto(dst, src)
                        sides.append((dst, name))
                        del src
                    del keys, values, arr
                    out.append((i, a, b, sides[0], sides[1], None))
                    j += 1
                self.busy["extract"] += time.perf_counter() - start
            yield from out

    def encode(self, extracted: Iterable[tuple], batch: bool = False, lasting: bool = False) -> Iterator[bytes]:
        """KV frames from :meth:`extract`'s copies (no lock needed): one per layer,
        or with ``batch`` one frame for all of them (a small final delta, where
        per-frame costs would dominate). ``lasting``: the pieces stay valid
        (:meth:`lasting`), so with ``parts`` a frame's payloads are referenced, not joined."""
        bodies, raw0 = [], self.raw_kv_bytes
        for i, t0, n, k, v, meta in extracted:
            began = time.perf_counter()
            raw = self.raw_kv_bytes
            body: dict[str, Any] = {"layer": i, "start": t0, "end": n}
            if meta is None:  # unless batched, framed before the next piece reuses k's and v's memory
                body["keys"] = self._enc(*k, role="keys", borrow=not batch)
                body["values"] = self._enc(*v, borrow=not batch)
            else:
                body["keys"] = [self._enc(*x, exact=True) for x in k]
                body["values"] = [self._enc(*x, exact=True) for x in v]
                body["meta"] = meta
            if batch:
                bodies.append(body)
                self.busy["encode"] += time.perf_counter() - began
                continue
            frame = self.w.frame_parts(KV, body) if self.parts and lasting else self.w.frame(KV, body)
            self.busy["encode"] += time.perf_counter() - began
            if self.rate:  # live pre-copy: a steady trickle leaves memory bandwidth to generation
                now = time.perf_counter()
                self._due = max(self._due, now) + (self.raw_kv_bytes - raw) / self.rate
                time.sleep(max(0.0, self._due - now))
            yield frame
        if bodies:
            # small copies of its own (borrow=False): msgpack packs it in one call. Past
            # PACKED_BYTES its copies would hold the GIL, where the join lets go of it
            small = self.raw_kv_bytes - raw0 <= PACKED_BYTES
            yield (self.w.frame_packed if small else self.w.frame)(KV, {"batch": bodies})

    def precopy(self, upto: int, lock: Any, chunk: int) -> Iterator[bytes]:
        """Live pre-copy's KV frames for tokens [sent_tokens, upto) of a session that goes
        on generating: copied in ``chunk``-token pieces under short holds of ``lock`` (its
        host's compute lock), each encoded outside them and yielded as soon as it is."""
        return self.encode(self.extract(upto, lock=lock, chunk=chunk), lasting=self.lasting(lock))

    def kv(self, upto: int | None = None, batch: bool = False, extra: list | None = None) -> Iterator[bytes]:
        """KV frames for tokens [sent_tokens, upto) of every layer (a delta) of a
        session held still. Shared buffers are read under the compute lock: a small
        delta (``batch``) in one hold, so a live migration's pause waits for at most
        one step of the others; a whole KV in holds of ~1 MB pieces, up to 10 ms each.
        ``extra``: see :meth:`_extract_device`."""
        if self.lock is None or not self.shared():
            yield from self.encode(self.extract(upto, extra=extra), batch, self.lasting())
        elif batch:
            yield from self.encode(self.extract(upto, lock=self.lock, budget=float("inf"), per_hold=len(self.caches),
                                                extra=extra), batch, self.lasting(self.lock))
        else:
            yield from self.encode(self.extract(upto, lock=self.lock, budget=0.01, chunk=self.chunk_tokens(1 << 20),
                                                per_hold=16, extra=extra), batch, self.lasting(self.lock))

    def _enc(self, u: np.ndarray, dtype: str, exact: bool = False, role: str = "values",
             borrow: bool = False) -> dict:
        self.raw_kv_bytes += u.nbytes
        return codecs.encode(u, dtype, "lossless" if exact and self.mode != "raw" else self.mode, role,
                             borrow=borrow)

    def _blob(self, a, exact: bool = False, role: str = "values") -> dict:
        return self._enc(*mx_bits(a), exact=exact, role=role)

    def finish(self) -> Iterator[bytes]:
        """Remaining KV, then state, guest and trailer."""
        st = self.s.state()
        if st.kv_epoch != self.epoch and self.sent_tokens:
            raise CheckpointError("the KV cache was rewritten (a new turn trimmed it) after part of "
                                  "it was sent; migrate again")
        n = len(st.history)
        ahead = step_ahead.read(self.s, st, self.caches, self.lock, self.shared()) if self.kind == "KVCache" else None
        # after pre-copy only a few tokens remain: one frame for all layers
        yield from self.kv(n, batch=0 < n - self.sent_tokens <= 64 and self.sent_tokens > 0,
                           extra=ahead[1] if ahead else None)
        if not self.incremental:
            for i, c in enumerate(st.caches):
                body: dict[str, Any] = {"layer": i, "start": 0, "end": n, "whole": True, "meta": None}
                if not c.empty():
                    keys, values, offset, keep, max_size, idx = c.state
                    body["meta"] = [int(keep), int(max_size), int(offset), int(idx)]
                    body["keys"] = self._blob(keys, role="keys")
                    body["values"] = self._blob(values)
                yield self.w.frame(KV, body)
        history = np.asarray(st.history, dtype=np.int32)
        state = {"n_tokens": n, "history": codecs.encode_bytes(history.tobytes()),
                 "messages": st.messages, "sampling": _plain(asdict(st.sampling)), "turn": st.turn}
        if ahead is not None and (a := step_ahead.frame(*ahead, self.mode)) is not None:
            state["ahead"] = a
        yield self.w.frame(STATE, state)
        mem = st.memory
        yield self.w.frame(GUEST, {
            "sha256": st.module.sha256, "label": st.module.label,
            "module": codecs.encode_bytes(st.module.wasm),
            "memory_size": mem.size, "pages": mem.pages.tobytes(),
            "data": codecs.encode_bytes(mem.data) if mem.pages.size else None,
            "globals": mem.globals,
        })
        yield self.w.trailer()


def _plain(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _still(session: Any):
    """The session held at its boundary while it is read (Session.still), where it has one."""
    return session.still() if hasattr(session, "still") else contextlib.nullcontext()


def snapshot(session: Any, mode: str = "lossless") -> Iterator[bytes]:
    """The whole checkpoint of a session (between steps), as a stream of byte chunks."""
    with _still(session):
        sn = Snapshotter(session, mode)
        yield sn.header()
        yield from sn.finish()


def save(session: Any, path: str | os.PathLike, mode: str = "lossless") -> dict:
    """Write a checkpoint file atomically; returns sizes."""
    import tempfile

    # a new file of our own next to the target (O_EXCL, mode 0600): never a path someone
    # else placed there, such as a symlink; then an atomic rename over the target
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(os.path.abspath(path)))
        try:
            with os.fdopen(fd, "wb") as f, _still(session):
                sn = Snapshotter(session, mode)
                f.write(sn.header())
                for chunk in sn.finish():
                    f.write(chunk)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:  # no directory, a directory at the path, a full disk: the session is untouched
        raise CheckpointError(f"{path}: cannot write the checkpoint ({e.strerror or e})") from None
    return {"bytes": sn.w.bytes, "raw_kv_bytes": sn.raw_kv_bytes, "frames": sn.w.count + 1}
