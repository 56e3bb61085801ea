"""Wasm guests on MLX arenas: zero-copy identity, ABI checks, sandbox limits."""

import gc
import json
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

from kvferry.guests import GUESTS_DIR
from kvferry.abi import V1
from kvferry.guest import GuestEngine, GuestError, GuestLimits, GuestTrap

# A trampoline guest: each export forwards to one host function, so tests can
# put descriptors in guest memory from Python and call the ABI directly.
TRAMPOLINE = """
(module
  (import "kvferry" "kv_matmul" (func $mm (param i32 i32 i32) (result i32)))
  (import "kvferry" "kv_softmax" (func $sm (param i32 i32 f32) (result i32)))
  (import "kvferry" "kv_topk" (func $tk (param i32 i32 i32 i32) (result i32)))
  (import "kvferry" "kv_random" (func $rnd (param i32 i32)))
  (import "kvferry" "kv_clock_ns" (func $clk (result i64)))
  (import "kvferry" "kv_log" (func $log (param i32 i32 i32)))
  (import "kvferry" "kv_prefill" (func $pf (param i32 i32) (result i32)))
  (memory (export "memory") 2 16)
  (func (export "kvferry_abi_version") (result i32) i32.const 1)
  (func (export "matmul") (param i32 i32 i32) (result i32)
    local.get 0 local.get 1 local.get 2 call $mm)
  (func (export "softmax") (param i32 i32 f32) (result i32)
    local.get 0 local.get 1 local.get 2 call $sm)
  (func (export "topk") (param i32 i32 i32 i32) (result i32)
    local.get 0 local.get 1 local.get 2 local.get 3 call $tk)
  (func (export "random") (param i32 i32) local.get 0 local.get 1 call $rnd)
  (func (export "clock") (result i64) call $clk)
  (func (export "log") (param i32 i32) i32.const 1 local.get 0 local.get 1 call $log)
  (func (export "prefill") (param i32 i32) (result i32) local.get 0 local.get 1 call $pf)
)
"""

HOSTILE = """
(module
  (memory (export "memory") 1)
  (func (export "kvferry_abi_version") (result i32) i32.const 1)
  (func (export "spin") (loop $l br $l))
  (func $rec (export "recurse") (param i32) (result i32)
    local.get 0 i32.const 1 i32.add call $rec)
  (func (export "grow") (param i32) (result i32)
    local.get 0 memory.grow
    i32.const -1 i32.eq
    if unreachable end
    i32.const 0)
  (func (export "oob") (result i32) i32.const 0x7ffffff0 i32.load)
)
"""


@pytest.fixture(scope="module")
def engine():
    e = GuestEngine(V1, stack_bytes=512 << 10)
    yield e
    e.close()


@pytest.fixture()
def gemm(engine):
    g = engine.instantiate(engine.compile(GUESTS_DIR / "gemm.wasm"), "gemm")
    yield g
    g.close()


def desc(offset, dtype, *shape):
    dims = list(shape) + [0] * (4 - len(shape))
    return np.array([offset, dtype, len(shape), *dims], dtype=np.uint32).tobytes()


def test_gemm_guest_zero_copy(gemm):
    assert gemm.call("run") == 0
    assert gemm.host.logs == [(1, "gemm: 128x128 product verified by the guest")]
    # wasmtime's memory base is the MLX array's buffer
    assert gemm.base_address() == gemm.arena.ptr
    assert gemm.base_address() == int(np.array(gemm.arena.array, copy=False).ctypes.data)
    # an MLX view of the guest's matrix A: same address, the bytes the guest wrote
    a_off = gemm.call("gemm_ptr", 0)
    a = gemm.view(a_off, mx.float32, (128, 128))
    assert int(np.array(a, copy=False).ctypes.data) == gemm.arena.ptr + a_off
    i, j = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    assert np.array_equal(np.array(a), (((i * 7 + j * 3) % 17) - 8) * 0.25)
    # and the guest sees what the host writes through the same bytes
    gemm.write(a_off, np.zeros(4, np.float32))
    assert float(gemm.view(a_off, mx.float32, (4,)).sum()) == 0.0


def test_memory_growth_stays_in_place(gemm):
    before = gemm.base_address()
    off = gemm.call("region_fill", 4 << 20)
    assert off > 0 and gemm.memory_size >= off + (4 << 20)
    assert gemm.base_address() == before == gemm.arena.ptr
    region = gemm.view(off, mx.uint8, (4 << 20,))
    expect = (np.arange(4 << 20, dtype=np.uint64) * 31 + 7).astype(np.uint8)
    assert np.array_equal(np.array(region), expect)


