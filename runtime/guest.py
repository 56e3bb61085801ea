"""Wasm guests whose linear memory is an MLX array.

The chain (seed 000): wasmtime lets the host supply linear memory through a
*memory creator*. Ours allocates each guest's memory as one MLX ``uint8`` array
(the *arena*), sized to the module's declared maximum or the guest's cap, and
hands wasmtime its data pointer. With ``memory_reservation = 0`` and
``memory_guard_size = 0`` wasmtime bounds-checks explicitly and never moves the
memory; growth stays inside the arena. MLX views of the arena
(slice -> ``view(dtype)`` -> reshape) therefore read exactly the bytes the guest
wrote. On Apple Silicon the arena is a shared-storage Metal buffer; on Linux it
is the host memory MLX's CPU backend computes on.

Sandbox: one store per guest, no WASI, a memory cap (the arena), a wall-clock
deadline per call (epoch interruption; time the host spends running the model
for the guest does not count), and an engine-wide wasm stack limit. A trap in
one guest raises :class:`GuestTrap` naming the guest and the limit, and leaves
every other guest untouched.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import wasmtime as wt
from wasmtime import _bindings as _B

from .arena import Arena, ArenaCreator
from .collector import gc_cpu_seconds
from . import wasm_calls
from .errors import GuestAbiError, GuestError, GuestTrap

TICK_S = 0.005  # epoch tick: deadline resolution
WASM_PAGE = 65536
MAX_MODULES = 64  # compiled modules an engine keeps (each is machine code in memory)
START_SECTION = 8


def has_start_section(wasm: bytes) -> bool:
    """Whether a binary module declares a start function (section id 8). Malformed
    section headers answer False: wasmtime's own validation then rejects the module."""
    at = 8
    while at < len(wasm):
        sid = wasm[at]
        at += 1
        size = shift = 0
        while at < len(wasm):  # LEB128 u32
            b = wasm[at]
            at += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80 or shift > 35:
                break
        if sid == START_SECTION:
            return True
        at += size
    return False


class HostImports(Protocol):
    """The host functions one guest imports (an ABI's, bound to that guest)."""

    def define(self, linker: wt.Linker) -> None: ...


class GuestAbi(Protocol):
    """What the engine needs of an ABI (kvferry.abi.V1 is the one we ship): it
    checks modules and instances and supplies their imports; the engine itself
    knows no ABI."""

    def check_module(self, gm: "GuestModule") -> None: ...
    def host_functions(self, guest: "Guest") -> HostImports: ...
    def check_instance(self, guest: "Guest") -> None: ...


@dataclass
class MemoryImage:
    """A guest's memory between two calls: its size, the pages that are not all
    zero (by index) with their bytes, and its exported mutable globals."""
    size: int
    pages: np.ndarray  # uint32 page indices, strictly increasing
    data: bytes  # len(pages) * WASM_PAGE bytes
    globals: dict[str, Any] = field(default_factory=dict)


@dataclass
class GuestLimits:
    memory_cap: int = 16 << 20  # bytes of linear memory, at most (arena = min(cap, module max))
    deadline_ms: float = 5000.0  # guest time per export call


# ----------------------------------------------------------------------------- engine

