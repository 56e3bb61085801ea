"""Guest linear memories as MLX arrays (seed 000's chain).

wasmtime lets the host supply linear memory through a *memory creator*. Ours
allocates each guest's memory as one MLX ``uint8`` array (the *arena*), sized to
the module's declared maximum or the guest's cap, and hands wasmtime its data
pointer. The arena never moves; growth stays inside it. This is the only module
that talks to wasmtime's C memory-creator API.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
from wasmtime import _bindings as _B


class Arena:
    """One guest's linear memory: an MLX uint8 array that never moves."""

    def __init__(self, cap: int, minimum: int, owner: str):
        import mlx.core as mx

        self.array = mx.zeros((cap,), dtype=mx.uint8)
        mx.eval(self.array)
        self.np = np.array(self.array, copy=False)  # same bytes, for small host reads/writes
        self.ptr = int(self.np.ctypes.data)
        self.cap = cap
        self.size = minimum
        self.owner = owner
        self.refused_grow: int | None = None


class ArenaCreator:
    """Engine-wide wasmtime memory creator routing each new memory to an Arena."""

    def __init__(self) -> None:
        self.arenas: dict[int, Arena] = {}
        self.pending: tuple[str, int] | None = None  # (guest name, cap) being instantiated
        self.error: str | None = None
        self._ids = itertools.count(1)
        self._new = _B.wasmtime_new_memory_callback_t(self._new_memory)
        self._get = _B.wasmtime_memory_get_callback_t(self._get_memory)
        self._grow = _B.wasmtime_memory_grow_callback_t(self._grow_memory)
        self._fin = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._finalize)
        self._noop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        self.struct = _B.wasmtime_memory_creator(None, self._new, self._noop)

    @staticmethod
    def _err(msg: str) -> int:
        e = _B.wasmtime_error_new(msg.encode())
        return ctypes.cast(e, ctypes.c_void_p).value or 0

    def _new_memory(self, env, ty, minimum, maximum, reserved, guard, ret) -> int:
        try:
            if self.pending is None:
                return self._err("kvferry: memory created outside a guest instantiation")
            owner, cap = self.pending
            size = min(cap, maximum)
            if minimum > size:
                self.error = (f"guest '{owner}' needs {minimum / 2**20:.1f} MiB of memory at start, "
                              f"over its cap of {cap / 2**20:.1f} MiB")
                return self._err(self.error)
            arena = Arena(size, minimum, owner)
            key = next(self._ids)
            self.arenas[key] = arena
            ret.contents.env = key
            ret.contents.get_memory = self._get
            ret.contents.grow_memory = self._grow
            ret.contents.finalizer = self._fin
            return 0
        except Exception as e:  # never let a Python error unwind through wasmtime
            return self._err(f"kvferry arena allocation failed: {e}")

    def _get_memory(self, env, size_ptr, max_ptr) -> int:
        a = self.arenas[env]
        size_ptr[0] = a.size
        max_ptr[0] = a.cap
        return a.ptr

    def _grow_memory(self, env, new_size) -> int:
        a = self.arenas[env]
        if new_size > a.cap:
            a.refused_grow = new_size
            return self._err(f"memory cap of {a.cap} bytes reached")
        a.size = new_size  # bytes beyond the old size are still zero: the arena starts zeroed
        return 0

    def _finalize(self, env) -> None:
        self.arenas.pop(env, None)