def test_arena_per_guest_and_released(engine):
    """1,000 create/destroy cycles leave no arena and no MLX memory behind."""
    small = '(module (memory (export "memory") 1 2) (func (export "kvferry_abi_version") (result i32) i32.const 1))'
    module = engine.compile(small.encode(), "small")
    for _ in range(20):  # warm-up
        engine.instantiate(module).close()
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory()
    base_live = engine.live_arenas
    guests = [engine.instantiate(module, f"g{i}") for i in range(3)]
    assert len({g.arena.ptr for g in guests}) == 3
    assert engine.live_arenas == base_live + 3
    for g in guests:
        g.close()
    for i in range(1000):
        g = engine.instantiate(module, f"cycle{i}")
        g.call("kvferry_abi_version")
        g.close()
    gc.collect()
    mx.clear_cache()
    assert engine.live_arenas == base_live
    assert mx.get_active_memory() <= active + (1 << 20)


ENGINE_OUTLIVED = """
import gc, time
from kvferry.guest import GuestEngine
engine = GuestEngine(None)
module = engine.compile(b'(module (memory (export "memory") 1))')
guest = engine.instantiate(module)
kept, arena = module.module, guest.arena
del guest, module, engine
gc.collect(); time.sleep(0.3); gc.collect()  # the engine's ticker has let go of it
del kept  # the last hold on wasmtime's engine: it finalizes its memory creator now
gc.collect()
print("alive", arena.cap)
"""


def test_a_compiled_module_may_outlive_its_engine():
    """wasmtime calls the memory creator's finalizer when the *last* holder of its
    engine goes, which may be a module kept after the GuestEngine was collected.
    That call once jumped into a freed callback: a segfault, seen in CI."""
    out = subprocess.run([sys.executable, "-c", ENGINE_OUTLIVED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "alive"


@pytest.fixture()
def tramp(engine):
    g = engine.instantiate(engine.compile(TRAMPOLINE.encode(), "tramp"), "tramp")
    yield g
    g.close()


def test_abi_matmul_softmax_topk(tramp):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 5), np.float32), rng.standard_normal((5, 4), np.float32)
    tramp.write(1024, a)
    tramp.write(2048, b)
    tramp.write(0, desc(1024, 0, 3, 5) + desc(2048, 0, 5, 4) + desc(4096, 0, 3, 4))
    assert tramp.call("matmul", 0, 28, 56) == 0
    out = np.frombuffer(tramp.read(4096, 48), np.float32).reshape(3, 4)
    assert np.allclose(out, a @ b, atol=1e-5)

    x = rng.standard_normal(100).astype(np.float32)
    tramp.write(8192, x)
    tramp.write(0, desc(8192, 0, 100) + desc(12288, 0, 100))
    assert tramp.call("softmax", 0, 28, 0.5) == 0
    sm = np.frombuffer(tramp.read(12288, 400), np.float32)
    e = np.exp((x - x.max()) / 0.5)
    assert np.allclose(sm, e / e.sum(), atol=1e-6)

    assert tramp.call("topk", 0, 5, 16384, 16448) == 0
    ids = np.frombuffer(tramp.read(16384, 20), np.int32)
    vals = np.frombuffer(tramp.read(16448, 20), np.float32)
    assert list(ids) == list(np.argsort(-x)[:5]) and np.allclose(vals, np.sort(x)[::-1][:5])


def test_abi_random_clock_log(tramp):
    tramp.call("random", 100, 64)
    r1 = tramp.read(100, 64)
    tramp.call("random", 100, 64)
    assert r1 != tramp.read(100, 64) and r1 != bytes(64)
    t1 = tramp.call("clock")
    assert tramp.call("clock") >= t1 > 0
    tramp.write(500, "héllo".encode())
    tramp.call("log", 500, len("héllo".encode()))
    assert tramp.host.logs[-1] == (1, "héllo")


