"""The accelerator issue's CPU side: the dtype policy (float16 KV sessions,
checkpoints and migrations between hosts of different dtypes, refusals), the
transfer path (bit-exact, large, its figures reported) and the 8k regression
(a live migration of a long conversation mid-reply, followed by the client)."""

import os

import mlx.core as mx
import numpy as np
import pytest

from kvferry import CheckpointError, Client
from kvferry.checkpoint.mlxbits import cast_bits
from kvferry.checkpoint.snapshot import save
from kvferry.device import KERNEL_CACHE, current, keep_kernels, weight_policy
from kvferry.host import ModelHost
from kvferry.params import SamplingParams
from kvferry.server import HostServer
from test_migration_faults import reading

TOKEN = "accel"


def test_the_device_and_its_policy_are_reported():
    d = current()
    assert d.kind == "cpu" and d.backend == "cpu" and not d.is_gpu  # CI has no GPU
    assert weight_policy(d) == "float32"
    assert {"kind", "backend", "name", "memory_gb"} <= set(d.as_dict())


@pytest.mark.parametrize("preset, expect", [(None, "0"), ("1", "1")])
def test_cudnn_attention_is_off_unless_the_user_set_it(preset, expect):
    """kvferry turns MLX CUDA's cuDNN attention off before MLX loads (a graph build per
    new shape: ~65 ms a prompt chunk and in a migrated session's pause on an H200),
    and leaves an explicit setting alone."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_USE_CUDNN_SDPA"}
    if preset is not None:
        env["MLX_CUDA_USE_CUDNN_SDPA"] = preset
    out = subprocess.run([sys.executable, "-c", "import kvferry, os; print(os.environ['MLX_CUDA_USE_CUDNN_SDPA'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expect


def test_cast_bits_widens_exactly_and_narrows_only_when_exact():
    x = np.array([0.5, -2.25, 1e-3, 65504.0], np.float16)
    wide, dt = cast_bits(x.view(np.uint16)[None], "float16", "float32", "t")
    assert dt == "float32" and np.array_equal(wide.view(np.float32)[0], x.astype(np.float32))
    back, dt = cast_bits(wide, "float32", "float16", "t")
    assert dt == "float16" and np.array_equal(back, x.view(np.uint16)[None])
    with pytest.raises(CheckpointError, match="does not fit float16 exactly"):
        cast_bits(np.array([[0.1]], np.float32).view(np.uint32), "float32", "float16", "keys")
    b16 = (np.array([[1.5, -3.0]], np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w, _ = cast_bits(b16, "bfloat16", "float32", "t")
    assert np.array_equal(w.view(np.float32), [[1.5, -3.0]])


@pytest.fixture(scope="module")
def hosts(tiny_model):
    """A float32 host and a float16 host of one model (same fingerprint)."""
    h32 = ModelHost(str(tiny_model), progress=False)
    h16 = ModelHost(str(tiny_model), progress=False, dtype="float16")
    yield h32, h16
    h32.close()
    h16.close()


def test_float16_sessions_checkpoint_and_land_on_float32_and_back(hosts, tmp_path):
    h32, h16 = hosts
    assert (h32.lm.dtype, h16.lm.dtype) == ("float32", "float16")
    assert h32.lm.fingerprint == h16.lm.fingerprint
    s = h16.create_session(None, SamplingParams(max_tokens=8, ignore_eos=True))
    "".join(e.text for e in s.send("hello there"))
    assert s.cache[0].keys.dtype == mx.float16
    save(s, tmp_path / "f16.kvf", "raw")
    wide = h32.load(tmp_path / "f16.kvf", session_id="wide")
    assert wide.cache[0].keys.dtype == mx.float32
    n = s.cache[0].offset
    for a, b in zip(s.cache, wide.cache):  # widened exactly
        assert mx.array_equal(a.keys[..., :n, :].astype(mx.float32), b.keys[..., :n, :]).item()
    save(wide, tmp_path / "wide.kvf", "lossless")
    back = h16.load(tmp_path / "wide.kvf", session_id="back")  # float32 values that were float16: exact
    for a, b in zip(s.cache, back.cache):
        assert b.keys.dtype == mx.float16 and mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
    # a turn computed in float32 makes KV float16 cannot hold: refused in one line
    "".join(e.text for e in wide.send("and more"))
    save(wide, tmp_path / "turned.kvf", "raw")
    with pytest.raises(CheckpointError, match=r"KV is float32 and does not fit float16 exactly.*--dtype float32"):
        h16.load(tmp_path / "turned.kvf", session_id="refused")
    assert "refused" not in h16.sessions
    for x in (s, wide, back):
        x.close()


def test_migration_between_dtypes_over_grpc(hosts):
    h32, h16 = hosts
    a, b = (HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in (h16, h32))
    a.peers, b.peers = (b.address,), (a.address,)
    try:
        c = Client(a.address, TOKEN)
        s = c.create_session(max_tokens=6, ignore_eos=True)
        "".join(s.send("hello"))
        m = s.migrate(to=b.address, live=False, mode="raw")
        assert m.transfer_mb_s > 0 and {"extract", "encode", "wire", "land", "transfer"} <= set(m.phases_ms)
        assert h32.sessions[s.id].cache[0].keys.dtype == mx.float32
        "".join(s.send("go on"))  # computed in float32 now: it cannot go back to the float16 host
        with pytest.raises(Exception, match="does not fit float16 exactly"):
            s.migrate(to=a.address, live=False, mode="raw")
        assert s.id in h32.sessions and s.id not in h16.sessions  # it stays, exactly once
        s.close()
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    from tinyllama import write_tiny_gguf

    from kvferry.convert import import_gguf

    d = tmp_path_factory.mktemp("long")
    write_tiny_gguf(d / "tiny-long.gguf", context=9000)
    return import_gguf(d / "tiny-long.gguf", d / "tiny-long", progress=False)


def test_large_raw_transfer_is_bit_exact(long_model):
    """A long conversation's KV, moved raw: every layer lands bit for bit."""
    hs = [ModelHost(str(long_model), progress=False) for _ in range(2)]
    a, b = (HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in hs)
    a.peers, b.peers = (b.address,), (a.address,)
    try:
        c = Client(a.address, TOKEN)
        s = c.create_session(max_tokens=2, ignore_eos=True)
        "".join(s.send("the lighthouse keeper wrote " * 280))  # ~7.8k tokens
        src = hs[0].sessions[s.id]
        want = [(np.array(x.keys[..., :x.offset, :]), np.array(x.values[..., :x.offset, :])) for x in src.cache]
        m = s.migrate(to=b.address, live=False, mode="raw")
        got = hs[1].sessions[s.id].cache
        assert m.raw_kv_bytes == sum(k.nbytes + v.nbytes for k, v in want)
        for (k, v), x in zip(want, got):
            assert np.array_equal(k, np.array(x.keys[..., :x.offset, :]))
            assert np.array_equal(v, np.array(x.values[..., :x.offset, :]))
        s.close()
    finally:
        a.stop()
        b.stop()
        for h in hs:
            h.close()


