"""Continuous batching on one host: many sessions in one decode batch, each still
sampled by its own guest; joining, leaving, admission and hostile guests."""

import re
import threading
import time

import pytest

from kvferry.bench.consistency import consistency
from kvferry.errors import GuestError, HostFullError
from kvferry.guest import GuestTrap
from kvferry.host import ModelHost
from kvferry.policy import HostPolicy
from kvferry.session import SamplingParams, SessionOptions
from test_sessions import CHAT_WAT

PROMPTS = ["Tell me about rivers.", "What is a ferry?", "Name three colours.", "Why is the sky blue?"]


def greedy(n):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


@pytest.fixture(scope="module", params=[(False, False, False, False), (True, False, False, False),
                                        (True, True, False, False), (True, True, True, False),
                                        (True, True, True, True)],
                ids=["per-session-kv", "shared-kv", "shared-kv-step-guests", "shared-kv-step-guests-run-on",
                     "gpu-layout"])
def host(smollm, request):
    """A host of each KV layout: per-session caches and shared resident rows
    (kvferry.resident, the default), on this CPU; the last three also
    run decode steps' guests on the step thread (serve --guest-thread step, the
    GPU default), and the last two queue each reply's next decode before its
    session's thread comes back for it (run on, their default; the third has
    KVFERRY_RUN_ON=0). The last also prefills short prompts in bursts, in passes
    of their own (kvferry.burst): what a GPU host does."""
    shared, drive, run_on, bursts = request.param
    with pytest.MonkeyPatch.context() as mp:  # (read when the host starts)
        mp.setenv("KVFERRY_RUN_ON", "1" if run_on else "0")
        mp.setenv("KVFERRY_BURST", "1" if bursts else "0")
        h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(max_batch=8, shared_kv=shared, drive_guests=drive))
    assert (h.steps.shared is not None) == shared and h.steps.drive == drive and h.steps.runs_on == run_on
    assert h.steps.bursting == bursts
    yield h
    h.close()


@pytest.fixture(scope="module")
def solo(host):
    """Each prompt's greedy reply run alone (nothing else on the host)."""
    out = {}
    for p in PROMPTS:
        s = host.create_session(sampling=greedy(16))
        out[p] = [e.token for e in s.send(p) if e.token >= 0]
        host.close_session(s.id)
    return out


def together(host, prompts, n=16, start=None, **kw):
    """Run one turn per prompt, all at once; returns {prompt: tokens}."""
    sessions = {p: host.create_session(sampling=greedy(n), **kw) for p in prompts}
    out, errors = {}, {}
    go = threading.Barrier(len(prompts))

    def one(p):
        go.wait()
        try:
            out[p] = [e.token for e in sessions[p].send(p) if e.token >= 0]
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[p] = e
    ts = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    for s in sessions.values():
        host.close_session(s.id)
    return out, errors


def test_concurrent_sessions_share_decode_steps_and_match_solo(host, solo):
    rows0, steps0 = host.steps.stats["decode_rows"], host.steps.stats["steps"]
    out, errors = together(host, PROMPTS)
    assert not errors
    rows, steps = host.steps.stats["decode_rows"] - rows0, host.steps.stats["steps"] - steps0
    assert rows >= 4 * 15 and steps < rows  # several sessions per forward pass
    assert host.steps.stats["max_batch_seen"] >= 2
    assert out == solo  # attention per row is exact; on this machine the matmuls agree too
    if host.steps.runs_on:  # each next decode was queued before its session's thread came back
        assert host.steps.stats["run_on"] >= len(PROMPTS) * 10
    else:
        assert host.steps.stats["run_on"] == 0
    again, _ = together(host, PROMPTS)
    assert again == out  # the same sessions together again: the same tokens
    if host.steps.shared is not None:  # they decoded in resident rows, and left them when they closed
        assert host.steps.stats["resident_joins"] >= 2 * len(PROMPTS)
        deadline = time.time() + 10
        while host.steps.shared.owner and time.time() < deadline:
            time.sleep(0.01)
        assert host.steps.shared.owner == [] and host.steps.shared.k == []