@pytest.mark.parametrize("setup,args,message", [
    (lambda g: None, (0xFFFFFFF0, 28, 56),
     "kv_matmul: a (descriptor) = 0xfffffff0 + 28 bytes is outside guest memory (131072 bytes)"),
    (lambda g: g.write(0, desc(0x7FFF0000, 0, 4, 4) * 3), (0, 28, 56),
     "kv_matmul: a.offset = 0x7fff0000 + 64 bytes is outside guest memory (131072 bytes)"),
    (lambda g: g.write(0, desc(1024, 9, 4, 4) * 3), (0, 28, 56),
     "kv_matmul: a.dtype = 9 is not a kvferry dtype (0..6)"),
    (lambda g: g.write(0, desc(1026, 0, 4, 4) * 3), (0, 28, 56),
     "kv_matmul: a.offset = 0x402 is not 4-byte aligned"),
    (lambda g: g.write(0, desc(1024, 0, 4, 3) + desc(2048, 0, 4, 4) + desc(4096, 0, 4, 4)), (0, 28, 56),
     "kv_matmul: a.shape [4, 3] and b.shape [4, 4] do not multiply"),
    (lambda g: g.write(0, desc(1024, 0, 4, 4) * 2 + desc(4096, 0, 4, 5)), (0, 28, 56),
     "kv_matmul: out.shape [4, 5] should be [4, 4]"),
    (lambda g: g.write(0, np.array([1024, 0, 5, 2, 2, 2, 2], np.uint32).tobytes()), (0, 0, 0),
     "kv_matmul: a.ndim = 5, must be 1..4"),
    (lambda g: g.write(0, desc(1024, 3, 4, 4) * 3), (0, 28, 56),
     "kv_matmul: dtypes i32, i32, i32 must be one float dtype (f32, f16, bf16)"),
    # an export of another signature (f32 here) goes through wasmtime-py's checked
    # call: its host function's error is still the one-line message
    (lambda g: None, ("softmax", 0xFFFFFFF0, 28, 0.5),
     "kv_softmax: x (descriptor) = 0xfffffff0 + 28 bytes is outside guest memory (131072 bytes)"),
])
def test_host_functions_check_arguments(engine, setup, args, message):
    export, args = (args[0], args[1:]) if isinstance(args[0], str) else ("matmul", args)
    g = engine.instantiate(engine.compile(TRAMPOLINE.encode(), "tramp"), "bad-args")
    setup(g)
    with pytest.raises(GuestTrap) as e:
        g.call(export, *args)
    assert str(e.value) == f"guest 'bad-args': {message}"
    with pytest.raises(GuestTrap, match="unusable after an earlier failure"):
        g.call(export, *args)
    g.close()


def test_host_function_errors_stay_with_their_guest(engine):
    """A host function's exception crosses back to its own guest's call only
    (kvferry.wasm_calls keeps it per guest): a guest failing on one thread never
    hands its error to another guest calling at the same time."""
    module = engine.compile(TRAMPOLINE.encode(), "tramp")
    good = [engine.instantiate(module, f"good-{i}") for i in range(2)]
    errors = []

    def work(g):
        g.write(1024, np.ones((2, 2), np.float32))
        g.write(0, desc(1024, 0, 2, 2) * 2 + desc(2048, 0, 2, 2))
        try:
            for _ in range(300):
                assert g.call("matmul", 0, 28, 56) == 0
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(g,)) for g in good]
    for t in threads:
        t.start()
    for i in range(30):
        bad = engine.instantiate(module, f"bad-{i}")
        with pytest.raises(GuestTrap, match="outside guest memory"):
            bad.call("matmul", 0xFFFFFFF0, 28, 56)
        short = engine.instantiate(module, f"arity-{i}")
        with pytest.raises(GuestTrap, match="too few|2 arguments"):
            short.call("matmul", 0, 28)
        bad.close()
        short.close()
    for t in threads:
        t.join()
    assert errors == []
    assert np.array_equal(np.frombuffer(good[0].read(2048, 16), np.float32), np.full(4, 2, np.float32))
    for g in good:
        g.close()


def test_model_imports_need_a_model(tramp):
    with pytest.raises(GuestTrap, match="kv_prefill: no model attached to this guest"):
        tramp.call("prefill", 0, 1)


def _other_guest_still_works(engine):
    g = engine.instantiate(engine.compile(GUESTS_DIR / "gemm.wasm"), "bystander")
    assert g.call("run") == 0
    g.close()


@pytest.mark.parametrize("export,args,limits,message", [
    ("spin", (), GuestLimits(deadline_ms=200), "guest 'hostile': exceeded its deadline of 200 ms in spin()"),
    ("recurse", (0,), GuestLimits(), "guest 'hostile': exhausted its wasm stack limit (512 KiB) in recurse()"),
    ("grow", (100,), GuestLimits(memory_cap=1 << 20),
     "guest 'hostile': aborted (unreachable) in grow() after memory.grow to 6.3 MiB was refused "
     "(memory cap 1.0 MiB)"),
    ("oob", (), GuestLimits(), "guest 'hostile': out-of-bounds memory access in oob()"),
])
def test_hostile_guests(engine, export, args, limits, message):
    g = engine.instantiate(engine.compile(HOSTILE.encode(), "hostile.wat"), "hostile", limits)
    bystander = engine.instantiate(engine.compile(GUESTS_DIR / "gemm.wasm"), "bystander")
    with pytest.raises(GuestTrap) as e:
        g.call(export, *args)
    assert str(e.value) == message
    assert bystander.call("run") == 0  # same process, same engine: unaffected
    bystander.close()
    g.close()
    _other_guest_still_works(engine)


def test_memory_minimum_over_cap(engine):
    big = '(module (memory (export "memory") 64) (func (export "kvferry_abi_version") (result i32) i32.const 1))'
    with pytest.raises(GuestError, match=r"guest 'big' needs 4.0 MiB of memory at start, over its cap of 1.0 MiB"):
        engine.instantiate(engine.compile(big.encode(), "big.wat"), "big", GuestLimits(memory_cap=1 << 20))
    _other_guest_still_works(engine)


