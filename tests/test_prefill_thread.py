"""Long prompts prefilled on the host's prefill thread while others decode
(kvferry.prefill_thread; a GPU host's default, forced on here on the CPU)."""

import sys
import threading
import time

import pytest
from prometheus_client import generate_latest

from kvferry.errors import SessionError
from kvferry.host import ModelHost
from kvferry.policy import HostPolicy
from kvferry.session import SamplingParams, SessionOptions

SHORT = ["Count to five.", "Name two rivers.", "What is a ferry?"]
LONG = " ".join(f"Line {i}: the ferry crossed the strait at dawn with {i} cars aboard." for i in range(20))


def greedy(n):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


@pytest.fixture(scope="module")
def host(smollm):
    """The GPU's defaults (shared KV rows, guests on the step thread, the prefill
    thread), no prompt reuse: every prompt is prefilled whole."""
    interval = sys.getswitchinterval()  # the prefill thread sets it process-wide: the suite's later tests get it back
    h = ModelHost(lm=smollm, progress=False, policy=HostPolicy(
        max_batch=8, shared_kv=True, drive_guests=True, prefill_thread=True, prefix_cache_bytes=0))
    assert h.steps.prefiller is not None
    cpu_default = ModelHost(lm=smollm, progress=False)
    assert cpu_default.steps.prefiller is None  # off by default on a CPU
    cpu_default.close()
    yield h
    h.close()
    sys.setswitchinterval(interval)


def reply(host, session, text):
    return [e.token for e in session.send(text) if e.token >= 0]


def alone(host, texts, n):
    """A conversation's replies with nothing else on the host (its prompts prefilled in steps)."""
    s = host.create_session(sampling=greedy(n))
    try:
        return [reply(host, s, t) for t in texts]
    finally:
        host.close_session(s.id)


def beside_decoders(host, fn):
    """Run ``fn`` once three short replies are decoding; returns (its result, their tokens)."""
    sessions = [host.create_session(sampling=greedy(40)) for _ in SHORT]
    out, started = {}, threading.Barrier(len(SHORT) + 1)

    def decode(i):
        it = sessions[i].send(SHORT[i])
        first = next(it).token
        started.wait()
        out[i] = [first] + [e.token for e in it if e.token >= 0]
    ts = [threading.Thread(target=decode, args=(i,)) for i in range(len(SHORT))]
    for t in ts:
        t.start()
    started.wait(120)
    try:
        result = fn()
    finally:
        for t in ts:
            t.join(300)
        for s in sessions:
            host.close_session(s.id)
    return result, [out.get(i) for i in range(len(SHORT))]


def test_a_long_prompt_beside_decoders_is_prefilled_on_its_thread_exactly(host):
    solo_long = alone(host, [LONG], 8)[0]
    solo_short = [alone(host, [t], 40)[0] for t in SHORT]
    before, logits0 = dict(host.steps.prefiller.stats), host.steps.stats["prefill_logits"]
    s = host.create_session(sampling=greedy(8))
    got, bystanders = beside_decoders(host, lambda: reply(host, s, LONG))
    st = host.steps.prefiller.stats
    assert st["prompts"] == before["prompts"] + 1
    # the whole prompt (the last generated token is not in the history yet)
    assert st["tokens"] - before["tokens"] == len(s.history) - len(got) + 1 > 64
    # its first token came from the prefill's own logits: no forward pass on the step thread for it
    assert host.steps.stats["prefill_logits"] == logits0 + 1
    assert got == solo_long  # the same prompt, in another thread: the same tokens
    assert bystanders == solo_short  # and the decoders never noticed
    assert f"kvferry_prefill_thread_tokens {float(st['tokens'])}" in generate_latest(host.metrics.registry).decode()
    host.close_session(s.id)


def test_a_second_long_turn_continues_the_cache_it_copied(host):
    turns = ["Hello there.", LONG]
    solo = alone(host, turns, 6)
    s = host.create_session(sampling=greedy(6))
    first = reply(host, s, turns[0])
    n0 = host.steps.prefiller.stats["prompts"]
    second, _ = beside_decoders(host, lambda: reply(host, s, turns[1]))
    assert host.steps.prefiller.stats["prompts"] == n0 + 1
    assert [first, second] == solo
    host.close_session(s.id)


def test_a_session_closed_during_its_prefill_hears_it_and_the_host_goes_on(host):
    s = host.create_session(sampling=greedy(4), options=SessionOptions(prefill_step=8))
    err = {}

    def send():
        try:
            reply(host, s, LONG * 2)
        except SessionError as e:
            err["e"] = e

    def close_mid_prefill():
        t = threading.Thread(target=send)
        t.start()
        deadline = time.time() + 120
        while host.steps.prefiller.busy is None and time.time() < deadline:
            time.sleep(0.001)
        host.close_session(s.id)
        t.join(120)
    _, bystanders = beside_decoders(host, close_mid_prefill)
    assert "closed during its prompt" in str(err.get("e")) and "\n" not in str(err["e"])
    assert all(b and len(b) == 40 for b in bystanders)
    assert host.steps.prefiller.busy is None and not host.steps.prefiller.queue
    assert alone(host, ["Name two rivers."], 4)[0]  # the host serves on