def test_batched_logits_agree_with_solo(host):
    prompts = [list(host.lm.tokenizer.encode(p)) for p in PROMPTS]
    r = consistency(host.lm.model, prompts, 12, shared=host.steps.shared is not None)
    assert r["teacher_forced_top1"] >= 0.99 and r["kv"] == ("shared" if host.steps.shared else "per-session")
    assert 0.0 <= r["greedy_equal_solo"] <= 1.0 and r["prompts"] == 4


def test_join_and_leave_a_running_batch(host, solo):
    a, b, c = PROMPTS[:3]
    sa, sb = host.create_session(sampling=greedy(16)), host.create_session(sampling=greedy(16))
    quitter = host.create_session(sampling=greedy(16))
    ga, gb, gq = sa.send(a), sb.send(b), quitter.send(PROMPTS[3])
    got = {a: [], b: []}
    for _ in range(4):  # three sessions stepping in turn
        got[a].append(next(ga).token)
        got[b].append(next(gb).token)
        next(gq)
    gq.close()  # a client that goes away mid-reply leaves the batch at once
    assert host.admission.position(quitter) == 0 and quitter not in host.admission.running
    late = {}
    th = threading.Thread(target=lambda: late.update(together(host, [c])[0]))
    th.start()  # a newcomer joins while a and b are mid-reply
    got[a] += [e.token for e in ga if e.token >= 0]
    got[b] += [e.token for e in gb if e.token >= 0]
    th.join(300)
    assert got[a] == solo[a] and got[b] == solo[b] and late[c] == solo[c]
    for s in (sa, sb, quitter):
        host.close_session(s.id)


def test_admission_queue_and_its_limit(smollm):
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(max_batch=1, max_queue=1))
    try:
        first, second, third = (h.create_session(sampling=greedy(6)) for _ in range(3))
        g1 = first.send("one")
        next(g1)  # first holds the batch's only place
        waited = {}
        th = threading.Thread(target=lambda: waited.update(tokens=[e.token for e in second.send("two")]))
        th.start()
        deadline = time.time() + 30
        while h.admission.position(second) != 1 and time.time() < deadline:
            time.sleep(0.01)
        assert second.describe()["queue_position"] == 1
        with pytest.raises(HostFullError, match=r"1 replies generating \(serve --max-batch 1\) and 1 waiting"):
            next(third.send("three"))
        assert not waited  # still queued behind first
        g1.close()  # first's client goes away: its place goes to the queue's head
        th.join(120)
        assert len([t for t in waited["tokens"] if t >= 0]) == 6
    finally:
        h.close()


def _turn_state(host, prompt, n=8, owner=""):
    """One greedy reply in a new session: its tokens, history and KV (numpy)."""
    import numpy as np

    s = host.create_session(sampling=greedy(n), owner=owner)
    tokens = [e.token for e in s.send(prompt) if e.token >= 0]
    state = (tokens, list(s.history), [np.array(x) for c in s.cache for x in c.state])
    host.close_session(s.id)
    return state


def test_new_sessions_start_from_a_kept_prompt_prefix_exactly(smollm):
    """A second chat's shared template head comes from the first's KV, copied, and
    gives the same tokens and the same KV bits as prefilling it (a host without reuse)."""
    import numpy as np

    kept = ModelHost(lm=smollm, progress=False)
    plain = ModelHost(lm=smollm, progress=False, policy=HostPolicy(prefix_cache_bytes=0))
    try:
        _turn_state(kept, PROMPTS[0])
        assert len(kept.prefix.entries) == 1 and kept.prefix.stats["hits"] == 0
        got = _turn_state(kept, PROMPTS[1])
        assert kept.prefix.stats["hits"] == 1 and kept.prefix.stats["reused_tokens"] >= 16
        want = _turn_state(plain, PROMPTS[1])
        assert plain.prefix.stats["hits"] == 0 and not plain.prefix.entries
        assert got[:2] == want[:2]
        reused = kept.prefix.stats["reused_tokens"]
        for a, b in zip(got[2], want[2]):
            # the reused prefix is a copy: the same bits. The rest went in as a pass of
            # another size, whose edge rows the BLAS may round differently (~1e-6 here)
            if a.ndim < 4:  # (an offset)
                assert np.array_equal(a, b)
                continue
            assert np.array_equal(a[..., :reused, :], b[..., :reused, :])
            assert np.allclose(a, b, rtol=1e-5, atol=1e-5)
        first = kept.steps.stats["prefill_tokens"]
        _turn_state(kept, PROMPTS[1])  # the same prompt again: all but its last token reused
        assert kept.steps.stats["prefill_tokens"] == first
        _turn_state(kept, PROMPTS[1], owner="another-key")  # another client's prompts are not its to time
        assert kept.prefix.stats["hits"] == 2 and kept.steps.stats["prefill_tokens"] > first
        from prometheus_client import generate_latest

        assert "kvferry_prefix_cache_hits 2.0" in generate_latest(kept.metrics.registry).decode()
    finally:
        kept.close()
        plain.close()