@pytest.mark.parametrize("wat,message", [
    ('(module (import "kvferry" "kv_nope" (func)) (memory (export "memory") 1))',
     "m.wasm: imports kvferry.kv_nope, which ABI v1 does not have"),
    ('(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32))) '
     '(memory (export "memory") 1))',
     "m.wasm: imports wasi_snapshot_preview1.fd_write, which is not part of the kvferry ABI "
     "(no WASI in the kvferry sandbox)"),
    ('(module (import "kvferry" "kv_log" (func (param i32))) (memory (export "memory") 1))',
     "m.wasm: import kvferry.kv_log has type (i32) -> (), ABI v1 declares (i32, i32, i32) -> ()"),
    ('(module (memory (export "memory") 1))', "m.wasm: missing export 'kvferry_abi_version'"),
    ('(module (func (export "kvferry_abi_version") (result i32) i32.const 1))', "m.wasm: missing export 'memory'"),
    ('(module (memory (export "memory") 1) (func (export "kvferry_abi_version") (result i32) i32.const 1) '
     '(func (export "kvferry_chat_step") (result i32) i32.const 0))',
     "m.wasm: missing export 'kvferry_buffer' (a chat guest exports kvferry_buffer, kvferry_chat_config, "
     "kvferry_chat_begin, kvferry_chat_step)"),
])
def test_abi_check_rejects(engine, wat, message):
    with pytest.raises(GuestError) as e:
        engine.compile(wat.encode(), "m.wasm")
    assert str(e.value) == message


def test_version_mismatch(engine):
    wat = '(module (memory (export "memory") 1) (func (export "kvferry_abi_version") (result i32) i32.const 2))'
    with pytest.raises(GuestError, match="v2.wasm: guest ABI version 2, this host supports 1"):
        engine.instantiate(engine.compile(wat.encode(), "v2.wasm"))


def test_malformed_wasm(engine):
    data = (GUESTS_DIR / "gemm.wasm").read_bytes()
    with pytest.raises(GuestError, match=r"^cut.wasm: not a valid WebAssembly module \("):
        engine.compile(data[: len(data) // 2], "cut.wasm")
    with pytest.raises(GuestError, match=r"no \\0asm magic"):
        engine.compile(b"\x7fELF" + data, "elf.wasm")
    _other_guest_still_works(engine)


def kvferry(*args):
    return subprocess.run([sys.executable, "-m", "kvferry", *args], capture_output=True, text=True)


def test_guest_check_cli(tmp_path):
    r = kvferry("guest", "check", str(GUESTS_DIR / "chat.wasm"))
    assert r.returncode == 0 and r.stdout.startswith("chat.wasm: ok: kvferry ABI v1, chat guest")
    bad = tmp_path / "bad.wasm"
    bad.write_bytes((GUESTS_DIR / "gemm.wasm").read_bytes()[:100])
    r = kvferry("guest", "check", str(bad))
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("bad.wasm: not a valid")


def test_committed_guests_are_reproducible(tmp_path):
    from kvferry.guests.build import GUESTS, build

    for name in GUESTS:
        out = build(name, tmp_path)
        assert out.read_bytes() == (GUESTS_DIR / f"{name}.wasm").read_bytes(), (
            f"{name}.wasm is stale: run `make guests`")


def test_bench_zero_copy_runs():
    r = kvferry("bench", "zero-copy", "--json", "--reps", "5")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pointer_identity"] is True and out["copy_path_distinct_address"] is True
    assert out["errors"] == 0 and out["region_same_bytes"] is True
    for k in ("rss_delta_mb_zero_copy", "rss_delta_mb_copy", "gemm_ms_zero_copy", "gemm_ms_copy"):
        assert isinstance(out[k], float)


def test_compiled_modules_are_bounded_and_only_valid_ones_kept():
    """The engine's module cache is an LRU of valid modules: a flood of distinct
    uploads cannot grow it, and a module that fails the ABI check is not cached."""
    from kvferry.abi import engine as make_engine
    from kvferry.errors import GuestError

    eng = make_engine()
    eng.max_modules = 2
    base = '(module (memory (export "memory") 1) (func (export "kvferry_abi_version") (result i32) i32.const {}))'
    for v in range(5):
        eng.compile(base.format(v).encode())
    assert len(eng._modules) == 2
    with pytest.raises(GuestError, match="missing export"):
        eng.compile(b'(module (memory (export "memory") 1))')
    assert len(eng._modules) == 2
    with pytest.raises(GuestError, match="start function"):
        eng.compile(b'(module (memory (export "memory") 1) (func $s) (start $s))')
