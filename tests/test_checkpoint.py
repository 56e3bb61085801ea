"""Checkpoints: exact resume, streaming/appending frames, and hostile files."""

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.guests import GUESTS_DIR
from kvferry.checkpoint import blob, bodies, codecs, host_blocks, kv_extract, kv_landing, quant, restore, snapshot
from kvferry.checkpoint.errors import CheckpointError
from kvferry.checkpoint.frames import HEADER, KV, STATE, TRAILER, Frame, FrameDecoder, FrameWriter, Parts, iter_frames
from kvferry.host import ModelHost
from kvferry.session import SamplingParams, SessionOptions

from fake_cuda import FakeCudaRuntime


@pytest.fixture(scope="module")
def host(tiny_model):
    h = ModelHost(str(tiny_model), progress=False)
    yield h
    h.close()


@pytest.fixture(autouse=True)
def clean_host(request):
    yield
    if "host" in request.fixturenames:
        h = request.getfixturevalue("host")
        for sid in list(h.sessions):
            h.close_session(sid)


def chat_turns(session, turns):
    return [[e.token for e in session.send(t) if e.token >= 0] for t in turns]


SAMPLINGS = [SamplingParams(max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.5, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("options", [SessionOptions(), SessionOptions(ctx=96)], ids=["kv", "rotating"])
def test_lossless_resume_is_exact(host, sampling, options, tmp_path):
    twin = host.create_session(sampling=sampling, options=options)
    a = host.create_session(sampling=sampling, options=options)
    chat_turns(twin, ["hello there", "tell me more"])
    chat_turns(a, ["hello there"])
    snapshot.save(a, tmp_path / "a.kvf")
    host.close_session(a.id)  # the original is gone: only the file remains
    b = restore.load(host, tmp_path / "a.kvf")
    assert b.id == a.id
    assert chat_turns(b, ["tell me more"]) == [twin.last.tokens]
    assert b.messages == twin.messages


def test_streamed_deltas_rebuild_the_session(host):
    """Stage 0 sends the KV so far; later stages append token ranges; then the small state."""
    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    twin = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    sn = snapshot.Snapshotter(s)
    chunks = [sn.header()]
    chat_turns(s, ["one"])
    chat_turns(twin, ["one"])
    chunks += list(sn.kv())
    n0 = sn.sent_tokens
    chat_turns(s, ["two"])
    chat_turns(twin, ["two"])
    chunks += list(sn.kv())  # delta: only tokens since stage 0
    n1 = sn.sent_tokens
    assert n1 > n0
    chat_turns(s, ["three"])
    chat_turns(twin, ["three"])
    chunks += list(sn.finish())  # the last small delta: one batch frame for all layers
    frames = [f for f in iter_frames(chunks) if f.kind == KV]
    assert "batch" in frames[-1].body and len(frames[-1].body["batch"]) == len(s.cache)
    kv_ranges = [(b["layer"], b["start"], b["end"]) for f in frames for b in f.body.get("batch", [f.body])]
    assert (0, 0, n0) in kv_ranges and (0, n0, n1) in kv_ranges and (0, n1, sn.sent_tokens) in kv_ranges
    # feed the bytes in awkward pieces, as a network would
    blob = b"".join(chunks)
    r = restore.Restorer(host, session_id="streamed")
    dec = FrameDecoder()
    for i in range(0, len(blob), 777):
        for f in dec.feed(blob[i:i + 777]):
            r.apply(f)
    dec.close()
    b = host.adopt(r.commit())
    assert chat_turns(b, ["four"]) == chat_turns(twin, ["four"])
    # a hostile batch frame is refused with one line
    for bad in (5, [], [{"batch": []}], [{}] * (len(s.cache) + 1)):
        r = restore.Restorer(host, session_id="hostile")
        r.apply(next(iter_frames([chunks[0]])))
        with pytest.raises(CheckpointError, match="frame 1 .*(malformed KV batch|bad layer)"):
            r.apply(Frame(1, KV, {"batch": bad}, 0))


def test_a_small_last_delta_is_packed_in_one_call_and_a_large_one_joined(host, monkeypatch):
    """msgpack packs a last delta in one call (its copies hold the GIL), only up to
    PACKED_BYTES of KV; past it the frame is joined as any other. The bytes are the same."""
    from kvferry.checkpoint import frames

    packed = []
    real = frames.FrameWriter.frame_packed
    monkeypatch.setattr(frames.FrameWriter, "frame_packed",
                        lambda self, kind, obj: packed.append(kind) or real(self, kind, obj))
    got = []
    for limit in (snapshot.PACKED_BYTES, 0):
        monkeypatch.setattr(snapshot, "PACKED_BYTES", limit)
        s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
        sn = snapshot.Snapshotter(s)
        chat_turns(s, ["one"])
        chunks = [sn.header(), *sn.kv()]
        chat_turns(s, ["two"])
        n = len(packed)
        chunks += list(sn.finish())
        got.append(len(packed) - n)
        b = restore.restore(host, chunks, session_id=f"packed{limit}")
        assert b.history == s.history
    assert got == [1, 0]


def test_chunked_stream_appends_in_place(host):
    """Pre-copy sends token ranges of each layer; the target grows each layer once,
    to the size the header announces, and continues exactly."""
    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    twin = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    chat_turns(s, ["one two three"])
    chat_turns(twin, ["one two three"])
    sn = snapshot.Snapshotter(s, "raw")
    chunks = [sn.header()] + list(sn.encode(sn.extract(chunk=5)))
    n0 = sn.sent_tokens
    kv = [f for f in FrameDecoder().feed(b"".join(chunks)) if f.kind == KV]  # the stream so far
    assert len(kv) == len(s.cache) * -(-n0 // 5) and kv[0].body["end"] == 5
    chat_turns(s, ["four"])
    chat_turns(twin, ["four"])
    chunks += list(sn.finish())
    r = restore.Restorer(host, session_id="chunked")
    for f in iter_frames(chunks):
        r.apply(f)
        if f.kind == KV and "layer" in f.body and f.body["end"] == 5:
            grown = r.caches[f.body["layer"]].keys.shape[2]
            assert grown >= n0 + 256  # reserved at the first range, not grown per 256 tokens
    b = host.adopt(r.commit())
    assert chat_turns(b, ["five"]) == chat_turns(twin, ["five"])
    # a header that announces more tokens than the session's context is not believed
    r = restore.Restorer(host, session_id="hostile")
    head = next(iter_frames([chunks[0]])).body
    r.apply(Frame(0, HEADER, {**head, "cache": {**head["cache"], "tokens": 1 << 21}}, 0))
    r.apply(kv[0])
    assert r.caches[0].keys.shape[2] <= 512


def test_a_layers_first_room_is_written_before_the_compute_lock(host, monkeypatch):
    """On a CPU a landing layer's room is made and written before the host's compute
    lock is taken (its pages are new to the process, and a VM charges each one's first
    write: under the lock that stalled the host's other sessions). No MLX op makes it
    with the lock held, and the landed session goes on as its twin."""
    import mlx.core as mx

    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    twin = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    chat_turns(s, ["one two three"])
    chat_turns(twin, ["one two three"])
    chunks = list(snapshot.snapshot(s, "raw"))
    held, zeros_held, zeros = [False], [], mx.zeros

    class Watched:
        def __init__(self, lock):
            self.inner = lock

        def __enter__(self):
            self.inner.__enter__()
            held[0] = True

        def __exit__(self, *exc):
            held[0] = False
            self.inner.__exit__(*exc)

    def watched_zeros(*a, **k):
        zeros_held.append(held[0])
        return zeros(*a, **k)
    monkeypatch.setattr(mx, "zeros", watched_zeros)
    r = restore.Restorer(host, session_id="roomy")
    r.lock = Watched(r.lock)
    for f in iter_frames(chunks):
        r.apply(f)
    assert not any(zeros_held)
    assert all(c.keys.shape[2] >= len(s.history) for c in r.caches)
    b = host.adopt(r.commit())
    assert chat_turns(b, ["four"]) == chat_turns(twin, ["four"])


def test_a_session_held_still_is_framed_by_reference_and_a_running_one_by_copy(host):
    """With ``parts``, the KV of a session held still comes as frames.Parts that reference its
    cache (and equal the joined frames byte for byte); pieces copied under the compute lock, which
    a lane reuses, are joined."""
    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    fresh = snapshot.Snapshotter(s, "raw", parts=True)  # no KV yet: nothing to frame, and no error
    assert not fresh.lasting() and list(fresh.kv()) == []
    chat_turns(s, ["one two three"])
    joined = list(snapshot.Snapshotter(s, "raw").kv())
    sn = snapshot.Snapshotter(s, "raw", parts=True)
    assert sn.lasting() and not sn.lasting(host.compute)
    held = list(sn.kv())
    assert held and all(isinstance(f, Parts) for f in held)
    assert [bytes(f) for f in held] == joined
    copied = list(sn.encode(snapshot.Snapshotter(s, "raw").extract(lock=host.compute), lasting=False))
    assert all(isinstance(f, bytes) for f in copied)


def test_extract_on_an_accelerator_reads_its_copies_after_the_hold(host, monkeypatch):
    """On a GPU a pre-copy hold only queues device copies; they are read once the
    hold is over, and give the bytes the host's path gives."""
    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    twin = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    chat_turns(s, ["one two three"])
    chat_turns(twin, ["one two three"])
    want = [(i, a, b, k[0].copy(), v[0].copy()) for i, a, b, k, v, _ in snapshot.Snapshotter(s, "raw").extract(chunk=5)]
    monkeypatch.setattr(snapshot, "host_memory", lambda: False)
    held = []

    class Hold:
        def __enter__(self):
            held.append(1)

        def __exit__(self, *exc):
            held.pop()
    got = []
    for i, a, b, k, v, meta in snapshot.Snapshotter(s, "raw").extract(chunk=5, lock=Hold()):
        assert not held and meta is None
        got.append((i, a, b, k[0], v[0]))
    assert len(got) == len(want) == len(s.cache) * -(-len(s.history) // 5)
    assert all(x[:3] == y[:3] and np.array_equal(x[3], y[3]) and np.array_equal(x[4], y[4]) for x, y in zip(got, want))
    # without a lock (a paused session's last delta, a stop-and-copy): in batches, the same bytes
    monkeypatch.setattr(kv_extract, "DEVICE_BATCH_BYTES", 3 * want[0][3].nbytes)
    whole = [(i, a, b, k[0].copy(), v[0].copy()) for i, a, b, k, v, _ in snapshot.Snapshotter(s, "raw").extract(chunk=5)]
    assert all(x[:3] == y[:3] and np.array_equal(x[3], y[3]) and np.array_equal(x[4], y[4]) for x, y in zip(whole, want))
    assert chat_turns(s, ["four"]) == chat_turns(twin, ["four"])


def test_extract_on_an_accelerator_leaves_the_cache_updated_in_place(host, monkeypatch):
    """A pre-copy paused between its pieces holds no MLX array of the cache: the
    session's steps meanwhile still write its KV buffer in place, not a copy of it."""
    s = host.create_session(sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    chat_turns(s, ["one two three four five"])
    monkeypatch.setattr(snapshot, "host_memory", lambda: False)
    pieces = snapshot.Snapshotter(s, "raw").extract(chunk=4, lock=threading.Lock())
    next(pieces)

    def buffer():
        return np.array(s.cache[0].keys, copy=False).ctypes.data
    before = buffer()
    chat_turns(s, ["six"])
    assert buffer() == before
    pieces.close()


def test_extract_on_an_accelerator_batches_quantized_parts_exactly(smollm, monkeypatch):
    """A GPU's pre-copy reads each batch of device copies as one buffer: a quantized
    cache's three parts a side come out of it as the host's path gives them."""
    h = ModelHost(lm=smollm, progress=False)
    q = h.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True), options=SessionOptions(kv_bits=8))
    chat_turns(q, ["one two three"])
    on_host = [(x[:3], [[(u.copy(), n) for u, n in side] for side in x[3:5]])
               for x in snapshot.Snapshotter(q, "raw").extract(chunk=5)]
    monkeypatch.setattr(snapshot, "host_memory", lambda: False)
    on_device = [(x[:3], x[3:5]) for x in snapshot.Snapshotter(q, "raw").extract(chunk=5, lock=threading.Lock())]
    assert len(on_device) == len(on_host) == len(q.cache) * -(-len(q.history) // 5)
    for (where, sides), (where2, sides2) in zip(on_host, on_device):
        assert where == where2 and all(n == n2 and u.dtype == u2.dtype and np.array_equal(u, u2)
                                       for side, side2 in zip(sides, sides2) for (u, n), (u2, n2) in zip(side, side2))
    h.close()


def test_host_blocks_are_reused_only_when_nothing_refers_to_them():
    blocks = host_blocks.HostBlocks(block=64, cap=128)
    a = blocks.take(40)
    view = a[8:16].view(np.uint32)  # a view of a view still holds the block
    del a
    b = blocks.take(64)
    assert len(blocks.blocks) == 2 and not np.shares_memory(view, b)
    c = blocks.take(10)  # both in use, the cap reached: a buffer of its own
    assert blocks.fresh == 1 and not any(np.shares_memory(c, x) for x in blocks.blocks)
    del view
    d = blocks.take(64)
    assert np.shares_memory(d, blocks.blocks[0]) and len(blocks.blocks) == 2
    assert blocks.take(65).nbytes == 65 and blocks.fresh == 2  # larger than a block
    del b, c, d


def test_host_blocks_warmed_ahead_are_page_locked_and_then_taken(monkeypatch):
    from kvferry.checkpoint import unified

    rt = FakeCudaRuntime()
    monkeypatch.setitem(unified._state, "runtime", rt)
    monkeypatch.setitem(unified._state, "loaded", True)
    blocks = host_blocks.HostBlocks(block=4096, cap=3 * 4096 + 100)
    monkeypatch.setattr(host_blocks, "_blocks", blocks)
    lane = host_blocks.HostBlocks(block=1024, cap=2048)  # a lane's frames, kept apart
    monkeypatch.setattr(host_blocks, "_frames", lane)
    host_blocks.warm()
    assert rt.pinned == [4096] * 3 + [1024] * 2 and len(blocks.blocks) == 3 and len(lane.blocks) == 2
    assert host_blocks.frame(1000).base is lane.blocks[0] and host_blocks.frame(1025).base is None
    rt.pinned.clear()
    held = [blocks.take(4000) for _ in range(3)]
    assert len(blocks.blocks) == 3 and blocks.fresh == 0 and rt.pinned == []
    assert blocks.take(10).nbytes == 10 and blocks.fresh == 1
    del held
    monkeypatch.setitem(unified._state, "runtime", None)  # a CPU: nothing to warm
    cpu = host_blocks.HostBlocks(block=4096, cap=1 << 20)
    monkeypatch.setattr(host_blocks, "_blocks", cpu)
    host_blocks.warm()
    assert cpu.blocks == []


def test_kv_read_on_a_gpu_crosses_in_one_prefetch_each_way(host, monkeypatch):
    """On a GPU each batch of KV the source reads comes to the host in one prefetch and
    goes back once copied; each side a target lands goes by the copy engine straight
    into its layer's room, no MLX op and no prefetch. The bytes are those of the host's
    path. A runtime that fails is dropped after its first error, and the bytes (and
    the landed session) are still right."""
    from kvferry.checkpoint import mlxbits, unified

    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    twin = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    chat_turns(s, ["one two three"])
    chat_turns(twin, ["one two three"])
    want = [(x[:3], x[3][0].copy(), x[4][0].copy()) for x in snapshot.Snapshotter(s, "raw").extract(chunk=5)]
    rt = FakeCudaRuntime()
    monkeypatch.setitem(unified._state, "runtime", rt)
    monkeypatch.setitem(unified._state, "loaded", True)
    for mod in (snapshot, kv_landing, mlxbits):
        monkeypatch.setattr(mod, "host_memory", lambda: False)
    monkeypatch.setattr(kv_extract, "DEVICE_BATCH_BYTES", 3 * want[0][1].nbytes)
    monkeypatch.setattr(unified, "MIN_BYTES", 1)  # this model's sides are a few hundred bytes

    def same(got):  # (layer, start, end, keys, values) against the host's path
        return len(got) == len(want) and all(x[:3] == y[0] and np.array_equal(x[3][0], y[1])
                                             and np.array_equal(x[4][0], y[2]) for x, y in zip(got, want))
    # held still: by the copy engine, straight out of each cache's buffer, no prefetch, into
    # kept host blocks; a block whose bytes are still referenced is not handed out again
    blocks = host_blocks.HostBlocks(block=3 * want[0][1].nbytes, cap=1 << 30)
    monkeypatch.setattr(host_blocks, "_blocks", blocks)
    held = [x[:5] for x in snapshot.Snapshotter(s, "raw").extract(chunk=5)]
    assert same(held) and rt.moves == [] and sum(rt.copies) == sum(y[1].nbytes + y[2].nbytes for y in want)
    batches, size = 0, None
    for y in want:  # pieces packed in order up to the bound
        more = y[1].nbytes + y[2].nbytes
        batches, size = (batches + 1, more) if size is None or size + more > 3 * want[0][1].nbytes else \
            (batches, size + more)
    assert len(blocks.blocks) == len(rt.pinned) == batches and blocks.fresh == 0
    again = [x[:5] for x in snapshot.Snapshotter(s, "raw").extract(chunk=5)]
    assert same(again) and same(held) and len(blocks.blocks) == 2 * batches  # all in use: new ones
    del held, again
    rt.copies.clear()
    assert same([x[:5] for x in snapshot.Snapshotter(s, "raw").extract(chunk=5)])
    assert len(blocks.blocks) == 2 * batches  # freed ones reused
    rt.copies.clear()
    # beside the host's steps (its compute lock): MLX copies, a prefetch each way a batch
    assert same([x[:5] for x in snapshot.Snapshotter(s, "raw").extract(chunk=5, lock=threading.Lock())])
    batches = -(-len(want) // 2)  # two pieces (four sides) reach the batch bound of three sides
    assert len(rt.moves) == 2 * batches and rt.copies == []
    assert [w for w, _ in rt.moves] == [unified.HOST, unified.DEVICE] * batches
    assert sum(n for w, n in rt.moves if w == unified.HOST) == sum(y[1].nbytes + y[2].nbytes for y in want)
    # landing: every side of every KV frame is copied into its room, and the session goes on as its twin
    rt.moves.clear()
    chunks = list(snapshot.snapshot(s, "raw"))
    assert rt.moves == [] and sum(rt.copies) == sum(y[1].nbytes + y[2].nbytes for y in want)  # read as above
    rt.copies.clear()
    b = restore.restore(host, chunks, session_id="landed")
    assert rt.moves == [] and sum(rt.copies) == sum(y[1].nbytes + y[2].nbytes for y in want)
    reply = chat_turns(b, ["four"])
    assert reply == chat_turns(twin, ["four"])
    # a live migration: pre-copy's pieces by the copy engine, then the last delta under the lock, by MLX,
    # into rooms no host view still references (MLX would copy a referenced room whole)
    sn = snapshot.Snapshotter(s, "raw")
    r, dec = restore.Restorer(host, session_id="landed-live"), FrameDecoder()
    for f in dec.feed(b"".join([sn.header()] + list(sn.kv(len(s.history) - 2)))):
        r.apply(f)
    assert len(r._views) == len(s.cache) and rt.copies
    last = list(dec.feed(b"".join(sn.finish())))
    assert "batch" in last[0].body
    r.apply(last[0])
    assert r._views == {}
    for f in last[1:]:
        r.apply(f)
    assert chat_turns(host.adopt(r.commit()), ["four"]) == reply
    # a copy that fails lands through MLX (each side to the device first), and the runtime is dropped
    rt.copy_err = 1
    c = restore.restore(host, chunks, session_id="landed-by-mlx")
    assert unified._state["runtime"] is None and chat_turns(c, ["four"]) == reply
    unified._state["runtime"], rt.copy_err = rt, 0
    # a read by the copy engine that fails hands the rest to MLX, with the same bytes
    rt.copy_err, rt.copies = 1, []
    assert same([x[:5] for x in snapshot.Snapshotter(s, "raw").extract(chunk=5)])
    assert len(rt.copies) == 1 and unified._state["runtime"] is None
    # a runtime that fails once is not asked again
    unified._state["runtime"], rt.copy_err = rt, 0
    rt.moves.clear()
    rt.err = 1
    assert same([x[:5] for x in snapshot.Snapshotter(s, "raw").extract(chunk=5, lock=threading.Lock())])
    assert len(rt.moves) == 1 and unified._state["runtime"] is None


def test_codecs_roundtrip_and_ratios():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 3, 200, 64)) * np.exp(rng.standard_normal((1, 3, 1, 64)))).astype(np.float32)
    for dtype, u in [("float32", x.view(np.uint32)), ("float16", x.astype(np.float16).view(np.uint16))]:
        b = codecs.encode(u, dtype, "lossless")
        assert np.array_equal(codecs.decode(b, "t"), u)
        for mode, bits in (("int8", 8), ("int4", 4)):  # hostile quantized blobs: one line each
            q = codecs.encode(u, dtype, mode)  # values; int4 keys: test_int4_keys_keep_outlier_channels
            assert q["codec"] == f"sq{bits}"
            for bad in ({"meta": {**q["meta"], "base": 10 ** 6}}, {"meta": {**q["meta"], "group": 7}},
                        {"meta": {**q["meta"], "group": "x"}}, {"parts": [q["parts"][0][:20], *q["parts"][1:]]},
                        {"parts": q["parts"][:1]}, {"dtype": "int32"}):
                with pytest.raises(CheckpointError, match="^t: "):
                    codecs.decode({**q, **bad}, "t")
            if bits == 4:
                wide = np.full(u.size, 9, np.int8).view(np.uint8).tobytes()
                with pytest.raises(CheckpointError, match="codes out of range"):
                    codecs.decode({**q, "parts": [blob.compress(wide), *q["parts"][1:]]}, "t")
        raw = codecs.encode(u, dtype, "raw")
        assert raw["codec"] == "raw" and np.array_equal(codecs.decode(raw, "t"), u)
        with pytest.raises(CheckpointError, match="t: payload is .* bytes, expected"):
            codecs.decode({**raw, "parts": [raw["parts"][0][:-1]]}, "t")
        for mode, tol in (("int8", 0.02), ("int4", 0.3)):
            q = codecs.decode(codecs.encode(u, dtype, mode), "t")
            back = q.view(np.float32) if dtype == "float32" else q.view(np.float16).astype(np.float32)
            err = np.abs(back - x).max(axis=-1) / (np.abs(x).max(axis=-1) + 1e-6)
            assert err.max() < tol, (dtype, mode, err.max())


def test_int4_keys_keep_outlier_channels():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 300, 64)).astype(np.float32)
    big = [[3, 17, 40, 41], [0, 5, 6, 63]]  # per head: channels 20x the others, as in real keys
    for h, chans in enumerate(big):
        x[0, h, :, chans] *= 20
    u = x.view(np.uint32)
    q = codecs.encode(u, "float32", "int4", "keys")
    k = q["meta"]["k"]
    assert q["codec"] == "so4" and k == codecs.OUTLIERS
    back = codecs.decode(q, "t").view(np.float32)
    plain = codecs.decode(codecs.encode_symmetric(u, "float32", 4), "t").view(np.float32)
    rest = np.ones(64, bool)
    rest[big[0]] = False
    err = lambda y: float(np.abs(y - x)[0, 0][:, rest].mean())  # noqa: E731
    assert err(back) < err(plain) / 3  # the ordinary channels no longer round to a few levels
    assert np.abs(back - x)[0, 0][:, big[0]].max() < np.abs(x[0, 0][:, big[0]]).max() / 100  # 8-bit outliers
    assert codecs.encode(u, "float32", "int4", "values")["codec"] == "sq4"
    for bad in ({"meta": {**q["meta"], "k": 64}}, {"meta": {**q["meta"], "k": "4"}},
                {"meta": {**q["meta"], "base_outliers": -10 ** 6}},
                # outlier channels unordered, then past the head dim
                {"parts": [*q["parts"][:4], blob.compress(bytes([5, 3] + list(range(10, 10 + 2 * k - 2))))]},
                {"parts": [*q["parts"][:4], blob.compress(bytes(list(range(64 - 2 * k + 1, 65))))]},
                {"parts": [q["parts"][0][:10], *q["parts"][1:]]}, {"parts": q["parts"][:3]}):
        with pytest.raises(CheckpointError, match="^t: "):
            codecs.decode({**q, **bad}, "t")
    wide = np.full(2 * 300 * (64 - codecs.OUTLIERS), 9, np.int8).view(np.uint8).tobytes()
    with pytest.raises(CheckpointError, match="codes out of range"):
        codecs.decode({**q, "parts": [blob.compress(wide), *q["parts"][1:]]}, "t")