def test_a_burst_of_new_sessions_starts_from_a_kept_prefix_in_the_shared_rows(smollm, monkeypatch):
    """Newcomers arriving together take the kept prefix into their rows of the shared
    buffers (one write a layer for all) and prefill the rest as one batch
    (kvferry.burst): the same tokens as each alone on a host without reuse, and their
    prompts kept for the next, copied out of the rows."""
    import numpy as np

    monkeypatch.setenv("KVFERRY_BURST", "1")
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(max_batch=8, drive_guests=True))
    monkeypatch.setenv("KVFERRY_BURST", "0")
    plain = ModelHost(lm=smollm, progress=False, policy=HostPolicy(prefix_cache_bytes=0))
    try:
        assert h.steps.bursting and not plain.steps.bursting
        first = _turn_state(h, PROMPTS[0])  # kept: the others start from its template head
        assert first[:2] == _turn_state(plain, PROMPTS[0])[:2]
        want = {p: _turn_state(plain, p)[0] for p in PROMPTS[1:]}
        chunks0 = h.steps.stats["burst_chunks"]
        runner = h.create_session(sampling=greedy(24))  # decoding while the burst comes in
        first_tokens = iter(runner.send(PROMPTS[0]))
        ran = [next(first_tokens).token for _ in range(2)]
        got, errors = together(h, PROMPTS[1:], n=8)
        ran += [e.token for e in first_tokens if e.token >= 0]
        h.close_session(runner.id)
        assert not errors and got == want
        s = plain.create_session(sampling=greedy(24))
        assert ran == [e.token for e in s.send(PROMPTS[0]) if e.token >= 0]  # the bystander's tokens unchanged
        plain.close_session(s.id)
        # every newcomer started from the kept prefix (the runner too), several in one burst
        assert h.prefix.stats["hits"] == len(PROMPTS) and h.steps.stats["burst_chunks"] - chunks0 >= 2
        from prometheus_client import generate_latest

        assert f"kvferry_burst_prompts {float(h.steps.stats['burst_chunks'])}" in generate_latest(
            h.metrics.registry).decode()
        keys = {k[1] for k in h.prefix.entries}
        ids = [tuple(h.lm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                        add_generation_prompt=True))[:-1] for p in PROMPTS]
        assert set(ids) <= keys  # every prompt kept, the burst's copied out of the rows
        for k, (_, layers) in h.prefix.entries.items():  # each entry its own copy, its prompt's length
            assert all(x.shape[2] == len(k[1]) for pair in layers for x in pair)
        # an entry kept from the rows holds what prefilling that prompt alone gives
        s = plain.create_session(sampling=greedy(1))
        [e for e in s.send(PROMPTS[2])]
        solo_k = np.array(s.cache[3].state[0])[..., :len(ids[2]), :]
        plain.close_session(s.id)
        kept_k = np.array(h.prefix.entries[("", ids[2])][1][3][0])
        assert np.allclose(kept_k, solo_k, rtol=1e-5, atol=1e-5)
    finally:
        h.close()
        plain.close()


