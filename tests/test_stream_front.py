"""The stream front (serve --stream-front): a host's Send streams served by a process
of their own, on in-process hosts (real gRPC on loopback, a real front process, tiny model)."""

import threading
import time

import pytest

from kvferry import AuthError, Client, HostDownError, UnknownSessionError
from kvferry.host import ModelHost
from kvferry.server import HostServer

TOKEN = "front"


@pytest.fixture(scope="module")
def pair(tiny_model):
    hosts = [ModelHost(str(tiny_model), progress=False) for _ in range(2)]
    servers = [HostServer(h, "127.0.0.1:0", token=TOKEN, stream_front=True).start() for h in hosts]
    servers[0].peers, servers[1].peers = (servers[1].address,), (servers[0].address,)
    yield servers
    for s, h in zip(servers, hosts):
        s.stop()
        h.close()


def direct(srv) -> Client:
    """A client whose Sends go to the host itself, as one that never asks for a front."""
    c = Client(srv.address, TOKEN)
    c._streams[srv.address] = srv.address
    return c


def test_a_reply_streams_through_the_front_as_through_the_host(pair):
    srv = pair[0]
    c = Client(srv.address, TOKEN)
    assert c.health()["stream_address"] == srv.stream_address != srv.address
    before = dict(srv.egress.stats)
    ours = c.create_session(max_tokens=24, ignore_eos=True)
    twin = direct(srv).create_session(max_tokens=24, ignore_eos=True)
    for prompt in ("hello there", "and again"):  # two turns: the second starts from the first's KV
        via_front = [ch.token for ch in ours.events(prompt) if ch.token >= 0]
        assert via_front == [ch.token for ch in twin.events(prompt) if ch.token >= 0] and len(via_front) == 24
    assert c._streams[srv.address] == srv.stream_address  # the SDK found the front and used it
    st = srv.egress.stats
    assert st["sends"] - before["sends"] == 2 and st["items"] - before["items"] >= 48
    assert not srv.egress.streams  # each relayed Send ended on the host too


def test_errors_cross_the_front_as_one_line(pair):
    srv = pair[0]
    s = Client(srv.address, TOKEN).create_session(max_tokens=4)
    wrong = Client(srv.address, "not-the-token")
    wrong._streams[srv.address] = srv.stream_address  # straight to the front, whose host checks the token
    with pytest.raises(AuthError, match="auth failed"):
        list(wrong.session(s.id).send("hi"))
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
        list(Client(srv.address, TOKEN).session("nope").send("hi"))


def test_a_client_that_leaves_mid_reply_stops_its_turn_on_the_host(pair):
    srv = pair[0]
    s = Client(srv.address, TOKEN).create_session(max_tokens=400, ignore_eos=True)
    events = s.events("tell me a long story")
    got = [next(events).token for _ in range(3)]
    events.close()  # the client goes away: the front cancels the Send on the host
    deadline = time.time() + 10
    while srv.egress.streams and time.time() < deadline:
        time.sleep(0.01)
    assert not srv.egress.streams
    made = srv.host.get(s.id).memory()["tokens"]
    time.sleep(0.3)
    assert srv.host.get(s.id).memory()["tokens"] == made  # no longer generating
    rest = [ch.token for ch in s.resume(len(got)) if ch.token >= 0]  # the turn stayed open to go on
    assert 0 < len(rest) <= 400 - len(got)


def test_a_reply_that_moves_mid_way_is_followed_from_front_to_front(pair):
    src, dst = pair
    c = Client(src.address, TOKEN)
    s = c.create_session(max_tokens=40, ignore_eos=True)
    twin = direct(src).create_session(max_tokens=40, ignore_eos=True)
    want = [ch.token for ch in twin.events("move me") if ch.token >= 0]
    got: list[int] = []
    th = threading.Thread(target=lambda: got.extend(ch.token for ch in s.events("move me") if ch.token >= 0))
    th.start()
    while len(got) < 5:
        time.sleep(0.005)
    Client(src.address, TOKEN).session(s.id).migrate(to=dst.address)
    th.join(60)
    assert got == want and s.host == dst.address
    assert c._streams.get(dst.address) == dst.stream_address  # it followed onto the target's front


def test_when_the_front_dies_its_streams_end_and_the_host_serves_on(tiny_model):
    h = ModelHost(str(tiny_model), progress=False)
    srv = HostServer(h, "127.0.0.1:0", token=TOKEN, stream_front=True).start()
    try:
        s = Client(srv.address, TOKEN).create_session(max_tokens=400, ignore_eos=True)
        events = s.events("a long reply")
        next(events)
        srv.front.proc.kill()
        with pytest.raises(HostDownError, match="host down or unreachable"):
            for _ in events:
                pass
        deadline = time.time() + 10
        while srv.egress.streams and time.time() < deadline:
            time.sleep(0.01)
        assert not srv.egress.streams  # the host stopped what the front had started
        again = direct(srv).session(s.id)
        assert [ch for ch in again.resume(1) if ch.token >= 0]  # and still serves the session directly
    finally:
        srv.stop()
        h.close()