def test_checkpoints_of_the_earlier_affine_codec_still_load():
    """Blobs written as ``q8``/``q4`` (keys grouped along time, values along the head dim) decode
    close to the tensor, and a malformed layout is one line."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 130, 64)).astype(np.float32)
    u = x.view(np.uint32)
    for bits, axis, tol in ((8, "t", 0.02), (4, "d", 0.2), (4, "t", 0.2)):
        q = quant.encode_quantized(u, "float32", bits, axis=axis)
        assert q["codec"] == f"q{bits}"
        back = codecs.decode(q, "t").view(np.float32)
        assert back.shape == x.shape
        assert np.abs(back - x).max() / np.abs(x).max() < tol, (bits, axis)
        with pytest.raises(CheckpointError, match="^t: malformed quantized layout"):
            codecs.decode({**q, "meta": {**q["meta"], "layout": [1, 2, 3]}}, "t")


# ----------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def good(host, tmp_path_factory):
    s = host.create_session(sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    chat_turns(s, ["a small checkpoint"])
    path = tmp_path_factory.mktemp("ck") / "good.kvf"
    snapshot.save(s, path)
    host.close_session(s.id)
    return path.read_bytes()


def restore_bytes(host, data, **kw):
    before = set(host.sessions)
    try:
        return restore.restore(host, [data], **kw)
    finally:
        new = set(host.sessions) - before
        for sid in new:  # tests close what they restored
            host.close_session(sid)


def frame_offsets(data):
    offs, at = [], 12
    while at < len(data):
        n = int.from_bytes(data[at + 4:at + 8], "little")
        offs.append((at, 16 + n))
        at += 16 + n
    return offs


def test_truncated(host, good):
    assert not host.sessions
    for cut in (0, 5, 12, 40, len(good) // 3, len(good) - 1):
        with pytest.raises(CheckpointError, match="truncated|bad magic"):
            restore_bytes(host, good[:cut])
    assert not host.sessions


def test_bytes_after_the_trailer_are_refused(host, good):
    """The trailer ends a checkpoint: a byte after it (in its chunk, in a later one, or a
    byte inserted at the trailer body's end, which shifts its last byte out) is refused."""
    last_byte_doubled = good[:-1] + good[-1:] * 2  # what the fuzzer found: accepted before
    for chunks in ([good + b"0"], [good, b"0"], [last_byte_doubled]):
        with pytest.raises(CheckpointError, match=r"^1 byte after the trailer \(the checkpoint ends there\)$"):
            restore.restore(host, chunks)
    with pytest.raises(CheckpointError, match=r"^7 bytes after the trailer"):
        list(iter_frames([good + bytes(7)]))
    assert not host.sessions


def test_every_frame_bit_flip_is_caught(host, good):
    offs = frame_offsets(good)
    assert len(offs) > 5
    for i, (at, n) in enumerate(offs):
        for pos in (at + 16, at + n // 2, at + n - 1):  # body bytes
            bad = bytearray(good)
            bad[pos] ^= 0x10
            with pytest.raises(CheckpointError) as e:
                restore_bytes(host, bytes(bad))
            assert f"frame {i} (" in str(e.value) and "\n" not in str(e.value)
    assert not host.sessions


def test_unknown_version(host, good):
    bad = bytearray(good)
    bad[8] = 7
    with pytest.raises(CheckpointError, match="unknown checkpoint format version 7"):
        restore_bytes(host, bytes(bad))


def test_a_version_1_checkpoint_still_restores_and_is_still_checked(host, good):
    """Version 1 (xxh64 frames, a digest of every byte) is still read, with every check."""
    from kvferry.checkpoint import frames

    w = FrameWriter(version=1)
    old = b"".join(w.frame(f.kind, f.body) for f in iter_frames([good]) if f.kind != TRAILER) + w.trailer()
    assert old[8] == 1 and good[8] == frames.FORMAT_VERSION == 2
    s = restore.restore(host, [old])
    assert list(host.sessions) == [s.id] and s.state().history
    host.close_session(s.id)
    (at, n), = frame_offsets(old)[2:3]
    bad = bytearray(old)
    bad[at + n - 1] ^= 1
    with pytest.raises(CheckpointError, match=r"frame 2 \(kv\): checksum mismatch"):
        restore_bytes(host, bytes(bad))
    assert not host.sessions


def test_the_digest_of_frame_heads_catches_a_frame_dropped_or_moved(host, good):
    """Since version 2 the trailer's digest covers the frame heads, each with its body's
    checksum: a whole frame left out, repeated or moved is caught there (each frame's
    own checksum still holds)."""
    offs = frame_offsets(good)
    frames_ = [good[at:at + n] for at, n in offs]
    kv = [i for i, f in enumerate(frames_) if f[0] == KV]
    assert len(kv) >= 2
    pre = good[:offs[0][0]]
    a, b = kv[0], kv[1]
    moved = frames_[:a] + [frames_[b], frames_[a]] + frames_[a + 1:b] + frames_[b + 1:]
    for variant in (moved, frames_[:a] + frames_[a + 1:], frames_[:a + 1] + frames_[a:]):
        with pytest.raises(CheckpointError) as e:
            restore_bytes(host, pre + b"".join(variant))
        assert "\n" not in str(e.value)
    assert not host.sessions


def test_other_model_is_refused(good, tmp_path):
    from kvferry.convert import import_gguf
    from tinyllama import write_tiny_gguf

    write_tiny_gguf(tmp_path / "other.gguf", seed=99)
    other = ModelHost(str(import_gguf(tmp_path / "other.gguf", tmp_path / "other", progress=False)),
                      progress=False)
    with pytest.raises(CheckpointError, match=r"frame 0 \(header\): checkpoint is for model 'tiny-llama'"):
        restore_bytes(other, good)
    assert not other.sessions
    other.close()


def test_other_guest_is_refused(host, good):
    digits = host.engine.compile(GUESTS_DIR / "digits.wasm").sha256
    with pytest.raises(CheckpointError, match="made with guest 'chat.wasm'"):
        restore_bytes(host, good, expect_guest_sha=digits)


def test_existing_session_is_not_duplicated(host, good):
    s = restore_bytes.__wrapped__ if hasattr(restore_bytes, "__wrapped__") else None
    first = restore.restore(host, [good])
    with pytest.raises(CheckpointError, match="already exists"):
        restore.restore(host, [good])
    assert list(host.sessions) == [first.id]
    host.close_session(first.id)
    del s


def _craft(frames):
    w = FrameWriter()
    out = b"".join(w.frame(k, b) for k, b in frames)
    return out + w.trailer()


def test_decompression_bombs(host, good):
    frames = list(iter_frames([good]))
    header = frames[0].body
    big = {"codec": "zstd", "dtype": "float32", "shape": [1, 2, 1 << 33, 64], "nbytes": 1 << 42,
           "parts": [b""], "meta": {}}
    data = _craft([(1, header), (KV, {"layer": 0, "start": 0, "end": 4, "keys": big, "values": big})])
    with pytest.raises(CheckpointError, match=r"frame 1 \(kv\) keys: declares float32\[1, 2, 8589934592, 64\], this model.s KV is"):
        restore_bytes(host, data)
    # a stream that inflates past its declared size
    bomb = blob.compress(bytes(64 << 20))
    liar = {"codec": "zstd", "dtype": "float32", "shape": [1, 2, 4, 16], "nbytes": 512, "parts": [bomb], "meta": {}}
    data = _craft([(1, header), (KV, {"layer": 0, "start": 0, "end": 4, "keys": liar, "values": liar})])
    with pytest.raises(CheckpointError, match="larger than declared"):
        restore_bytes(host, data)
    # a frame header declaring a 4 GiB body
    data = good[:12] + bytes([1, 0, 0, 0]) + (0xFFFFFFF0).to_bytes(4, "little") + bytes(8)
    with pytest.raises(CheckpointError, match=r"frame 0 \(header\): declares a 4294967280-byte body"):
        restore_bytes(host, data)
    assert not host.sessions


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutations(host, good, data):
    """Any mutation of a real checkpoint: a one-line CheckpointError, or (if the bytes
    did not change) the same session. Never a crash, never a half-restored session."""
    buf = bytearray(good)
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]))
    pos = data.draw(st.integers(0, len(buf) - 1))
    if op == "flip":
        buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "truncate":
        del buf[pos:]
    elif op == "insert":
        buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    elif op == "delete":
        del buf[pos:pos + data.draw(st.integers(1, 64))]
    else:
        chunk = data.draw(st.binary(min_size=1, max_size=32))
        buf[pos:pos + len(chunk)] = chunk
    try:
        s = restore_bytes(host, bytes(buf))
        assert bytes(buf) == good, "a changed checkpoint was accepted"
        assert s is not None
    except CheckpointError as e:
        assert "\n" not in str(e) and str(e)
    assert not host.sessions