def test_later_turns_of_chats_go_on_together_in_bursts(smollm, monkeypatch):
    """Three chats whose second turns arrive together: those prompts (sessions with
    KV of their own, joining the shared rows again) go in as a burst too, with the
    same tokens as the same turns one after another on a host without bursts or reuse."""
    monkeypatch.setenv("KVFERRY_BURST", "1")
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(drive_guests=True))
    monkeypatch.setenv("KVFERRY_BURST", "0")
    plain = ModelHost(lm=smollm, progress=False, policy=HostPolicy(prefix_cache_bytes=0))
    turns = [PROMPTS[:3], ["And lakes?", "Why?", "Now three animals, please."]]

    def chats(host, at_once):
        sessions = [host.create_session(sampling=greedy(6)) for _ in range(3)]
        out = {}

        def one(i, prompt):
            out[i, prompt] = [e.token for e in sessions[i].send(prompt) if e.token >= 0]
        for prompts in turns:
            if at_once:
                host.steps.expect_soon(sessions)  # (the next step waits for all three, as warm's does)
                ts = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(300)
            else:
                for i, p in enumerate(prompts):
                    one(i, p)
        for s in sessions:
            host.close_session(s.id)
        return out
    try:
        got = chats(h, True)
        assert h.steps.stats["burst_chunks"] >= 6 and h.steps.stats["burst_steps"] >= 2  # both turns
        assert got == chats(plain, False) and len(got) == 6
    finally:
        h.close()
        plain.close()


def test_a_bursting_host_warms_its_burst_path(smollm, monkeypatch):
    """A GPU host compiles its kernels at start (ModelHost.warm): its warm-up
    prompts go in together, as a burst, so a fresh machine's first burst of users
    does not wait for that compilation."""
    monkeypatch.setenv("KVFERRY_BURST", "1")
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(drive_guests=True))
    try:
        h.warm()
        # its rounds of short prompts as bursts (3, then 8 of different lengths), its long one alone
        assert h.steps.stats["burst_steps"] >= 2 and h.steps.stats["burst_chunks"] >= 3 + 8
        assert not h.sessions and not h.admission.running
    finally:
        h.close()


def test_kept_prefixes_stay_under_their_budget(smollm):
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(prefix_cache_bytes=4_000_000))
    try:
        for p in PROMPTS:  # each prompt's KV is ~1.2-1.5 MB in float32
            _turn_state(h, p, n=2)
            assert 0 < h.prefix.bytes <= 4_000_000
        assert len(h.prefix.entries) < len(PROMPTS)  # the oldest went
        assert list(h.prefix.entries)[-1] == ("", tuple(h.lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[-1]}], add_generation_prompt=True))[:-1])
    finally:
        h.close()


def test_kv_budget_refuses_a_reply_that_cannot_fit(smollm):
    h = ModelHost(lm=smollm, progress=False, max_kv_bytes=2_000_000)
    try:
        s = h.create_session(sampling=greedy(200))
        with pytest.raises(HostFullError, match=r"may need .* MB of KV cache .*--max-kv-mb"):
            next(s.send("hello"))
        ok = h.create_session(sampling=greedy(4))
        assert len([e for e in ok.send("hi") if e.token >= 0]) == 4
    finally:
        h.close()


TRAPS_AT_STEP_4 = CHAT_WAT.replace("STEP", """
    global.get $n i32.const 1 i32.add global.set $n
    global.get $n i32.const 4 i32.gt_u if unreachable end
    i32.const 65 call $decode drop
    i32.const 65""")
SLOW_AT_STEP_4 = CHAT_WAT.replace("(global $n (mut i32) (i32.const 0))", """(global $n (mut i32) (i32.const 0))
  (global $i (mut i32) (i32.const 0))""").replace("STEP", """
    global.get $n i32.const 1 i32.add global.set $n
    global.get $n i32.const 4 i32.gt_u if
      (loop $l global.get $i i32.const 1 i32.add global.set $i
               global.get $i i32.const 400000000 i32.lt_u br_if $l)
    end
    i32.const 65 call $decode drop
    i32.const 65""")


