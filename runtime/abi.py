"""The kvferry guest ABI, version 1 (import module ``kvferry``).

The C declarations and the contract in prose are in ``actor_guests/kvferry.h``
and ``actor_guests/ABI.md``. Every host function validates what the guest
passes (offsets, lengths, dtypes, shapes, alignment) against the guest's memory
and traps with a message naming the function and the bad argument.
"""

from __future__ import annotations

import math
import os
import struct
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import wasmtime as wt

from . import wasm_calls
from .errors import GuestAbiError, GuestError

if TYPE_CHECKING:
    from .guest import Guest, GuestEngine, GuestModule

ABI_VERSION = 1
IMPORT_MODULE = "kvferry"

_I32, _I64, _F32 = "i32", "i64", "f32"
IMPORTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kv_log": ((_I32, _I32, _I32), ()),
    "kv_clock_ns": ((), (_I64,)),
    "kv_random": ((_I32, _I32), ()),
    "kv_matmul": ((_I32, _I32, _I32), (_I32,)),
    "kv_softmax": ((_I32, _I32, _F32), (_I32,)),
    "kv_topk": ((_I32, _I32, _I32, _I32), (_I32,)),
    "kv_model_info": ((_I32,), (_I32,)),
    "kv_prefill": ((_I32, _I32), (_I32,)),
    "kv_decode": ((_I32,), (_I32,)),
    "kv_logits": ((_I32,), (_I32,)),
    "kv_logits_topk": ((_I32, _I32, _I32), (_I32,)),
    "kv_token_text": ((_I32, _I32, _I32), (_I32,)),
}
MLX_MATH = ("kv_matmul", "kv_softmax", "kv_topk")  # run under the compute lock
# kv_logits and kv_logits_topk(1, ...) read a step's evaluated float32 logits with numpy,
# outside the lock: at 64 sessions a step would otherwise wait behind 64 device round trips
REQUIRED_EXPORTS = ("memory", "kvferry_abi_version")
CHAT_EXPORTS = ("kvferry_buffer", "kvferry_chat_config", "kvferry_chat_begin", "kvferry_chat_step")

# dtype code -> (name, numpy dtype or None for bf16, itemsize)
DTYPES = {0: ("f32", np.float32, 4), 1: ("f16", np.float16, 2), 2: ("bf16", None, 2),
          3: ("i32", np.int32, 4), 4: ("u32", np.uint32, 4), 5: ("u8", np.uint8, 1),
          6: ("i8", np.int8, 1)}
FLOAT_CODES = (0, 1, 2)
DESC_SIZE = 28
MODEL_INFO_SIZE = 48

def _mx_dtype(code: int):
    import mlx.core as mx

    return [mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint32, mx.uint8, mx.int8][code]


def _fmt(sig) -> str:
    return f"({', '.join(sig[0])}) -> ({', '.join(sig[1])})"


def check_module(gm: "GuestModule") -> None:
    """Raise GuestError (one line) unless the module fits ABI v1's static shape."""
    for imp in gm.module.imports:
        where = f"{imp.module}.{imp.name}"
        if imp.module != IMPORT_MODULE:
            extra = " (no WASI in the kvferry sandbox)" if imp.module.startswith("wasi") else ""
            raise GuestError(f"{gm.label}: imports {where}, which is not part of the kvferry ABI{extra}")
        if imp.name not in IMPORTS:
            raise GuestError(f"{gm.label}: imports {where}, which ABI v{ABI_VERSION} does not have")
        if not isinstance(imp.type, wt.FuncType) or wasm_calls.signature(imp.type) != IMPORTS[imp.name]:
            got = _fmt(wasm_calls.signature(imp.type)) if isinstance(imp.type, wt.FuncType) else type(imp.type).__name__
            raise GuestError(f"{gm.label}: import {where} has type {got}, ABI v{ABI_VERSION} "
                             f"declares {_fmt(IMPORTS[imp.name])}")
    exports = {e.name: e.type for e in gm.module.exports}
    for name in REQUIRED_EXPORTS:
        if name not in exports:
            raise GuestError(f"{gm.label}: missing export '{name}'")
    if not isinstance(exports["memory"], wt.MemoryType):
        raise GuestError(f"{gm.label}: export 'memory' is not a memory")
    chat = [n for n in CHAT_EXPORTS if n in exports]
    if chat and len(chat) != len(CHAT_EXPORTS):
        missing = [n for n in CHAT_EXPORTS if n not in exports]
        raise GuestError(f"{gm.label}: missing export '{missing[0]}' (a chat guest exports "
                         f"{', '.join(CHAT_EXPORTS)})")
    gm.kind = "chat" if chat else "tool"