# ----------------------------------------------------------------------------- CLI on SmolLM2

def kvferry(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "kvferry", *args], capture_output=True, text=True,
                          input=stdin, timeout=600)


def test_cli_save_verify_inspect_resume(smollm_dir, tmp_path):
    ck = tmp_path / "c.kvf"
    r = kvferry("generate", "--prompt", "What is the capital of France?", "--max-tokens", "16",
                "--save", str(ck))
    assert r.returncode == 0, r.stderr[-2000:]
    assert kvferry("checkpoint", "verify", str(ck)).returncode == 0
    info = json.loads(kvferry("checkpoint", "inspect", str(ck), "--json").stdout)
    assert info["verified"] and len(info["layers"]) == 30 and info["ratio"] > 1.0
    assert info["header"]["model"]["name"] == "SmolLM2-135M-Instruct"
    resumed = kvferry("generate", "--resume", str(ck), "--prompt", "And of Italy?", "--max-tokens", "16")
    twin = kvferry("chat", "--max-tokens", "16", stdin="What is the capital of France?\nAnd of Italy?\n")
    assert resumed.returncode == 0 and twin.returncode == 0
    assert resumed.stdout.strip() == twin.stdout.strip().splitlines()[-1].strip()
    assert "Rome" in resumed.stdout
    # a flipped bit: verify fails with one line naming the frame
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 4
    bad = tmp_path / "bad.kvf"
    bad.write_bytes(bytes(data))
    v = kvferry("checkpoint", "verify", str(bad))
    assert v.returncode == 1 and "checksum mismatch" in v.stderr and len(v.stderr.strip().splitlines()) == 1
    g = kvferry("generate", "--resume", str(bad), "--prompt", "hi")
    assert g.returncode == 2 and g.stderr.startswith("kvferry: frame ") and len(g.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_mid_turn_checkpoint_continues_the_turn(host, sampling, tmp_path):
    """A checkpoint taken between two steps of a turn continues that very turn."""
    twin = host.create_session(sampling=sampling)
    full = [e for e in twin.send("keep talking") if e.token >= 0]
    a = host.create_session(sampling=sampling)
    it = a.send("keep talking")
    head = [next(it) for _ in range(5)]
    data = b"".join(snapshot.snapshot(a))
    host.close_session(a.id)
    b = restore.restore(host, [data])
    assert b.turn is not None and b.turn.tokens == [e.token for e in head]
    rest = [e for e in b.continue_turn(from_index=3) if e.token >= 0]
    assert [e.index for e in rest][:2] == [3, 4]  # replayed what the client lacked
    got = [e.token for e in head[:3]] + [e.token for e in rest]
    assert got == [e.token for e in full]
    assert "".join(e.text for e in head[:3]) + "".join(e.text for e in rest) == \
        "".join(e.text for e in full)
    assert b.messages == twin.messages


def test_a_declared_shape_cannot_wrap_around():
    """2^32 x 2^32 elements: a uint64 product wraps to 0 bytes and passed the size
    check; Python integers do not wrap."""
    with pytest.raises(CheckpointError, match="over the 8 GiB tensor limit"):
        blob.check_shape([1 << 32, 1 << 32], "float32", "crafted")


def test_save_never_writes_through_a_planted_symlink(host, tmp_path):
    """A symlink planted where save() used to put its temporary file (path.tmpPID)
    made the host overwrite the link's target; now the temporary file is a new one
    of its own, and the victim is untouched."""
    import os

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "c.kvf"
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    s = host.create_session(sampling=SamplingParams(max_tokens=2))
    try:
        list(s.complete([5, 6, 7]))
        snapshot.save(s, path)
    finally:
        host.close_session(s.id)
    assert victim.read_bytes() == b"precious" and path.read_bytes()[:4] != b"prec"


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_session_lives_on(host, tmp_path):
    """A missing directory, or a directory where the file should go: one CheckpointError
    naming the path (an OSError's traceback before), no file left behind, and the
    session still there to save elsewhere; `generate --save` says so before it generates."""
    s = host.create_session(sampling=SamplingParams(max_tokens=2))
    try:
        list(s.complete([5, 6, 7]))
        for bad, why in ((tmp_path / "no" / "c.kvf", "No such file or directory"), (tmp_path, "Is a directory")):
            with pytest.raises(CheckpointError, match=f"^{bad}: cannot write .*\\({why}\\)$"):
                snapshot.save(s, bad)
        assert list(tmp_path.iterdir()) == []
        assert snapshot.save(s, tmp_path / "c.kvf")["bytes"] > 0
    finally:
        host.close_session(s.id)
    r = kvferry("generate", "--prompt", "hi", "--save", str(tmp_path / "no" / "c.kvf"))
    assert r.returncode == 2 and r.stderr.strip() == (f"kvferry: --save {tmp_path / 'no' / 'c.kvf'}: not a file "
                                                      f"that can be written (no writable directory {tmp_path / 'no'})")


def test_a_frame_joins_large_payloads_into_msgpacks_own_bytes():
    """encode_frame splices payloads past SPLICE_BYTES in by reference; the frame
    must be byte for byte what msgpack packs (old checkpoints and readers agree)."""
    import msgpack
    import xxhash

    from kvferry.checkpoint import frames

    def packed(obj):
        body = msgpack.packb(obj, use_bin_type=True)
        return frames.FRAME_HEAD.pack(KV, 0, 0, len(body), xxhash.xxh3_64(bytes([KV]) + body).intdigest()) + body

    rng = np.random.default_rng(0)
    for n in (0, 255, 256, bodies.SPLICE_BYTES - 1, bodies.SPLICE_BYTES, (1 << 16) + 1, (3 << 19) + 7):
        u = rng.integers(0, 255, n, dtype=np.uint8)
        for obj in ({"layer": 3, "keys": {"codec": "raw", "parts": [memoryview(u).cast("B")], "meta": {}},
                     "values": [u.tobytes(), b"x", 1.5, None, True, -3, "s" * 300]},
                    [u.tobytes(), (1, 2), {"a": {"b": bytearray(u.tobytes())}}], u.tobytes()):
            frame = frames.encode_frame(KV, obj)
            assert frame == packed(obj), n
            body = bodies.unpack(frame[frames.FRAME_HEAD.size:], "test")
            assert body == msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)
            assert frames.encode_frame_packed(KV, obj) == frame, n  # msgpack in one call, the same bytes
    with pytest.raises(CheckpointError, match="exceeds the 256 MiB frame limit"):
        frames.encode_frame(KV, [b"\0" * (frames.MAX_BODY + 1)])
    with pytest.raises(TypeError, match="Gather in a packed frame"):
        frames.encode_frame_packed(KV, {"parts": bodies.Gather((b"ab", b"cd"))})