@pytest.mark.parametrize("wat,error,match", [
    (TRAPS_AT_STEP_4, GuestTrap, r"aborted \(unreachable\) in kvferry_chat_step"),
    # on its session's thread the CPU budget ends it; on the step thread, a deadline of 5 budgets
    (SLOW_AT_STEP_4, (GuestError, GuestTrap),
     r"ms of CPU in one step, over this host's budget of 20 ms|exceeded its deadline of 100 ms in kvferry_chat_step"),
])
def test_a_failing_guest_leaves_the_batch_and_the_others_go_on(host, solo, tmp_path, wat, error, match):
    path = tmp_path / "bad.wasm"
    path.write_text(wat)
    bad = host.create_session(str(path), greedy(16), SessionOptions(deadline_ms=5000))
    caught = {}

    def run_bad():
        try:
            list(bad.send("hello"))
        except Exception as e:  # noqa: BLE001 - checked below
            caught["e"] = e
    th = threading.Thread(target=run_bad)
    th.start()
    out, errors = together(host, PROMPTS[:3])
    th.join(120)
    assert isinstance(caught.get("e"), error) and caught["e"].args[0].count("\n") == 0
    assert re.search(match, str(caught["e"]))
    assert not errors and out == {p: solo[p] for p in PROMPTS[:3]}
    assert bad not in host.admission.running
    host.close_session(bad.id)


def test_a_checkpoint_taken_mid_batch_continues_identically(host, solo):
    from kvferry.checkpoint import restore, snapshot

    x_prompt = PROMPTS[3]
    x = host.create_session(sampling=greedy(16))
    it = x.send(x_prompt)
    head = [next(it).token for _ in range(5)]  # x is mid-reply, between two steps
    others = {}
    th = threading.Thread(target=lambda: others.update(together(host, PROMPTS[:2])[0]))
    th.start()  # two more sessions decode while x is checkpointed and restored
    deadline = time.time() + 120
    while not host.admission.running.keys() - {x} and time.time() < deadline:
        time.sleep(0.01)
    data = b"".join(snapshot.snapshot(x))
    host.close_session(x.id)
    assert x not in host.admission.running  # closing frees its place though its generator lives on
    y = restore.restore(host, [data])
    rest = [e.token for e in y.continue_turn(from_index=5) if e.token >= 0]
    th.join(300)
    assert head + rest == solo[x_prompt]
    assert others == {p: solo[p] for p in PROMPTS[:2]}
    host.close_session(y.id)


@pytest.fixture(scope="module")
def speculating(smollm):
    """A host that speculates the greedy next step over shared KV rows, its guests on
    the step thread (the GPU defaults), on this CPU. Without run on, so that a
    session between two steps holds a guess, not a decode queued ahead (the ``host``
    fixture's last layout covers that)."""
    with pytest.MonkeyPatch.context() as mp:  # (read when the host starts)
        mp.setenv("KVFERRY_RUN_ON", "0")
        h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(max_batch=8, speculate=True, shared_kv=True,
                                                                   drive_guests=True))
    assert h.steps.speculate and not host_default_speculates(smollm)
    yield h
    h.close()


def host_default_speculates(smollm) -> bool:
    h = ModelHost(lm=smollm, progress=False)
    try:
        return h.steps.speculate  # on a CPU: off by default
    finally:
        h.close()


def test_step_top1_is_numpys_first_maximum():
    """The (argmax, max) a step computes on the device for greedy guests is what
    numpy's argmax of the logits gives, the first of equal maxima included."""
    import mlx.core as mx
    import numpy as np

    from kvferry.top1 import StepTop1

    x = np.random.default_rng(0).normal(size=(5, 1000)).astype(np.float32)
    x[1, 7] = x[1, 400] = x[1].max() + 1  # a tie
    for rows in ([x[0]], list(x)):
        top = StepTop1([mx.array(r) for r in rows])
        mx.eval(top.pairs)
        for i, r in enumerate(rows):
            token, bits = top.row(i)
            assert token == int(np.argmax(r)) and np.array([bits], np.int32).view(np.float32)[0] == r.max()
    assert StepTop1([mx.array(r) for r in x]).row(1)[0] == 7


