"""Prompt prefixes reused across sessions (vLLM's automatic prefix caching,
mlx-lm server's prompt cache).

Every chat on a host starts with the same system prompt and chat-template head,
so a new session's first prompt starts from the KV of the longest prefix it
shares with a recent prompt on this host, and only the rest is prefilled: a
shared head is computed once, not once per user.

An entry is a copy, and so is what a session takes from it: a session's cache
stays its own, so checkpoints, pre-copy and migration see nothing new. Entries
go least recently used first under a byte budget (``serve --prefix-cache-mb``;
0 turns reuse off). Prompts are shared only between sessions of one client key
(``Session.owner``): how fast a first token comes must not tell one client
what another sent (the timing side channel vLLM's ``cache_salt`` closes). Only
sessions on plain KV caches (mlx-lm's ``KVCache``) take part. Everything here runs on the step thread under the host's compute
lock, so it needs no lock of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

MIN_TOKENS = 16  # a shorter shared prefix is not worth its copy


class Stacked:
    """A kept prompt's KV with every layer in one array per side, ``[layers, 1,
    kv_heads, tokens, head_dim]``, of which the first ``n`` tokens count: a copy of
    its own (kvferry.burst.copies makes one for each prompt of a burst with two
    operations, not two a layer). Reads as the per-layer list of (keys, values)
    that entries are; its size is what it holds, the padding included."""

    def __init__(self, k: Any, v: Any, n: int) -> None:
        self.k, self.v, self.n = k, v, n

    def __len__(self) -> int:
        return self.k.shape[0]

    def __getitem__(self, j: int) -> tuple:
        return self.k[j][..., :self.n, :], self.v[j][..., :self.n, :]

    def __iter__(self):
        return (self[j] for j in range(len(self)))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _nbytes(layers: Any) -> int:
    if isinstance(layers, Stacked):
        return layers.nbytes
    return sum(k.nbytes + v.nbytes for k, v in layers)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PrefixCache:
    """Recent prompts' KV, by their tokens, under ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # (owner, tokens) -> (tokens as an array, per layer (keys, values))
        self.entries: OrderedDict[tuple, tuple[np.ndarray, list]] = OrderedDict()
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "reused_tokens": 0}

    def match(self, session: Any, tokens: list[int]) -> tuple[int, list]:
        """The longest cached prefix of ``tokens`` (all but the last, which is decoded
        in a batch) that ``session`` may start from: its length and per layer (keys,
        values), to be copied (:meth:`fill`, or :func:`kvferry.burst.write_prefix`);
        (0, []) when none is long enough. Counted as a hit or a miss."""
        if not self.budget or len(tokens) <= MIN_TOKENS:
            return 0, []
        want = np.asarray(tokens[:-1], dtype=np.int64)
        best, best_key = 0, None
        for key, (ids, _) in self.entries.items():
            if key[0] != session.owner:
                continue
            n = _common(ids, want)
            if n > best:
                best, best_key = n, key
        if best < MIN_TOKENS:
            self.stats["misses"] += 1
            return 0, []
        self.entries.move_to_end(best_key)
        self.stats["hits"] += 1
        self.stats["reused_tokens"] += best
        return best, self.entries[best_key][1]

    def fill(self, session: Any, tokens: list[int]) -> int:
        """Put the KV of the longest cached prefix of ``tokens`` (:meth:`match`) into
        ``session``'s empty cache; return its length, 0 when none is long enough."""
        best, layers = self.match(session, tokens)
        return self.fill_from(session, layers, best) if best else 0

    def fill_from(self, session: Any, layers: list, best: int) -> int:
        """A matched prefix (:meth:`match`) copied into ``session``'s empty cache; its length."""
        import mlx.core as mx

        for c, (k, v) in zip(session.cache, layers):
            c.update_and_fetch(k[..., :best, :], v[..., :best, :])  # into the session's own buffer
        # evaluated here, on the thread that holds the compute lock: MLX streams belong to
        # their thread, and the next to read this cache may be another (a migration's
        # pre-copy, which failed with "There is no Stream(cpu, N) in current thread")
        mx.eval([x for c in session.cache for x in (c.keys, c.values)])
        return best

    def keep(self, session: Any, layers: "Stacked | None" = None) -> None:
        """Remember ``session``'s whole history (a fresh session's prompt, just
        prefilled) and its KV, copied (``layers``: a copy made already)."""
        import mlx.core as mx

        n = len(session.history)
        if not self.budget or n < MIN_TOKENS:
            return
        key = (session.owner, tuple(session.history))
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        ids = np.asarray(key[1], dtype=np.int64)
        mine = [(old, old_ids) for old, (old_ids, _) in self.entries.items() if old[0] == session.owner]
        for old, old_ids in mine:
            if _common(old_ids, ids) == len(ids):
                self.entries.move_to_end(old)  # a longer entry covers it already
                return
        # mx.contiguous of a slice of the session's (longer) buffer is a copy: the
        # entry shares nothing the session will write to
        if layers is None:
            layers = [(mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :])) for c in session.cache]
        size = _nbytes(layers)
        if size > self.budget:
            return
        mx.eval([layers.k, layers.v] if isinstance(layers, Stacked) else layers)
        for old, old_ids in mine:
            if len(old_ids) < n and _common(old_ids, ids) == len(old_ids):
                self._drop(old)  # the new entry covers it
        self.entries[key] = (ids, layers)
        self.bytes += size
        while self.bytes > self.budget:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple) -> None:
        _, layers = self.entries.pop(key)
        self.bytes -= _nbytes(layers)

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