def test_live_migration_at_8k_tokens_mid_reply_is_followed(long_model):
    """The 8k regression: on the H200 a live migration of a ~8k-token conversation
    mid-reply lost its session ("unknown session"). Here: the reply streams on
    across the move and equals an unmigrated twin's, the same handle's later
    calls (info, send, close) follow it, and it exists on exactly one host."""
    hs = [ModelHost(str(long_model), progress=False) for _ in range(2)]
    a, b = (HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in hs)
    a.peers, b.peers = (b.address,), (a.address,)
    try:
        c = Client(a.address, TOKEN)
        text = "log entry: wind, ships, birds. " * 285  # ~8.3k byte-level tokens
        s = c.create_session(max_tokens=120, ignore_eos=True)
        twin = c.create_session(max_tokens=120, ignore_eos=True)
        "".join(s.send(text, max_tokens=1))
        "".join(twin.send(text, max_tokens=1))
        assert s.info()["tokens"] >= 8192
        ref = [ch.token for ch in twin.events("continue") if ch.token >= 0]
        th, got = reading(s, "continue", first=8)
        m = Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True, mode="raw", rate_mb_s=200)
        th.join(120)
        assert m.target == b.address and m.tokens >= 8192
        assert got == ref and len(got) == 120
        assert s.id in hs[1].sessions and s.id not in hs[0].sessions
        assert s.info()["tokens"] >= 8192 + 120
        assert len("".join(s.send("one more", max_tokens=4))) > 0
        s.close()
        assert s.id not in hs[1].sessions and s.id not in hs[0].sessions
        twin.close()
    finally:
        a.stop()
        b.stop()
        for h in hs:
            h.close()