def test_a_steps_row_logits_keep_their_batch_for_the_top1():
    """A step's rows keep the batch they came from, so its top-1 reads that batch
    instead of stacking the rows back (a copy a row: a kernel each on a GPU); rows
    taken from one speculated step, in any order, keep one batch, and the top-1's
    answers are the rows'. Each row is an array of its own, not a view that would
    keep the whole batch alive while its session idles between turns."""
    import io

    import mlx.core as mx
    import numpy as np

    from kvferry.step_forward import RowLogits
    from kvferry.top1 import StepTop1

    x = np.random.default_rng(1).normal(size=(5, 300)).astype(np.float32)
    batch = mx.array(x) * 1  # lazy, as a step's
    rows = RowLogits(batch)
    mx.eval(rows)
    assert [np.array(r).tolist() for r in rows] == x.tolist()
    assert rows.taken(list(range(5))).batch is batch
    dot = io.StringIO()
    mx.export_to_dot(dot, StepTop1(rows).pairs)
    assert dot.getvalue().count('label ="Concatenate"') == 1  # the pairs only: no stack of the rows
    some = rows.taken([3, 0, 4])
    assert [id(r) for r in some] == [id(rows[3]), id(rows[0]), id(rows[4])]
    top = StepTop1(some)
    mx.eval(top.pairs)
    assert [top.row(i)[0] for i in range(3)] == [int(np.argmax(x[j])) for j in (3, 0, 4)]
    assert RowLogits(batch[:1])[0].shape == (300,)


def test_greedy_guests_read_the_steps_top1_not_the_logits(host, solo, monkeypatch):
    """A greedy guest's kv_logits_topk(1) is answered from the step's device top-1
    (kvferry.top1), never from its logits read on the host; the reply is the same."""
    import mlx.core as mx
    import numpy as np

    from kvferry import abi
    from kvferry.top1 import StepTop1

    monkeypatch.setattr(host.steps, "device_top1", True)  # a GPU's way (a CPU reads the logits in place)
    rows, reads = [], []
    real_row, real_array = StepTop1.row, np.array
    monkeypatch.setattr(StepTop1, "row", lambda self, i: rows.append(i) or real_row(self, i))
    monkeypatch.setattr(abi.np, "array", lambda a, *k, **kw: reads.append(a) or real_array(a, *k, **kw))
    s = host.create_session(sampling=greedy(16))
    assert [e.token for e in s.send(PROMPTS[0]) if e.token >= 0] == solo[PROMPTS[0]]
    host.close_session(s.id)
    assert len(rows) >= 15  # every token after the prompt's first
    assert not [a for a in reads if isinstance(a, mx.array) and a.dtype == mx.float32]  # (the logits)


def test_speculation_gives_the_same_tokens_alone_and_batched(speculating, solo):
    for p in PROMPTS[:2]:
        s = speculating.create_session(sampling=greedy(16))
        assert [e.token for e in s.send(p) if e.token >= 0] == solo[p]
        speculating.close_session(s.id)
    st = speculating.steps.stats
    assert st["speculation_hits"] >= 2 * 14 and st["speculated"] >= st["speculation_hits"]
    out, errors = together(speculating, PROMPTS)
    assert not errors and all(len(out[p]) == 16 for p in PROMPTS)
    ref, _ = together(speculating, PROMPTS)  # the same composition again: the same tokens
    assert out == ref
    assert not speculating.steps.guesses  # every guess is taken or dropped when its session goes


def test_a_speculated_resident_step_schedules_the_buffers_not_every_rows_cache(speculating, solo, monkeypatch):
    """A guessed step over resident rows hands the device its logits and the layer
    buffers, not a slice of every row's cache on every layer (a row's caches are
    views of the buffers: slicing them all took half a 64-row GPU step's host time)."""
    import mlx.core as mx

    scheduled, real = [], mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: scheduled.append(sum(len(x) if isinstance(x, list) else 1
                                                                           for x in a)) or real(*a))
    out, errors = together(speculating, PROMPTS)
    assert not errors and out == {p: solo[p] for p in PROMPTS}
    layers = len(speculating.lm.model.layers)
    assert scheduled and max(scheduled) <= 2 * layers + len(PROMPTS)  # buffers + logits