def check_version(guest: "Guest") -> int:
    v = guest.call("kvferry_abi_version")
    if v != ABI_VERSION:
        raise GuestError(f"{guest.module.label}: guest ABI version {v}, this host supports {ABI_VERSION}")
    return v


class AbiV1:
    """ABI v1 as the engine sees it (:class:`kvferry.guest.GuestAbi`)."""

    version = ABI_VERSION

    def check_module(self, gm: "GuestModule") -> None:
        check_module(gm)

    def host_functions(self, guest: "Guest") -> "HostFunctions":
        return HostFunctions(guest)

    def check_instance(self, guest: "Guest") -> None:
        check_version(guest)


V1 = AbiV1()


def engine(**kw: Any) -> "GuestEngine":
    """A guest engine speaking ABI v1 (``stack_bytes=`` as GuestEngine)."""
    from .guest import GuestEngine

    return GuestEngine(V1, **kw)


class ModelBinding(Protocol):
    """What a session gives a chat guest (see kvferry.session)."""

    def info(self) -> dict: ...
    def prefill(self, tokens: list[int]) -> None: ...  # serialises its own model work (compute lock)
    def decode(self, token: int) -> None: ...
    def ran_ahead(self, token: int) -> bool: ...  # the host decoded token already: decode() does no model work
    def logits(self) -> Any: ...  # mx.array float32 [vocab]
    def top1(self) -> tuple[int, int] | None: ...  # the logits' argmax and its float32 bits, if known
    def token_text(self, token: int) -> bytes: ...