def test_a_frame_of_small_parts_is_one_buffer_and_a_last_delta_is_packed_in_one_call():
    """The small parts between two large payloads go out as one buffer, hashed once
    (one a map key and value made a live pause's last delta ~1,300 buffers); a
    batch of every codec's bodies packs in one msgpack call to the same bytes."""
    from kvferry.checkpoint import frames

    rng = np.random.default_rng(1)
    u = (rng.standard_normal((1, 3, 5, 64), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)  # bfloat16
    for mode in codecs.MODES:
        batch = {"batch": [{"layer": i, "start": 10, "end": 15, "keys": codecs.encode(u, "bfloat16", mode, "keys"),
                            "values": codecs.encode(u, "bfloat16", mode)} for i in range(30)]}
        parts = frames.encode_frame_parts(KV, batch)
        assert len(parts.buffers) == 2, mode  # the head and one body buffer
        assert frames.encode_frame_packed(KV, batch) == bytes(parts), mode
    big = rng.integers(0, 255, bodies.SPLICE_BYTES, dtype=np.uint8)
    view = memoryview(big).cast("B")
    parts = frames.encode_frame_parts(KV, {"layer": 1, "keys": {"parts": [view], "meta": {}},
                                           "values": {"parts": [view]}})
    assert [type(b) for b in parts.buffers[1:]] == [bytes, memoryview, bytes, memoryview]
    assert all(b is view for b in parts.buffers[2::2])  # the payloads by reference, never copied
    w, w2 = frames.FrameWriter(), frames.FrameWriter()
    assert w.frame_packed(KV, batch) == w2.frame(KV, batch) and w.trailer() == w2.trailer()


def test_a_frame_in_parts_is_the_joined_frame_and_its_reader_borrows_only_large_payloads():
    """The migration source writes KV frames as their buffers (frames.Parts, a
    strided KV slice as its runs, bodies.Gather), and the target reads them in
    place (unpack_views): the bytes, the running digest and what is read back must
    be exactly the joined path's."""
    import msgpack

    from kvferry.checkpoint import frames

    rng = np.random.default_rng(1)
    cache = rng.integers(0, 1 << 32, (1, 3, 1700, 64), dtype=np.uint32)
    kv = cache[..., 100:1612, :]  # a layer's range read in place: one run a head (1.2 MB)
    assert not kv.flags.c_contiguous
    blob = codecs.encode(kv, "float32", "raw", borrow=True)
    assert isinstance(blob["parts"][0], bodies.Gather) and len(blob["parts"][0]) == 3
    small = rng.integers(0, 255, 300, dtype=np.uint8).tobytes()
    body = {"layer": 2, "start": 100, "end": 1612, "keys": blob, "values": [small, -7, 2.5, None, True, "é"]}
    joined, split = FrameWriter(), FrameWriter()
    a, p = joined.frame(KV, body), split.frame_parts(KV, body)  # each writer's first: with the preamble
    assert isinstance(p, frames.Parts) and len(p) == len(a) and bytes(p) == a
    assert joined.trailer() == split.trailer()  # the same running digest
    head = FrameWriter().frame(HEADER, {"h": 1})
    dec = FrameDecoder(views=True)
    got = list(dec.feed(head)) + list(dec.feed(a[frames.PREAMBLE.size:]))  # a chunk each, read in place
    assert [f.borrowed for f in got] == [False, True]
    read = got[1].body
    assert isinstance(read["keys"]["parts"][0], memoryview)  # a view of the chunk fed
    assert isinstance(read["values"][0], bytes)  # small payloads are copied out
    assert np.array_equal(codecs.decode(read["keys"], "test"), kv)
    plain = msgpack.unpackb(a[frames.PREAMBLE.size + frames.FRAME_HEAD.size:], raw=False)
    assert not any(f.borrowed for f in FrameDecoder().feed(head + a[frames.PREAMBLE.size:]))  # not asked
    read["keys"]["parts"][0] = bytes(read["keys"]["parts"][0])
    assert read == plain
    # a KV body under VIEWS_FROM (a live pause's last delta) goes to msgpack's C reader: no views
    little = {"batch": [{**body, "keys": codecs.encode(kv[..., :40, :], "float32", "raw")}] * 30}
    f = FrameWriter().frame(KV, little)
    assert len(f) < bodies.VIEWS_FROM
    dec = FrameDecoder(views=True)
    got = list(dec.feed(head)) + list(dec.feed(f[frames.PREAMBLE.size:]))
    assert not got[1].borrowed and isinstance(got[1].body["batch"][0]["keys"]["parts"][0], bytes)
    assert got[1].body == msgpack.unpackb(f[frames.PREAMBLE.size + frames.FRAME_HEAD.size:], raw=False)


def test_checksums_computed_ahead_are_used_and_still_compared_to_each_frame_head(monkeypatch):
    """A lane's reader hashes a chunk's frames as they arrive (frames.check_ahead); the
    decoder then hashes nothing itself, but still compares each sum to its frame
    head's, so a corrupt body is refused as before. Sums for another format version,
    or a chunk that does not start at a frame, are not used."""
    from kvferry.checkpoint import frames

    w = FrameWriter()
    head = w.frame(HEADER, {"h": 1})
    kv = np.arange(300_000, dtype=np.float32)
    chunk = b"".join(bytes(w.frame(KV, {"layer": i, "keys": codecs.encode(kv + i, "float32", "raw")}))
                     for i in range(3))
    checked = frames.check_ahead(chunk)
    assert len(checked.sums) == 3 and min(checked.sums) == 0
    hashed = []
    real = frames._body_checksum
    monkeypatch.setattr(frames, "_body_checksum", lambda *a: hashed.append(a[1]) or real(*a))
    dec = FrameDecoder(views=True)
    list(dec.feed(head))
    hashed.clear()
    got = list(dec.feed(chunk, checked))
    assert [f.body["layer"] for f in got] == [0, 1, 2] and hashed == []  # none hashed twice
    assert np.array_equal(codecs.decode(got[2].body["keys"], "t").view(np.float32), kv + 2)  # bits
    dec = FrameDecoder(views=True)
    list(dec.feed(head))
    hashed.clear()
    assert len(list(dec.feed(chunk, frames.Checked(1, checked.sums)))) == 3 and hashed == [KV] * 3
    bad = bytearray(chunk)
    bad[len(bad) // 2] ^= 1  # the middle frame's body
    dec = FrameDecoder(views=True)
    list(dec.feed(head))
    with pytest.raises(CheckpointError, match=r"frame 2 \(kv\): checksum mismatch"):
        list(dec.feed(bytes(bad), frames.check_ahead(bad)))  # hashed ahead over the corrupt bytes
    assert frames.check_ahead(head).sums == {}  # the preamble first: no frame head at 0
    assert len(frames.check_ahead(chunk[:-1]).sums) == 2  # the last frame cut short


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=64), st.integers(0, 400), st.binary(min_size=1, max_size=4))
def test_the_in_place_reader_refuses_what_msgpack_refuses(prefix, at, patch):
    """Hostile bodies: unpack_views agrees with msgpack on every mutated body: the same
    object, or a one-line CheckpointError."""
    import msgpack

    good = msgpack.packb({"layer": 1, "keys": {"parts": [b"\1" * bodies.SPLICE_BYTES], "shape": [1, 2]},
                          "x": [1.5, -2, None, "t", {"n": 300}]}, use_bin_type=True)
    for body in (prefix, good[:at], good[:at] + patch + good[at + len(patch):]):
        try:
            want = bodies.unpack(body, "b")
        except CheckpointError:
            want = CheckpointError
        try:
            got = bodies.unpack_views(memoryview(body), "b")
        except CheckpointError as e:
            assert "malformed msgpack body" in str(e)
            got = CheckpointError
        if want is CheckpointError or got is CheckpointError:
            assert got is want
        else:  # compared packed: views pack as bytes, and a NaN equals itself
            assert msgpack.packb(got, use_bin_type=True) == msgpack.packb(want, use_bin_type=True)