def test_a_session_late_for_a_step_keeps_its_guess(speculating, solo, monkeypatch):
    """With no gather window, sessions come back for the next step one by one, most
    of them a step or more late (as behind a slow stream): each still takes the step
    guessed for it, so every guess is taken but each turn's last, and the replies
    are the solo ones."""
    monkeypatch.setattr(speculating.steps, "gather_s", 0.0)
    st = speculating.steps.stats
    made0, taken0, steps0 = st["speculated"], st["speculation_hits"], st["steps"]
    out, errors = together(speculating, PROMPTS)
    assert not errors and out == {p: solo[p] for p in PROMPTS}
    made, taken = st["speculated"] - made0, st["speculation_hits"] - taken0
    assert st["steps"] - steps0 > 16  # the sessions did not all step together
    assert made >= 8 and taken >= made - len(PROMPTS)


def test_a_wrong_guess_is_computed_again(speculating, solo, monkeypatch):
    """Guesses that never match (here forced): every step runs again on the guest's
    token, so the reply is still the solo one."""
    import mlx.core as mx

    monkeypatch.setattr(speculating.steps, "_greedy",
                        lambda logits, top, pick: mx.argmin(mx.stack([logits[i] for i in pick]), axis=-1))
    before = speculating.steps.stats["speculation_hits"]
    s = speculating.create_session(sampling=greedy(16))
    assert [e.token for e in s.send(PROMPTS[0]) if e.token >= 0] == solo[PROMPTS[0]]
    speculating.close_session(s.id)
    assert speculating.steps.stats["speculation_hits"] == before


def test_a_checkpoint_with_a_guess_in_flight_continues_identically(speculating, solo):
    """On a speculating host (the GPU default) a session between two steps has its
    next step already queued on its cache, one past its offset: a checkpoint taken
    then holds only what the session computed, and the restored reply is the solo one."""
    from kvferry.checkpoint import restore, snapshot

    x = speculating.create_session(sampling=greedy(16))
    it = x.send(PROMPTS[3])
    head = [next(it).token for _ in range(5)]
    assert x in speculating.steps.guesses  # its sixth step is queued
    data = b"".join(snapshot.snapshot(x))
    speculating.close_session(x.id)
    y = restore.restore(speculating, [data])
    rest = [e.token for e in y.continue_turn(from_index=5) if e.token >= 0]
    assert head + rest == solo[PROMPTS[3]]
    speculating.close_session(y.id)


def _moved_at_start(h) -> dict:
    """kvferry.warm_migration on ``h``: what it moved, checked against a reply never moved."""
    from kvferry.warm_migration import PROMPT, warm_migration

    before = h.steps.stats["landed_steps"]
    out = warm_migration(h)
    assert not h.sessions and not h.admission.running  # both sessions closed
    assert not h.steps.held and not h.steps.guesses  # and nothing of theirs kept by the scheduler
    twin = h.create_session(sampling=greedy(len(out["tokens"])))
    ref = [e.token for e in twin.send(PROMPT) if e.token >= 0]
    h.close_session(twin.id)
    assert out["tokens"] == ref  # the landed reply went on as the unmoved one
    assert h.steps.stats["landed_steps"] - before == out["ahead"]
    return out


def test_the_migration_made_at_start_lands_the_step_run_ahead(speculating):
    """A GPU host moves a reply of its own mid-way at start (kvferry.warm_migration):
    on a speculating host the step its source ran ahead goes along, as in a live migration."""
    assert _moved_at_start(speculating)["ahead"]


def test_the_migration_made_at_start_works_in_every_step_layout(host):
    _moved_at_start(host)


def test_a_failed_migration_at_start_is_a_warning_not_a_host_that_fails(caplog):
    from kvferry.warm_migration import warm_logged

    class Broken:
        def create_session(self, *a, **k):
            raise MemoryError("no room")
    with caplog.at_level("WARNING", logger="kvferry.host"):
        warm_logged(Broken())
    assert "MemoryError: no room" in caplog.text and caplog.text.count("\n") == 1


def test_sampling_sessions_are_not_speculated(speculating):
    sp = SamplingParams(temperature=0.8, top_k=40, seed=7, ignore_eos=True, max_tokens=12)
    before = speculating.steps.stats["speculated"]
    s = speculating.create_session(sampling=sp)
    got = [e.token for e in s.send(PROMPTS[1]) if e.token >= 0]
    speculating.close_session(s.id)
    assert speculating.steps.stats["speculated"] == before and len(got) == 12