class HostFunctions:
    """ABI v1 host functions bound to one guest."""

    def __init__(self, guest: "Guest"):
        self.g = guest
        self.logs: list[tuple[int, str]] = []
        self.log_limit = 1000

    def define(self, linker: wt.Linker) -> None:
        for name, (params, results) in IMPORTS.items():
            fn = getattr(self, name)
            wasm_calls.define(linker, IMPORT_MODULE, name, params, results,
                              self._serialised(fn) if name in MLX_MATH else fn, self.g.crossing)

    def _serialised(self, fn):
        """MLX math under the engine's compute lock (MLX work is serialised); the wait
        for other sessions' model work does not count against this guest's deadline."""
        def call(*args):
            t0 = time.perf_counter()
            with self.g.engine.compute:
                waited = time.perf_counter() - t0
                out = fn(*args)
            self.g.host_compute(waited)
            return out
        return call

    # -- argument checks ---------------------------------------------------------
    def _span(self, fn: str, arg: str, ptr: int, n: int, align: int = 1) -> int:
        size = self.g.arena.size
        ptr &= 0xFFFFFFFF
        if n < 0 or ptr + n > size:
            raise GuestAbiError(f"{fn}: {arg} = {ptr:#x} + {n} bytes is outside guest memory "
                                f"({size} bytes)")
        if ptr % align:
            raise GuestAbiError(f"{fn}: {arg} = {ptr:#x} is not {align}-byte aligned")
        return ptr

    def _tensor(self, fn: str, arg: str, desc_ptr: int) -> tuple[int, int, tuple[int, ...], int]:
        p = self._span(fn, f"{arg} (descriptor)", desc_ptr, DESC_SIZE, 4)
        offset, code, ndim, *dims = struct.unpack_from("<7I", self.g.arena.np, p)
        if code not in DTYPES:
            raise GuestAbiError(f"{fn}: {arg}.dtype = {code} is not a kvferry dtype (0..6)")
        if not 1 <= ndim <= 4:
            raise GuestAbiError(f"{fn}: {arg}.ndim = {ndim}, must be 1..4")
        shape = tuple(dims[:ndim])
        if any(d == 0 for d in shape):
            raise GuestAbiError(f"{fn}: {arg}.shape = {list(shape)} has a zero dimension")
        itemsize = DTYPES[code][2]
        nbytes = math.prod(shape) * itemsize  # Python ints: no uint64 wrap-around
        self._span(fn, f"{arg}.offset", offset, nbytes, itemsize)
        return offset, code, shape, nbytes

    def _view(self, offset: int, code: int, shape: tuple[int, ...], nbytes: int):
        return self.g.arena.array[offset:offset + nbytes].view(_mx_dtype(code)).reshape(shape)

    def _store(self, offset: int, result) -> None:
        """Write an evaluated MLX result into guest memory (the one copy: the output)."""
        import mlx.core as mx

        if result.dtype in (mx.float32, mx.float16, mx.int32, mx.uint32, mx.uint8, mx.int8):
            # numpy reads the buffer: no MLX op (and no device round trip) on the guest's thread
            raw = np.array(result, copy=False).reshape(-1).view(np.uint8)
        else:
            flat = result.reshape(-1)
            raw = np.array(flat.view(mx.uint8) if flat.dtype != mx.bool_ else flat, copy=False)
        self.g.arena.np[offset:offset + raw.size] = raw

    def _model(self, fn: str) -> ModelBinding:
        if self.g.model is None:
            raise GuestAbiError(f"{fn}: no model attached to this guest")
        return self.g.model

    # -- utilities ---------------------------------------------------------------
    def kv_log(self, level: int, ptr: int, n: int) -> None:
        n = min(n & 0xFFFFFFFF, 4096)
        p = self._span("kv_log", "msg", ptr, n)
        if len(self.logs) < self.log_limit:
            self.logs.append((level, self.g.arena.np[p:p + n].tobytes().decode("utf-8", "replace")))

    def kv_clock_ns(self) -> int:
        return time.monotonic_ns()

    def kv_random(self, ptr: int, n: int) -> None:
        n &= 0xFFFFFFFF
        p = self._span("kv_random", "buf", ptr, n)
        self.g.arena.np[p:p + n] = np.frombuffer(os.urandom(n), dtype=np.uint8)

    # -- tensors -----------------------------------------------------------------
    def kv_matmul(self, a_ptr: int, b_ptr: int, out_ptr: int) -> int:
        import mlx.core as mx

        a = self._tensor("kv_matmul", "a", a_ptr)
        b = self._tensor("kv_matmul", "b", b_ptr)
        o = self._tensor("kv_matmul", "out", out_ptr)
        if not (a[1] == b[1] == o[1]) or a[1] not in FLOAT_CODES:
            raise GuestAbiError(f"kv_matmul: dtypes {DTYPES[a[1]][0]}, {DTYPES[b[1]][0]}, "
                                f"{DTYPES[o[1]][0]} must be one float dtype (f32, f16, bf16)")
        (sa, sb, so) = a[2], b[2], o[2]
        if len(sa) < 2 or len(sb) < 2 or sa[-1] != sb[-2]:
            raise GuestAbiError(f"kv_matmul: a.shape {list(sa)} and b.shape {list(sb)} do not multiply")
        want = tuple(np.broadcast_shapes(sa[:-2], sb[:-2])) + (sa[-2], sb[-1])
        if so != want:
            raise GuestAbiError(f"kv_matmul: out.shape {list(so)} should be {list(want)}")
        if self.g.copy_mode:
            r = self._copy_in(a) @ self._copy_in(b)
        else:
            r = self._view(*a) @ self._view(*b)
        mx.eval(r)
        self._store(o[0], r)
        return 0

    def _copy_in(self, t):
        """The copy path: guest bytes copied into a fresh MLX array (for comparison)."""
        import mlx.core as mx

        offset, code, shape, nbytes = t
        raw = mx.array(self.g.arena.np[offset:offset + nbytes])  # copies
        return raw.view(_mx_dtype(code)).reshape(shape)

    def kv_softmax(self, x_ptr: int, out_ptr: int, temperature: float) -> int:
        import mlx.core as mx

        x = self._tensor("kv_softmax", "x", x_ptr)
        o = self._tensor("kv_softmax", "out", out_ptr)
        if x[1] != 0 or o[1] != 0:
            raise GuestAbiError("kv_softmax: x and out must be f32")
        if x[2] != o[2]:
            raise GuestAbiError(f"kv_softmax: out.shape {list(o[2])} != x.shape {list(x[2])}")
        if not temperature > 0 or temperature != temperature:
            raise GuestAbiError(f"kv_softmax: temperature = {temperature} must be > 0")
        r = mx.softmax(self._view(*x) / temperature, axis=-1)
        mx.eval(r)
        self._store(o[0], r)
        return 0

    def _write_topk(self, fn: str, values, k: int, ids_ptr: int, vals_ptr: int) -> int:
        import mlx.core as mx

        n = values.shape[-1]
        if not 1 <= k <= n:
            raise GuestAbiError(f"{fn}: k = {k} must be in 1..{n}")
        ip = self._span(fn, "ids", ids_ptr, 4 * k, 4)
        vp = self._span(fn, "vals", vals_ptr, 4 * k, 4)
        if k == 1:
            idx = mx.argmax(values, keepdims=True)
        else:
            idx = mx.argpartition(-values, k - 1)[:k]
            idx = idx[mx.argsort(-values[idx])]
        vals = values[idx].astype(mx.float32)
        mx.eval(idx, vals)
        self._store(ip, idx.astype(mx.int32))
        self._store(vp, vals)
        return 0

    def kv_topk(self, x_ptr: int, k: int, ids_ptr: int, vals_ptr: int) -> int:
        x = self._tensor("kv_topk", "x", x_ptr)
        if x[1] != 0 or len(x[2]) != 1:
            raise GuestAbiError(f"kv_topk: x must be 1-D f32, got {DTYPES[x[1]][0]}{list(x[2])}")
        return self._write_topk("kv_topk", self._view(*x), k & 0xFFFFFFFF, ids_ptr, vals_ptr)

    # -- model -------------------------------------------------------------------
    def kv_model_info(self, ptr: int) -> int:
        m = self._model("kv_model_info")
        p = self._span("kv_model_info", "out", ptr, MODEL_INFO_SIZE, 4)
        info = m.info()
        eos = list(info["eos"])[:8]
        data = struct.pack("<4I8i", info["vocab_size"], info["context"], info["n_tokens"], len(eos),
                           *(eos + [-1] * (8 - len(eos))))
        self.g.arena.np[p:p + MODEL_INFO_SIZE] = np.frombuffer(data, dtype=np.uint8)
        return 0

    def kv_prefill(self, ptr: int, n: int) -> int:
        m = self._model("kv_prefill")
        n &= 0xFFFFFFFF
        p = self._span("kv_prefill", "tokens", ptr, 4 * n, 4)
        tokens = self.g.arena.np[p:p + 4 * n].view(np.int32).tolist()
        self._check_ids("kv_prefill", tokens, m)
        t, cpu = time.perf_counter(), time.thread_time()
        m.prefill(tokens)  # model time is the host's (bounded by the step's budget); it takes the compute lock
        self.g.host_compute(time.perf_counter() - t, time.thread_time() - cpu)
        return 0

    def kv_decode(self, token: int) -> int:
        m = self._model("kv_decode")
        self._check_ids("kv_decode", [token], m)
        if m.ran_ahead(token):  # its logits are there: no host work to leave out of the guest's time
            m.decode(token)     # (two reads of the thread's CPU clock, a system call each, saved)
            return 0
        t, cpu = time.perf_counter(), time.thread_time()
        m.decode(token)  # (a step run ahead for another token is taken back here: the host's work)
        self.g.host_compute(time.perf_counter() - t, time.thread_time() - cpu)
        return 0

    def _check_ids(self, fn: str, tokens: list[int], m: ModelBinding) -> None:
        vocab = m.info()["vocab_size"]
        for t in tokens:
            if not 0 <= t < vocab:
                raise GuestAbiError(f"{fn}: token id {t} is outside the vocabulary (0..{vocab - 1})")

    def kv_logits(self, out_ptr: int) -> int:
        import mlx.core as mx

        m = self._model("kv_logits")
        o = self._tensor("kv_logits", "out", out_ptr)
        logits = m.logits()
        if o[1] != 0 or o[2] != (logits.shape[-1],):
            raise GuestAbiError(f"kv_logits: out must be f32[{logits.shape[-1]}], "
                                f"got {DTYPES[o[1]][0]}{list(o[2])}")
        if logits.dtype == mx.float32:
            self._store(o[0], logits)
        else:
            self._serialised(lambda: self._store(o[0], logits.astype(mx.float32)))()
        return 0

    def kv_logits_topk(self, k: int, ids_ptr: int, vals_ptr: int) -> int:
        import mlx.core as mx

        m = self._model("kv_logits_topk")
        logits, k = m.logits(), k & 0xFFFFFFFF
        if k == 1 and logits.dtype == mx.float32 and logits.ndim == 1:  # greedy: the first maximum
            ip = self._span("kv_logits_topk", "ids", ids_ptr, 4, 4)
            vp = self._span("kv_logits_topk", "vals", vals_ptr, 4, 4)
            known = m.top1()  # computed with the step (kvferry.top1): the logits stay on the device
            if known is None:
                v = np.array(logits, copy=False)
                i = int(np.argmax(v))
                known = (i, int(v[i:i + 1].view(np.int32)[0]))
            i, bits = known
            mem = self.g.arena.np
            struct.pack_into("<i", mem, ip, i)
            struct.pack_into("<i", mem, vp, bits)
            return 0
        return self._serialised(self._write_topk)("kv_logits_topk", logits, k, ids_ptr, vals_ptr)

    def kv_token_text(self, token: int, buf: int, cap: int) -> int:
        m = self._model("kv_token_text")
        self._check_ids("kv_token_text", [token], m)
        data = m.token_text(token)
        cap &= 0xFFFFFFFF
        n = min(cap, len(data))
        p = self._span("kv_token_text", "buf", buf, n)
        self.g.arena.np[p:p + n] = np.frombuffer(data[:n], dtype=np.uint8)
        return len(data)
