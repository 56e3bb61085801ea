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
import weakref

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
    """Engine-wide wasmtime memory creator routing each new memory to an Arena.

    wasmtime keeps the creator's function pointers as long as the engine lives,
    and a memory's as long as its store: both can outlive this object (a cached
    module holds the engine; the garbage collector frees a cycle in any order).
    So the C callbacks are module-level and immortal, find their creator and
    arena through ``env`` keys, and an arena stays in ``_LIVE`` until wasmtime
    itself finalizes its memory: the buffer never dies under a store.
    """

    def __init__(self) -> None:
        self.arenas: dict[int, Arena] = {}
        self.pending: tuple[str, int] | None = None  # (guest name, cap) being instantiated
        self.error: str | None = None
        self.key = next(_ids)
        _CREATORS[self.key] = self
        self.struct = _B.wasmtime_memory_creator(self.key, _NEW, _NOOP)


def _err(msg: str) -> int:
    e = _B.wasmtime_error_new(msg.encode())
    return ctypes.cast(e, ctypes.c_void_p).value or 0


def _new_memory(env, ty, minimum, maximum, reserved, guard, ret) -> int:
    try:
        creator = _CREATORS.get(env or 0)
        if creator is None or creator.pending is None:
            return _err("kvferry: memory created outside a guest instantiation")
        owner, cap = creator.pending
        size = min(cap, maximum)
        if minimum > size:
            creator.error = (f"guest '{owner}' needs {minimum / 2**20:.1f} MiB of memory at start, "
                             f"over its cap of {cap / 2**20:.1f} MiB")
            return _err(creator.error)
        arena = Arena(size, minimum, owner)
        key = next(_ids)
        _LIVE[key] = (arena, creator.arenas)
        creator.arenas[key] = arena
        ret.contents.env = key
        ret.contents.get_memory = _GET
        ret.contents.grow_memory = _GROW
        ret.contents.finalizer = _FIN
        return 0
    except Exception as e:  # never let a Python error unwind through wasmtime
        return _err(f"kvferry arena allocation failed: {e}")


def _get_memory(env, size_ptr, max_ptr) -> int:
    a = _LIVE[env][0]
    size_ptr[0] = a.size
    max_ptr[0] = a.cap
    return a.ptr


def _grow_memory(env, new_size) -> int:
    a = _LIVE[env][0]
    if new_size > a.cap:
        a.refused_grow = new_size
        return _err(f"memory cap of {a.cap} bytes reached")
    a.size = new_size  # bytes beyond the old size are still zero: the arena starts zeroed
    return 0


def _finalize(env) -> None:
    arena, home = _LIVE.pop(env, (None, {}))
    home.pop(env, None)


_ids = itertools.count(1)
_CREATORS: "weakref.WeakValueDictionary[int, ArenaCreator]" = weakref.WeakValueDictionary()
_LIVE: dict[int, tuple[Arena, dict[int, Arena]]] = {}  # memory key -> (arena, its creator's table)
_NEW = _B.wasmtime_new_memory_callback_t(_new_memory)
_GET = _B.wasmtime_memory_get_callback_t(_get_memory)
_GROW = _B.wasmtime_memory_grow_callback_t(_grow_memory)
_FIN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_finalize)
_NOOP = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