def test_bench_shape_builds_a_loadable_model_of_the_shape(monkeypatch, tmp_path, smollm_dir):
    """`kvferry bench shape`: the shape's dimensions, SmolLM2's tokenizer, random
    weights, loadable and able to generate (here host-proxy, the 1B shape's family
    shrunk to 2 layers of width 64)."""
    from kvferry.bench import shape
    from kvferry.models import load

    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path))
    r = shape.build("host-proxy")
    assert r["built"] and r["name"] == "host-proxy-random" and r["parameters"] < 5_000_000
    assert shape.build("host-proxy")["built"] is False  # already there: reused
    lm = load("host-proxy-random", progress=False)
    assert lm.config["num_key_value_heads"] == 2 and lm.kv_heads == 2 and lm.head_dim == 16
    assert lm.tokenizer.vocab_size == load(None, progress=False).tokenizer.vocab_size
    h = ModelHost(lm=lm, progress=False)
    s = h.create_session(None, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len([e for e in s.send("hello") if e.token >= 0]) == 3
    h.close()


def test_compiled_gpu_kernels_are_kept_under_kvferry_home_per_mlx_version(tmp_path, monkeypatch):
    from importlib import metadata

    monkeypatch.delenv(KERNEL_CACHE, raising=False)
    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path))
    want = tmp_path / "mlx-kernels" / metadata.version("mlx")
    assert keep_kernels() == str(want) == os.environ[KERNEL_CACHE]  # read by MLX at its first compile
    monkeypatch.setenv(KERNEL_CACHE, str(tmp_path / "mine"))
    assert keep_kernels() == str(tmp_path / "mine")  # the user's own setting wins


def test_unified_memory_bench_runs():
    """bench/unified_memory.py (a KV batch read and landed, with and without the
    prefetch): every pair runs, its reads check the bytes, and on a CPU the
    prefetch reports itself unavailable."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "unified_memory.py"
    r = subprocess.run([sys.executable, str(script), "--mb", "2", "--reps", "1", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["prefetch"] is False and out["device"]["kind"] == "cpu"
    for k in ("read", "next_kernel_after", "land"):
        assert out[f"{k}_plain_ms"] > 0 and out[f"{k}_prefetched_ms"] > 0
    assert out["copy_engine"] is False and not any(k.startswith("engine_") for k in out)


def test_unified_memory_bench_copy_engine_rows(monkeypatch):
    """The bench's copy-engine rows, run against a stand-in runtime that copies for
    real over host pointers: each read checks its bytes, the kept page-locked blocks
    are locked once, the pageable ones never."""
    import importlib.util
    from pathlib import Path

    from fake_cuda import FakeCudaRuntime
    from kvferry.checkpoint import unified

    rt = FakeCudaRuntime()
    monkeypatch.setitem(unified._state, "runtime", rt)
    monkeypatch.setitem(unified._state, "loaded", True)
    path = Path(__file__).resolve().parent.parent / "bench" / "unified_memory.py"
    spec = importlib.util.spec_from_file_location("unified_memory_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.measure(7, 2)  # two rooms of 3 MB
    assert out["copy_engine"] is True
    for k in ("read_fresh", "read_kept_pinned", "read_kept_pageable", "land_pageable", "land_pinned"):
        assert out[f"engine_{k}_ms"] > 0
    assert out["engine_read_kept_pinned_cold_ms"] > 0 and len(out["samples_ms"]["engine_read_fresh_ms"]) == 2
    side = 3 * 8192 * 64 * 2
    assert rt.pinned == [64 << 20, side]  # one kept block (both rooms in one batch), the landing's source
    assert sum(rt.copies) == (3 * 3 + 2 * 2) * 2 * side  # reads: 3 kinds x 3 reps; lands: 2 x 2; 2 rooms each