class GuestEngine:
    """Compiles modules and instantiates sandboxed guests. One per process is typical."""

    def __init__(self, abi: GuestAbi | None = None, stack_bytes: int = 512 << 10) -> None:
        from .blas import enable

        enable()  # arenas are MLX arrays: the BLAS choice comes first
        self.abi = abi
        cfg = wt.Config()
        cfg.memory_reservation = 0
        cfg.memory_guard_size = 0
        cfg.memory_reservation_for_growth = 0
        cfg.epoch_interruption = True
        cfg.max_wasm_stack = stack_bytes
        self.stack_bytes = stack_bytes
        self.creator = ArenaCreator()
        # copy-on-write memory images only work for mmap memories, not host buffers
        _B.wasmtime_config_memory_init_cow_set(cfg.ptr(), False)
        _B.wasmtime_config_host_memory_creator_set(cfg.ptr(), ctypes.byref(self.creator.struct))
        self.engine = wt.Engine(cfg)
        self._lock = threading.Lock()
        self.compute = threading.Lock()  # MLX work of every guest of this engine, one at a time
        self._modules: dict[str, wt.Module] = {}  # by sha256, in order of last use
        self.max_modules = MAX_MODULES
        self._stop = threading.Event()
        ref = weakref.ref(self)
        self._ticker = threading.Thread(target=_tick, args=(ref, self._stop, self.engine),
                                        name="kvferry-epoch", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()

    def compile(self, wasm: bytes | str | Path, name: str | None = None) -> "GuestModule":
        """Compile a module (cached by content hash) and check it against the ABI."""
        if isinstance(wasm, (str, Path)):
            path = Path(wasm)
            label = name or path.name
            try:
                data = path.read_bytes()
            except OSError as e:
                raise GuestError(f"{label}: cannot read: {e.strerror}") from None
        else:
            data, label = bytes(wasm), name or "guest"
        if not data.startswith(b"\0asm") and not data.lstrip().startswith(b"("):
            raise GuestError(f"{label}: not a WebAssembly module (no \\0asm magic)")
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            module = self._modules.pop(digest, None)
        if module is None:
            try:
                binary = data if data.startswith(b"\0asm") else wt.wat2wasm(data.decode("utf-8", "replace"))
                if has_start_section(binary):  # it would run at instantiation, before any deadline
                    raise GuestError(f"{label}: has a start function; kvferry guests may not run code "
                                     "when instantiated")
                module = wt.Module(self.engine, binary)
            except (wt.WasmtimeError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise GuestError(f"{label}: not a valid WebAssembly module ({first})") from None
        gm = GuestModule(label, module, digest, data)
        if self.abi is not None:
            self.abi.check_module(gm)  # only a module that passes is kept
        with self._lock:  # least recently used last out
            self._modules[digest] = module
            while len(self._modules) > self.max_modules:
                self._modules.pop(next(iter(self._modules)))
        return gm

    def instantiate(self, module: "GuestModule", name: str | None = None,
                    limits: GuestLimits | None = None) -> "Guest":
        g = Guest(self, module, name or module.label, limits or GuestLimits())
        try:
            if self.abi is not None:
                self.abi.check_instance(g)
        except BaseException:
            g.close()
            raise
        return g

    @property
    def live_arenas(self) -> int:
        return len(self.creator.arenas)


def _tick(ref, stop: threading.Event, engine: wt.Engine) -> None:
    while not stop.wait(TICK_S):
        if ref() is None:
            return
        engine.increment_epoch()


@dataclass
class GuestModule:
    label: str
    module: wt.Module
    sha256: str
    wasm: bytes = b""
    kind: str = "tool"  # "chat" when it exports the chat entry points

    @property
    def exports(self) -> list[str]:
        return [e.name for e in self.module.exports]


# ----------------------------------------------------------------------------- guest

class Guest:
    """One sandboxed guest instance: its store, its arena, its exports."""

    def __init__(self, engine: GuestEngine, module: GuestModule, name: str, limits: GuestLimits):
        self.engine, self.module, self.name, self.limits = engine, module, name, limits
        self.store = wt.Store(engine.engine)
        self.store.set_limits(memories=1)  # the memory cap itself is the arena (see _ArenaCreator)
        self.store.set_epoch_deadline(1 << 40)
        self._context = self.store._context()  # the store's C context, for deadlines set in place
        self.crossing = wasm_calls.Crossing()  # a host function's exception, back across the call
        self.host: HostImports | None = engine.abi.host_functions(self) if engine.abi is not None else None
        linker = wt.Linker(engine.engine)
        if self.host is not None:
            self.host.define(linker)
        self.dead: str | None = None
        self.model: Any = None  # a ModelBinding, attached by sessions
        self.copy_mode = False  # True: tensor calls copy guest bytes (benchmark baseline)
        self._call_start = self._call_cpu = 0.0
        self._host_time = self._host_cpu = 0.0
        self._deadline_ms = limits.deadline_ms
        self._export = ""
        c = engine.creator
        with engine._lock:
            before = set(c.arenas)
            c.pending, c.error = (name, limits.memory_cap), None
            # No start function runs (compile refuses them); the deadline is the guest's
            # own all the same, so instantiation can never hold the engine's lock for long.
            self.store.set_epoch_deadline(self._ticks(limits.deadline_ms / 1000))
            try:
                self.instance = linker.instantiate(self.store, module.module)
            except (wt.WasmtimeError, wt.Trap) as e:
                msg = c.error or str(e).strip().splitlines()[0]
                raise GuestError(f"guest '{name}': cannot instantiate: {msg}") from None
            finally:
                c.pending = None
            new = [k for k in c.arenas if k not in before]
        self._arena_key = new[0] if new else None
        self._exports = self.instance.exports(self.store)
        self.memory: wt.Memory = self._exports["memory"]  # type: ignore[assignment]
        self._funcs: dict[str, Callable] = {}

    # -- memory -----------------------------------------------------------------
    @property
    def arena(self) -> Arena:
        if self._arena_key is None or self._arena_key not in self.engine.creator.arenas:
            raise GuestTrap(f"guest '{self.name}' is closed")
        return self.engine.creator.arenas[self._arena_key]

    @property
    def memory_size(self) -> int:
        return self.arena.size

    def base_address(self) -> int:
        """Address wasmtime reports for the guest's memory (== the arena's MLX buffer)."""
        return ctypes.cast(self.memory.data_ptr(self.store), ctypes.c_void_p).value or 0

    def view(self, offset: int, dtype, shape: tuple[int, ...]):
        """A zero-copy MLX view of guest bytes (bounds-checked)."""
        import mlx.core as mx

        itemsize = np.dtype(_np_dtype(dtype)).itemsize if dtype != mx.bfloat16 else 2
        n = int(np.prod(shape)) * itemsize
        if offset < 0 or offset + n > self.arena.size or offset % itemsize:
            raise GuestAbiError(f"view: {n} bytes at {offset} outside guest memory ({self.arena.size} bytes)")
        return self.arena.array[offset:offset + n].view(dtype).reshape(shape)

    def read(self, offset: int, n: int) -> bytes:
        a = self.arena
        if offset < 0 or n < 0 or offset + n > a.size:
            raise GuestAbiError(f"read: {n} bytes at {offset} outside guest memory ({a.size} bytes)")
        return a.np[offset:offset + n].tobytes()

    def write(self, offset: int, data: bytes | np.ndarray) -> None:
        a = self.arena
        buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else \
            data.reshape(-1).view(np.uint8)
        if offset < 0 or offset + buf.size > a.size:
            raise GuestAbiError(f"write: {buf.size} bytes at {offset} outside guest memory ({a.size} bytes)")
        a.np[offset:offset + buf.size] = buf

    def memory_image(self) -> MemoryImage:
        """A copy of the memory and mutable globals (what a checkpoint keeps)."""
        size = self.arena.size
        pages = self.arena.np[:size].reshape(-1, WASM_PAGE)
        used = np.flatnonzero(pages.any(axis=1)).astype(np.uint32)
        globals_ = {e.name: self._exports[e.name].value(self.store) for e in self.module.module.exports
                    if isinstance(e.type, wt.GlobalType) and e.type.mutable}
        return MemoryImage(size, used, pages[used].tobytes() if used.size else b"", globals_)

    def load_memory_image(self, image: MemoryImage) -> None:
        """Make the memory and globals those of ``image`` (a fresh instance of the
        same module); raises GuestError naming what does not fit."""
        if image.size % WASM_PAGE or not 0 < image.size <= self.arena.cap:
            raise GuestError(f"guest '{self.name}': memory of {image.size} bytes does not fit its cap "
                             f"({self.arena.cap})")
        n = image.size // WASM_PAGE
        pages = np.asarray(image.pages, dtype=np.uint32)
        if pages.size and (int(pages.max()) >= n or np.any(np.diff(pages.astype(np.int64)) <= 0)):
            raise GuestError(f"guest '{self.name}': page table out of range")
        if len(image.data) != pages.size * WASM_PAGE:
            raise GuestError(f"guest '{self.name}': page data does not match the page table")
        grow = (image.size - self.memory_size) // WASM_PAGE
        if grow > 0 and self.memory.grow(self.store, grow) < 0:
            raise GuestError(f"guest '{self.name}': cannot grow memory to {image.size} bytes")
        self.arena.np[:self.memory_size] = 0
        view = self.arena.np[:image.size].reshape(-1, WASM_PAGE)
        if pages.size:
            view[pages] = np.frombuffer(image.data, dtype=np.uint8).reshape(-1, WASM_PAGE)
        for name, value in image.globals.items():
            glob = self._exports[name] if name in self.module.exports else None
            if not isinstance(glob, wt.Global):
                raise GuestError(f"guest '{self.name}': global '{name}' not exported by the guest")
            glob.set_value(self.store, value)

    # -- calls ------------------------------------------------------------------
    def has_export(self, name: str) -> bool:
        return name in self.module.exports

    def check_alive(self) -> None:
        """Refuse, in one line, a guest that an earlier call left unusable (a trap, or a
        host call that failed under it: its memory is as that call left it, midway)."""
        if self.dead:
            raise GuestTrap(f"guest '{self.name}' is unusable after an earlier failure: {self.dead}")

    def call(self, export: str, *args: Any, deadline_ms: float | None = None) -> Any:
        """Call an export under the guest's deadline (``deadline_ms``: a shorter one for
        this call); traps become GuestTrap."""
        self.check_alive()
        fn = self._funcs.get(export)
        if fn is None:
            f = self._exports[export] if export in self.module.exports else None
            if not isinstance(f, wt.Func):
                raise GuestError(f"guest '{self.name}' has no exported function '{export}'")
            fn = self._funcs[export] = wasm_calls.export(self.store, f, self.crossing)
        self._export = export
        self._call_start = time.perf_counter()
        self._call_cpu = time.thread_time() - gc_cpu_seconds()
        self._host_time = self._host_cpu = 0.0
        self._deadline_ms = min(deadline_ms or self.limits.deadline_ms, self.limits.deadline_ms)
        wasm_calls.set_deadline(self._context, self._ticks(self._deadline_ms / 1000))
        try:
            return fn(*args)
        except GuestAbiError as e:
            self.dead = str(e)
            raise GuestTrap(f"guest '{self.name}': {e}") from None
        except wt.Trap as t:
            self.dead = self._describe(t)
            raise GuestTrap(f"guest '{self.name}': {self.dead}") from None
        except wt.WasmtimeError as e:
            self.dead = str(e).strip().splitlines()[0]
            raise GuestTrap(f"guest '{self.name}': {self.dead} in {export}()") from None
        except BaseException as e:
            self.dead = f"{type(e).__name__}: {e}"
            raise

    @staticmethod
    def _ticks(seconds: float) -> int:
        return max(1, math.ceil(seconds / TICK_S) + 1)

    def cpu_seconds(self) -> float:
        """CPU time this thread spent since the last call began: the guest's own work
        (MLX's model work runs on MLX's threads, and waiting for a step or for a
        busy CPU costs none, so a loaded machine does not make a guest look slow;
        nor does a garbage collection that happened to run in one of its calls, nor
        the host's own work inside its kv_prefill and kv_decode calls)."""
        return time.thread_time() - gc_cpu_seconds() - self._call_cpu - self._host_cpu

    def cpu_seconds_over(self, budget: float) -> float | None:
        """:meth:`cpu_seconds` where it is over ``budget``, else None. The call's wall
        time less the host's bounds it from above (the guest's CPU, less the host's
        and the collector's, is part of that wall), and reading it costs no system
        call: a thread's CPU clock does, and under load each is a chance for the OS
        to run another thread while this one holds the GIL."""
        if time.perf_counter() - self._call_start - self._host_time <= budget:
            return None
        spent = self.cpu_seconds()
        return spent if spent > budget else None

    def host_compute(self, seconds: float, cpu: float = 0.0) -> None:
        """Host functions report model time (wall, and ``cpu`` of this thread) so it
        does not count against the guest's deadline or its step budget."""
        self._host_time += seconds
        self._host_cpu += cpu
        used = (time.perf_counter() - self._call_start) - self._host_time
        remaining = self._deadline_ms / 1000 - used
        if remaining <= 0:
            raise GuestAbiError(f"exceeded its deadline of {self._deadline_ms:g} ms "
                                f"in {self._export}()")
        wasm_calls.set_deadline(self._context, self._ticks(remaining))

    def _describe(self, t: wt.Trap) -> str:
        code = t.trap_code
        where = f"in {self._export}()"
        arena = self.engine.creator.arenas.get(self._arena_key) if self._arena_key else None
        grow = ""
        if arena is not None and arena.refused_grow:
            grow = (f" after memory.grow to {arena.refused_grow / 2**20:.1f} MiB was refused "
                    f"(memory cap {arena.cap / 2**20:.1f} MiB)")
        if code == wt.TrapCode.INTERRUPT:
            return f"exceeded its deadline of {self._deadline_ms:g} ms {where}"
        if code == wt.TrapCode.STACK_OVERFLOW:
            return f"exhausted its wasm stack limit ({self.engine.stack_bytes // 1024} KiB) {where}"
        if code == wt.TrapCode.MEMORY_OUT_OF_BOUNDS:
            return f"out-of-bounds memory access {where}{grow}"
        if code == wt.TrapCode.UNREACHABLE:
            return f"aborted (unreachable) {where}{grow}"
        name = code.name.lower().replace("_", " ") if code is not None else "trap"
        return f"trapped: {name} {where}{grow}"

    def close(self) -> None:
        """Drop the instance and store; the arena is released with the store."""
        self._funcs.clear()
        self.host = None  # type: ignore[assignment]
        self._exports = None  # type: ignore[assignment]
        self.memory = None  # type: ignore[assignment]
        self.instance = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]
        self.dead = self.dead or "closed"

    def __enter__(self) -> "Guest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _np_dtype(dtype):
    import mlx.core as mx

    return {mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32,
            mx.uint32: np.uint32, mx.uint8: np.uint8, mx.int8: np.int8}[dtype]
