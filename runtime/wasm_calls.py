"""Calls across the wasm boundary for the ABI's fixed signatures, through
wasmtime's unchecked C API.

wasmtime-py's generic path asks the C API for a function's type on every call,
builds a ``Val`` per argument and result, and on each host-function return makes
new ``ValType`` objects to compare with: a dozen foreign calls per crossing, each
of which lets go of the GIL. A chat guest crosses three times a token (its step,
``kv_decode``, ``kv_logits_topk``), and at 64 sessions a host's step thread spent
more time there than in the model (docs/performance-log.md, "Guest calls"). Here the
types are checked once, when a guest is linked or an export first called, and a
crossing is one foreign call that reads and writes raw values in place.

A host function's exception travels as wasmtime-py's does (a trap whose Python
exception is re-raised after the call), but per guest instead of in one global.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any, Callable

import wasmtime as wt
from wasmtime import _ffi as ffi

_RAW = ffi.wasmtime_val_raw_t
_RAW_TYPES = ("i32", "i64", "f32")  # value types a host function may take: wasmtime_val_raw_t's members
_CALLBACKS: dict[int, tuple[Callable, tuple[str, ...], str | None, "Crossing"]] = {}
_ids = itertools.count(1)

# Small calls that cannot block keep the GIL: through a CDLL each one would let go
# of it and then wait for it again behind every runnable thread of the host.
_keep_gil = ctypes.PyDLL(ffi.dll._name)
_set_deadline = _keep_gil.wasmtime_context_set_epoch_deadline
_set_deadline.restype = None
_set_deadline.argtypes = [ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_uint64]


class Crossing:
    """One guest's side of the boundary: the exception a host function raised
    during the current call, re-raised once the call returns."""

    def __init__(self) -> None:
        self.raised: BaseException | None = None


def signature(ft: wt.FuncType) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(str(p) for p in ft.params), tuple(str(r) for r in ft.results)


@ffi.wasmtime_func_unchecked_callback_t
def _trampoline(env, caller, raw, n):  # type: ignore[no-untyped-def]
    fn, params, result, crossing = _CALLBACKS[env or 0]
    try:
        out = fn(*[getattr(raw[i], k) for i, k in enumerate(params)])
        if result is not None:
            setattr(raw[0], result, out)
        return 0
    except BaseException as e:  # noqa: BLE001 - re-raised on the caller's side of the call
        crossing.raised = e
        return ctypes.cast(wt.Trap("python exception")._consume(), ctypes.c_void_p).value or 0


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _forget(env):  # type: ignore[no-untyped-def]
    _CALLBACKS.pop(env or 0, None)


def define(linker: wt.Linker, module: str, name: str, params: tuple[str, ...], results: tuple[str, ...],
           fn: Callable, crossing: Crossing) -> None:
    """``linker.define_func`` for a host function of value types i32/i64/f32 and at
    most one result, called with plain Python numbers."""
    if any(t not in _RAW_TYPES for t in params + results) or len(results) > 1:
        raise TypeError(f"host function {name}: {params} -> {results} is not a raw signature")
    ft = wt.FuncType([getattr(wt.ValType, p)() for p in params], [getattr(wt.ValType, r)() for r in results])
    key = next(_ids)
    _CALLBACKS[key] = (fn, params, results[0] if results else None, crossing)
    m, n = module.encode(), name.encode()
    err = ffi.wasmtime_linker_define_func_unchecked(linker.ptr(), ctypes.create_string_buffer(m), len(m),
                                                   ctypes.create_string_buffer(n), len(n), ft.ptr(),
                                                   _trampoline, key, _forget)
    if err:
        _CALLBACKS.pop(key, None)
        raise wt.WasmtimeError._from_ptr(err)


def export(store: wt.Store, func: wt.Func, crossing: Crossing) -> Callable[..., Any]:
    """A callable for a guest export: unchecked for the ABI's i32 signatures, else
    wasmtime-py's checked call. Either way a host function's exception is what the
    call raises."""
    params, results = signature(func.type(store))
    if all(p == "i32" for p in params) and results in ((), ("i32",)):
        return Export(store, func, crossing, len(params), bool(results))
    return _Checked(store, func, crossing)


class _Checked:
    """An export of another signature (a tool's f32 or i64), through wasmtime-py."""

    def __init__(self, store: wt.Store, func: wt.Func, crossing: Crossing):
        self.store, self.func, self.crossing = store, func, crossing

    def __call__(self, *args: Any) -> Any:
        self.crossing.raised = None
        try:
            return self.func(self.store, *args)
        except (wt.Trap, wt.WasmtimeError):
            raised, self.crossing.raised = self.crossing.raised, None
            if raised is not None:
                raise raised from None
            raise


class Export:
    """A guest export of i32 parameters and at most one i32 result, called unchecked."""

    def __init__(self, store: wt.Store, func: wt.Func, crossing: Crossing, nparams: int, returns: bool):
        self.store, self.func, self.crossing = store, func, crossing  # the store outlives its context
        self.context = store._context()
        self.nparams, self.returns = nparams, returns

    def __call__(self, *args: int) -> int | None:
        if len(args) != self.nparams:
            raise wt.WasmtimeError(f"{len(args)} arguments given, the export takes {self.nparams}")
        raw = (_RAW * max(1, self.nparams))()
        for i, a in enumerate(args):
            raw[i].i32 = a
        trap = ctypes.POINTER(ffi.wasm_trap_t)()
        self.crossing.raised = None
        err = ffi.wasmtime_func_call_unchecked(self.context, ctypes.byref(self.func._func), raw,
                                               len(raw), ctypes.byref(trap))
        raised, self.crossing.raised = self.crossing.raised, None
        if err or trap:
            # owned: freed with the objects. A host function's trap comes back as either,
            # depending on the wasmtime version; its Python exception is what happened
            failure = wt.WasmtimeError._from_ptr(err) if err else wt.Trap._from_ptr(trap)
            if raised is not None:
                raise raised
            raise failure
        return raw[0].i32 if self.returns else None


def set_deadline(context: Any, ticks: int) -> None:
    """``store.set_epoch_deadline(ticks)`` without letting go of the GIL
    (``context``: the store's ``_context()``)."""
    _set_deadline(context, ticks)