def test_codecs_from_many_threads_at_once():
    """A host encodes and decodes on many threads at once (migrations, drains,
    restores): zstd contexts shared between them corrupted the heap and killed
    the host. In a child process, so a crash is a failure here, not the suite's."""
    code = """
import sys, threading
import numpy as np
from kvferry.checkpoint import codecs
errors = []
def work(seed):
    rng = np.random.default_rng(seed)
    try:
        for _ in range(150):
            u = rng.integers(0, 1 << 16, (4, 256, 64), dtype=np.uint16)
            back = codecs.decode(codecs.encode(u, "bfloat16", "lossless"), "t")
            assert np.array_equal(np.asarray(back).view(np.uint16).reshape(u.shape), u)
    except Exception as e:
        errors.append(repr(e))
ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
print(errors[:3])
sys.exit(1 if errors else 0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout[-500:], r.stderr[-1500:])


@pytest.mark.parametrize("ahead", [{"token": 1, "keys": [], "values": [], "logits": {}}, [1, 2], "x"])
def test_a_step_ahead_that_is_not_one_of_the_turns_is_refused(host, ahead):
    """A state frame's ``ahead`` (the step a speculating source ran for the turn's next
    token) that does not fit, here for a session with no turn in progress: one line."""
    s = host.create_session(sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    chat_turns(s, ["hi"])
    w, out = FrameWriter(), []
    for f in iter_frames(snapshot.snapshot(s, "raw")):
        if f.kind == TRAILER:
            out.append(w.trailer())
        else:
            out.append(w.frame(f.kind, {**f.body, "ahead": ahead} if f.kind == STATE else f.body))
    with pytest.raises(CheckpointError, match="^state frame: ahead: malformed"):
        restore_bytes(host, b"".join(out), session_id="other")