def test_a_guest_that_turns_guesses_down_is_no_longer_speculated(speculating, host):
    """digits.wasm samples greedily among digit tokens only: its choices are rarely
    the model's argmax, so after MISSES wrong guesses its steps run unspeculated,
    and its reply is the one an unspeculating host gives."""
    from kvferry.speculation import MISSES
    from kvferry.guests import GUESTS_DIR

    def reply(h):
        s = h.create_session(GUESTS_DIR / "digits.wasm", sampling=greedy(12))
        out = [e.token for e in s.send("Tell me about cats.") if e.token >= 0]
        h.close_session(s.id)
        return out
    before = dict(speculating.steps.stats)
    got = reply(speculating)
    assert got == reply(host) and len(got) == 12
    wasted = speculating.steps.stats["speculated"] - before["speculated"]
    assert wasted - (speculating.steps.stats["speculation_hits"] - before["speculation_hits"]) <= MISSES + 1


# A guest that decodes another token than the one it returned (odd steps), and one
# that stops without decoding the token it returned: a host that runs decodes ahead
# for its guests (serve --guest-thread step) must take those steps back.
DECODES_ANOTHER = CHAT_WAT.replace("STEP", """
    global.get $n i32.const 1 i32.add global.set $n
    global.get $n i32.const 1 i32.and i32.const 65 i32.add call $decode drop
    i32.const 65""")
STOPS_UNDECODED = CHAT_WAT.replace("STEP", """
    global.get $n i32.const 1 i32.add global.set $n
    global.get $n i32.const 3 i32.gt_u if i32.const -1 return end
    i32.const 70 call $decode drop
    i32.const 70""")


@pytest.mark.parametrize("wat,decoded", [(DECODES_ANOTHER, [66, 65, 66, 65, 66, 65]), (STOPS_UNDECODED, [70, 70, 70])])
def test_steps_run_ahead_for_a_guest_are_taken_back_when_it_decodes_otherwise(smollm, tmp_path, wat, decoded):
    path = tmp_path / "guest.wasm"
    path.write_text(wat)
    seen = {}
    for drive in (False, True):
        h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(max_batch=8, drive_guests=drive))
        try:
            s = h.create_session(str(path), greedy(6))
            events = list(s.send("hello"))
            prompt = len(s.history) - len(decoded)
            assert s.history[prompt:] == decoded and s.cache[0].offset == len(s.history)
            keys = s.cache[0].state[0][..., :s.cache[0].offset, :]
            seen[drive] = (s.history, [e.token for e in events], keys, s.kv_epoch)
        finally:
            h.close()
    assert seen[True][:2] == seen[False][:2]
    assert (seen[True][2] == seen[False][2]).all().item()
    assert seen[True][3] > seen[False][3]  # the taken-back steps rewrote KV: pre-copy must hear of it


def test_a_reply_stopped_mid_way_takes_back_the_decode_run_on_for_it(host, solo):
    """A client that stops reading mid-reply: the decode the step thread had queued
    for its next token (run on) is taken back, so the session is as its own thread
    left it (the history one token behind the reply), and the reply continued later
    is the solo one."""
    if not host.steps.runs_on:
        pytest.skip("only a host that runs guests on its step thread runs decodes on (unless KVFERRY_RUN_ON=0)")
    p = PROMPTS[1]
    s = host.create_session(sampling=greedy(16))
    retracted = host.steps.stats["run_on_retracted"]
    events = s.send(p)
    first = [next(events).token for _ in range(5)]
    events.close()  # the client is gone: the turn stays open for continue_turn
    assert host.steps.stats["run_on_retracted"] == retracted + 1
    prompt = list(host.lm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
    assert s.history == prompt + first[:4] and s.turn.tokens == first  # the 5th not decoded: as its thread left it
    rest = [e.token for e in s.continue_turn(5) if e.token >= 0]
    assert first + rest == solo[p]
    host.close_session(s.id)
