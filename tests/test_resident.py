"""Shared KV rows (kvferry.resident, the GPU default, here on the CPU): sessions
decode in one buffer per layer; joining and leaving it keeps their KV bit for bit,
a resident session checkpoints as a plain KVCache, and a session migrates live out
of one host's resident batch into another's with every reply unchanged."""

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvferry.checkpoint import restore, snapshot
from kvferry.errors import GuestTrap
from kvferry.host import ModelHost
from kvferry.params import SamplingParams
from kvferry.policy import HostPolicy
from kvferry.resident import ResidentKV
from kvferry.server import HostServer
from test_distributed import through_batches

TOKEN = "resident"


def kv(session):
    return [(np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])) for c in session.cache]


def test_join_and_leave_keep_the_kv_bit_for_bit(smollm):
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(shared_kv=True))
    rows = h.steps.shared
    try:
        a, b = (h.create_session(sampling=SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(2))
        "".join(e.text for e in a.send("A short prompt."))
        "".join(e.text for e in b.send("A rather longer prompt, about ferries crossing a strait at dawn."))
        want = {s: kv(s) for s in (a, b)}
        with h.compute:
            assert rows.take([a, b])
        assert all(type(c) is ResidentKV for s in (a, b) for c in s.cache) and rows.owns(a) and rows.owns(b)
        assert rows.tokens >= max(a.cache[0].offset, b.cache[0].offset) + 1
        for s in (a, b):  # the views of a row are the session's KV
            assert all(np.array_equal(x, y) for got, ref in zip(kv(s), want[s]) for x, y in zip(got, ref))
        assert a.describe()["cache"] == "KVCache"
        data = b"".join(snapshot.snapshot(a))  # a resident session checkpoints as a plain cache
        r = restore.restore(h, [data], session_id="copy-of-a")
        assert type(r.cache[0]) is KVCache
        assert all(np.array_equal(x, y) for got, ref in zip(kv(r), want[a]) for x, y in zip(got, ref))
        with h.compute:
            rows.leave(a, a.cache)
        assert all(type(c) is KVCache for c in a.cache) and not rows.owns(a) and rows.owns(b)
        assert all(np.array_equal(x, y) for got, ref in zip(kv(a), want[a]) for x, y in zip(got, ref))
        "".join(e.text for e in a.send("And more."))  # its own cache grows again
        b.close()
        with h.compute:
            rows.leave(b, [])  # a closed session's row is freed, nothing copied
        assert rows.owner == [] and rows.k == []  # nobody resident: the buffers are given back
        for s in (a, r):
            h.close_session(s.id)
    finally:
        h.close()


@pytest.fixture(scope="module")
def shared_pair(smollm_dir):
    hs = [ModelHost(str(smollm_dir), progress=False, policy=HostPolicy(max_batch=8, shared_kv=True))
          for _ in range(2)]
    a, b = (HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in hs)
    a.peers, b.peers = (b.address,), (a.address,)
    yield a, b
    a.stop()
    b.stop()
    for h in hs:
        h.close()


def test_live_migration_out_of_and_into_resident_batches(shared_pair):
    """A session leaves host A's resident rows mid-reply and joins host B's, where
    another session is generating: its reply, and both bystanders', are the tokens
    each would have had alone."""
    a, b = shared_pair
    through_batches(a, b, TOKEN)
    # the replies ran in resident rows (a lone row never joins, so these are steps of
    # two sessions; which host had them depends on how the steps fell)
    assert a.host.steps.stats["resident_joins"] + b.host.steps.stats["resident_joins"] >= 2


def test_sizes_read_from_other_threads_while_rows_join_and_leave():
    """A metrics scrape or admission's KV budget reads sessions' sizes from other threads
    at any moment; joins and leaves (which replace and give back the buffers) never make
    that read fail (it once did: an IndexError, a scrape's 500)."""
    import sys
    import threading
    import time

    import mlx.core as mx

    from kvferry.resident import Bare, ResidentRows

    def session():
        caches = [KVCache() for _ in range(4)]
        for c in caches:
            c.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
        return Bare(caches)

    rows, sessions, errors, stop = ResidentRows(), [session() for _ in range(3)], [], threading.Event()
    want = sum(c.nbytes for s in sessions for c in s.cache)

    def read():
        while not stop.is_set():
            try:
                for s in sessions:
                    sum(c.nbytes for c in s.cache if not c.empty())
            except Exception as e:  # noqa: BLE001 (the failure under test)
                errors.append(repr(e))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    reader = threading.Thread(target=read)
    reader.start()
    try:
        end = time.monotonic() + 2
        while time.monotonic() < end and not errors:
            assert rows.take(sessions)
            for s in sessions:
                rows.leave(s, s.cache)
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert sum(c.nbytes for s in sessions for c in s.cache) == want and rows.k == []


def test_a_checkpoint_of_a_resident_session_waits_for_a_step_being_built(smollm):
    """A session held still (a live migration's pause, a drain) is still resident, and
    the step thread rewrites the shared buffers for the others, leaving them lazy on its
    own stream while it builds a step. Its checkpoint once read them then, unlocked:
    "There is no Stream(cpu, N) in current thread" (1 live move in ~30 under stress).
    Its reads now wait for the compute lock, and get the KV bit for bit."""
    import threading
    import time

    import mlx.core as mx

    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(shared_kv=True))
    rows = h.steps.shared
    try:
        a, b = (h.create_session(sampling=SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(2))
        for s, prompt in ((a, "A short prompt."), (b, "Another prompt, a little longer.")):
            "".join(e.text for e in s.send(prompt))
        want = kv(a)
        with h.compute:
            assert rows.take([a, b])
            mx.eval(rows.k + rows.v)
        building = threading.Event()

        def step():  # what the step thread does to the buffers: ops built, evaluated before the lock goes
            try:
                with h.compute:
                    for bufs in (rows.k, rows.v):
                        for j, buf in enumerate(bufs):
                            bufs[j] = buf * 1
                    building.set()
                    time.sleep(0.3)
                    mx.eval(rows.k + rows.v)
            finally:
                mx.clear_streams()  # (this thread's streams go with it: ml-explore/mlx#3395)

        t = threading.Thread(target=step)
        t.start()
        assert building.wait(10)
        try:
            data = b"".join(snapshot.snapshot(a))
        finally:
            t.join()
        r = restore.restore(h, [data], session_id="copy-of-a")
        assert all(np.array_equal(x, y) for got, ref in zip(kv(r), want) for x, y in zip(got, ref))
        for s in (a, b, r):
            h.close_session(s.id)
    finally:
        h.close()


class FailingLayer:
    """A model layer that raises once, when ``armed`` and ``when(*args)`` says so."""

    def __init__(self, layer, armed, when=lambda *args: True):
        self.layer, self.armed, self.when = layer, armed, when

    def __getattr__(self, name):  # the model reads its layers' settings
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        if self.armed.is_set() and self.when(*args):
            self.armed.clear()
            raise RuntimeError("a fault injected mid-step")
        return self.layer(*args, **kwargs)


def test_a_failed_resident_step_leaves_the_buffers_readable(smollm):
    """A step that fails while it is being built has already written some layers' K/V
    into the shared buffers, lazily, on the step thread's stream. The next holder of the
    compute lock (a pre-copy, a checkpoint of another resident session) must be able to
    read them: the step thread evaluates them before it lets the lock go."""
    import threading
    import time

    import mlx.core as mx

    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(shared_kv=True))
    rows, layers = h.steps.shared, h.lm.model.model.layers
    middle = len(layers) // 2
    armed, read, errors, readers = threading.Event(), [], [], []

    def reader():  # queued for the lock while the failing step holds it: served next
        try:
            with h.compute:
                shapes = [np.array(x).shape for x in rows.k + rows.v]
            read.extend(shapes)
        except Exception as e:  # noqa: BLE001 (the failure under test)
            errors.append(repr(e))
        finally:
            mx.clear_streams()

    def fault(*args):  # in a resident step, with a reader queued for the lock
        if not (rows.k and args[0].shape[0] > 1):
            return False
        readers.append(threading.Thread(target=reader))
        readers[-1].start()
        time.sleep(0.3)  # the reader takes its ticket for the lock
        return True

    layers[middle] = FailingLayer(layers[middle], armed, fault)
    try:
        sessions = [h.create_session(sampling=SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(2)]
        outcome = {}

        def chat(s):
            try:
                outcome[s.id] = len(list(s.send("Tell me about ferries.")))
            except Exception as e:  # noqa: BLE001 - the injected fault, as the session hears it
                outcome[s.id] = str(e)

        ts = [threading.Thread(target=chat, args=(s,)) for s in sessions]
        for t in ts:
            t.start()
        deadline = time.time() + 60
        while not h.steps.stats["resident_steps"] and time.time() < deadline:
            time.sleep(0.01)
        armed.set()
        for t in ts:
            t.join(120)
        assert not armed.is_set() and readers, "no resident step ran after the fault was armed"
        readers[0].join(30)
        assert errors == [] and len(read) == 2 * len(layers)
        assert any("a fault injected mid-step" in str(o) for o in outcome.values())
        layers[middle] = layers[middle].layer
        again = h.create_session(sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len([e for e in again.send("And now?") if e.token >= 0]) == 4  # the host goes on
    finally:
        if isinstance(layers[middle], FailingLayer):
            layers[middle] = layers[middle].layer
        h.close()


def test_a_failed_step_leaves_the_sessions_own_cache_readable(smollm):
    """The same for a session on a cache of its own: the layers its failed step
    reached wrote into it lazily on the step thread; a checkpoint taken afterwards,
    on another thread, reads the cache (once "There is no Stream(cpu, N)")."""
    import threading

    import mlx.core as mx

    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(shared_kv=False))
    layers = h.lm.model.model.layers
    middle, armed = len(layers) // 2, threading.Event()
    layers[middle] = FailingLayer(layers[middle], armed)
    try:
        s = h.create_session(sampling=SamplingParams(max_tokens=8, ignore_eos=True))
        assert len([e for e in s.send("Tell me about ferries.") if e.token >= 0]) == 8
        armed.set()
        with pytest.raises(Exception, match="a fault injected mid-step"):
            list(s.send("And more?"))
        assert not armed.is_set()
        data = []
        def take():
            try:
                data.append(b"".join(snapshot.snapshot(s)))
            finally:
                mx.clear_streams()  # (this thread's streams go with it: ml-explore/mlx#3395)

        t = threading.Thread(target=take)
        t.start()
        t.join(60)
        assert data and data[0]
        r = restore.restore(h, data, session_id="copy")
        assert r.history == s.history
        # the copy continues the failed turn (docs/sessions.md), then takes a new message
        assert [e.token for e in r.continue_turn(0) if e.token >= 0]
        assert [e.token for e in r.send("Thanks.") if e.token >= 0]
        # the failure came through the guest's model call, midway: its session says so, in one line
        with pytest.raises(GuestTrap, match="unusable after an earlier failure: SessionError: model step failed"):
            list(s.send("And more?"))
    finally:
        if isinstance(layers[middle], FailingLayer):
            layers[middle] = layers[middle].layer
        h.close()


def test_pre_copy_pieces_are_sized_by_one_tokens_bytes_not_the_padded_buffers(smollm):
    """A resident row is as long as the host's longest session and its growth, and a
    KVCache's buffer as its capacity: per-token bytes must not come from the length in
    use (pre-copy's ~1 MB pieces would be up to ~16× smaller than asked)."""
    import mlx.core as mx

    from kvferry.checkpoint.snapshot import Snapshotter

    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(shared_kv=True))
    try:
        short, long = (h.create_session(sampling=SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(2))
        "".join(e.text for e in short.send("Hi."))
        "".join(e.text for e in long.send("A longer prompt about ferries and their crews."))
        one = short.kv_token_bytes()  # keys and values of every layer, from the model's shape
        assert isinstance(short.cache[0], KVCache) and short.cache[0].keys.shape[2] > 2 * len(short.history)
        assert Snapshotter(short).kv_bytes_per_token() == one  # its own cache, padded to capacity
        with h.compute:
            assert h.steps.shared.take([short, long])
            mx.eval(h.steps.shared.k + h.steps.shared.v)  # (built here, not on the step thread)
        assert isinstance(short.cache[0], ResidentKV) and h.steps.shared.tokens > 2 * len(short.history)
        assert Snapshotter(short).kv_bytes_per_token() == one  # a row padded to the longest session
        assert Snapshotter(short).chunk_tokens(1 << 20) == (1 << 20) // (one // len(short.cache))
    finally:
        h.close()
