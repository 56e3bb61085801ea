"""Migration faults on in-process hosts (real gRPC on loopback, tiny model):
a corrupted frame, two migrations of one session at once, a dropped connection."""

import threading
import time

import numpy as np
import pytest

from kvferry.host import ModelHost
from kvferry import Client, RemoteError
from kvferry.server import HostServer

TOKEN = "faults"


@pytest.fixture(scope="module")
def pair(tiny_model):
    hosts = [ModelHost(str(tiny_model), progress=False) for _ in range(2)]
    servers = [HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in hosts]
    servers[0].peers, servers[1].peers = (servers[1].address,), (servers[0].address,)  # migrations go to peers only
    yield servers
    for s, h in zip(servers, hosts):
        s.stop()
        h.close()


def conversation(srv, max_tokens=12):
    c = Client(srv.address, TOKEN)
    s = c.create_session(max_tokens=max_tokens, ignore_eos=True)
    twin = c.create_session(max_tokens=max_tokens, ignore_eos=True)
    assert "".join(s.send("hello there")) == "".join(twin.send("hello there"))
    return c, s, twin


def reading(session, prompt: str, first: int):
    """Read ``session``'s reply to ``prompt`` on a thread (its tokens into the list
    returned) and return once ``first`` of them have arrived: a reply mid-way, to move."""
    got: list[int] = []

    def consume():
        for ch in session.events(prompt):
            if ch.token >= 0:
                got.append(ch.token)
    th = threading.Thread(target=consume)
    th.start()
    while len(got) < first:
        time.sleep(0.005)
    return th, got


@pytest.mark.parametrize("live", [False, True])
def test_corrupted_frame_leaves_the_session_on_the_source(pair, monkeypatch, live):
    from kvferry.checkpoint import snapshot

    a, b = pair
    c, s, twin = conversation(a)
    real = snapshot.Snapshotter.finish

    def corrupt(self):
        for i, frame in enumerate(real(self)):
            if i == 1:
                frame = frame[:-5] + bytes([frame[-5] ^ 0xFF]) + frame[-4:]
            yield frame
    monkeypatch.setattr(snapshot.Snapshotter, "finish", corrupt)
    with pytest.raises(RemoteError, match="checksum mismatch"):
        s.migrate(to=b.address, live=live)
    monkeypatch.setattr(snapshot.Snapshotter, "finish", real)
    assert s.host == a.address and s.id in a.host.sessions and s.id not in b.host.sessions
    assert not b.incoming or all(v.prepared is None for v in b.incoming.values())
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_two_migrations_at_once_one_is_refused(pair):
    a, b = pair
    c, s, twin = conversation(a, max_tokens=40)
    results = []

    def go():
        try:
            results.append(Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True))
        except RemoteError as e:
            results.append(e)
    chunks = []
    th = threading.Thread(target=lambda: chunks.extend(s.events("keep going")))
    th.start()
    while not chunks:
        time.sleep(0.01)
    ts = [threading.Thread(target=go) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    th.join(60)
    errors = [r for r in results if isinstance(r, RemoteError)]
    assert len(results) == 2 and len(errors) == 1
    assert "already in progress" in str(errors[0])
    # the session exists exactly once, and its stream continued intact
    assert (s.id in a.host.sessions) + (s.id in b.host.sessions) == 1
    ref = [x.token for x in twin.events("keep going") if x.token >= 0]
    assert [x.token for x in chunks if x.token >= 0] == ref


def test_dropped_connection_resumes_from_the_last_verified_frame(pair, monkeypatch):
    """The link drops after a few frames; the source reconnects with the same
    migration id and the target asks only for what it has not verified."""
    import grpc

    from kvferry import migration_out as server

    a, b = pair
    c, s, twin = conversation(a)
    real_next = server.Link._next_ack
    state = {"dropped": False, "resumed_at": None}

    def flaky(self):
        if not state["dropped"] and self.acked >= 3:
            state["dropped"] = True
            self.close()
            self._connect()  # what _next_ack does after UNAVAILABLE
            state["resumed_at"] = self.acked
            return None
        return real_next(self)
    monkeypatch.setattr(server.Link, "_next_ack", flaky)
    m = s.migrate(to=b.address)
    assert state["dropped"] and state["resumed_at"] >= 3
    assert s.host == b.address and s.id in b.host.sessions and s.id not in a.host.sessions
    assert "".join(s.send("more")) == "".join(twin.send("more"))
    assert m.bytes > 0
    del grpc


def test_link_drops_after_the_target_committed(pair, monkeypatch):
    """The commit ack is lost with the link: the source reconnects, the target
    answers that this migration already committed — no second copy, no loss."""
    from kvferry import migration_out as server

    a, b = pair
    c, s, twin = conversation(a)
    real_commit = server.Link.commit
    seen = {}

    def lossy_commit(self):
        self.reqs.put(server.pb.MigrationMessage(commit=server.pb.Empty()))
        deadline = time.time() + 30
        while s.id not in b.host.sessions and time.time() < deadline:
            time.sleep(0.01)
        self.close()  # the ack for our commit is lost
        self._connect()
        seen["state"] = self.state
        if self.state != "committed":
            return real_commit(self)
    monkeypatch.setattr(server.Link, "commit", lossy_commit)
    s.migrate(to=b.address)
    assert seen["state"] == "committed"
    assert s.id in b.host.sessions and s.id not in a.host.sessions
    assert "".join(s.send("more")) == "".join(twin.send("more"))


@pytest.mark.parametrize("mode", ["raw", "lossless"])
def test_live_precopy_in_small_chunks_mid_reply(pair, monkeypatch, mode):
    """Pre-copy in 16-token ranges of each layer, paced, while the reply keeps
    generating: the client's stream neither breaks nor repeats, and equals the twin's."""
    from kvferry import migration_out as server

    monkeypatch.setattr(server, "PRECOPY_CHUNK", 1)  # -> the 16-token minimum per frame
    a, b = pair
    c, s, twin = conversation(a, max_tokens=80)
    ref = [ch.token for ch in twin.events("keep going") if ch.token >= 0]
    th, got = reading(s, "keep going", first=4)
    with pytest.raises(RemoteError, match="rate_mb_s must be between 0 and 1e6"):
        Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True, rate_mb_s=-1)
    src = a.host.sessions[s.id]
    m = Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True, mode=mode, rate_mb_s=50)
    assert src.closed  # migrate() returns once the source has freed its copy (after the target's first token)
    th.join(60)
    assert m.target == b.address and s.id in b.host.sessions and s.id not in a.host.sessions
    assert got == ref and len(got) == 80
    assert m.raw_kv_bytes > 0 and (m.bytes > m.raw_kv_bytes if mode == "raw" else m.bytes < m.raw_kv_bytes)


def test_precopy_pace_follows_the_step_time(pair):
    """Without a rate, live pre-copy sends about PRECOPY_STEP_BYTES per decode
    step of the session (measured as it generates), within 5-80 MB/s."""
    from kvferry.migration_out import PRECOPY_RATE, PRECOPY_STEP_BYTES, precopy_rate

    a, _ = pair
    c, s, twin = conversation(a)
    sess = a.host.sessions[s.id]
    assert sess.step_seconds > 0  # measured while it generated (its prefill step excluded)
    assert precopy_rate(sess) == PRECOPY_RATE  # not generating now

    class Generating:
        turn = object()
        step_seconds = 0.1
    assert precopy_rate(Generating) == pytest.approx(PRECOPY_STEP_BYTES / 0.1)
    Generating.step_seconds = 1e-4
    assert precopy_rate(Generating) == 80e6
    Generating.step_seconds = 0.006  # a GPU step: its cap is the GPU's
    assert precopy_rate(Generating, "gpu") == pytest.approx(PRECOPY_STEP_BYTES / 0.006)
    Generating.step_seconds = 1e-4
    assert precopy_rate(Generating, "gpu") == 1e9
    Generating.step_seconds = 10.0
    assert precopy_rate(Generating) == 5e6
    s.close()
    twin.close()


class _LostAnswer(Exception):
    """A call that failed without a word from the target (no kvferry code): e.g.
    the stream reset by a middlebox right after the commit went out."""

    def code(self):
        import grpc

        return grpc.StatusCode.INTERNAL

    def details(self):
        return "stream reset"

    def trailing_metadata(self):
        return ()


def _lost(grpc_error=True):
    import grpc

    return type("LostRpc", (_LostAnswer, grpc.RpcError), {})()


def test_commit_answer_lost_is_resolved_not_guessed(pair, monkeypatch):
    """The commit reaches the target, its answer does not. Before: the source took
    any such error for a refusal and resumed the session, which then ran on both
    hosts. Now the source asks the target (Status) and hands over: one copy."""
    from kvferry import migration_out as server

    a, b = pair
    c, s, twin = conversation(a)

    def lost_answer(self):
        self.reqs.put(server.pb.MigrationMessage(commit=server.pb.Empty()))
        deadline = time.time() + 30
        while s.id not in b.host.sessions and time.time() < deadline:
            time.sleep(0.01)
        raise _lost()
    monkeypatch.setattr(server.Link, "_commit", lost_answer)
    s.migrate(to=b.address)
    assert s.id in b.host.sessions and s.id not in a.host.sessions  # exactly once
    assert s.host == b.address
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_commit_lost_before_the_target_is_resolved_to_the_source(pair, monkeypatch):
    """The commit never reaches the target: asked, it abandons that migration for
    good (a late commit would be refused), and the session runs on at the source."""
    from kvferry import migration_out as server

    a, b = pair
    c, s, twin = conversation(a)
    links = []

    def never_sent(self):
        links.append(self)
        raise _lost()
    monkeypatch.setattr(server.Link, "_commit", never_sent)
    with pytest.raises(RemoteError, match="did not commit"):
        s.migrate(to=b.address)
    assert s.id in a.host.sessions and s.id not in b.host.sessions and s.host == a.address
    assert links[0].mid in b.aborted  # the target will never commit it now
    monkeypatch.undo()
    assert "".join(s.send("more")) == "".join(twin.send("more"))
    s.migrate(to=b.address)  # a new migration (a new id) goes through
    assert s.id in b.host.sessions and s.id not in a.host.sessions


def test_target_that_gave_up_refuses_a_late_commit(pair, monkeypatch):
    """The target drops an incoming migration idle past its TTL. Before: a commit
    arriving after that registered the session it had closed, and the source
    dropped its copy (lost on both). Now the late commit is refused and the
    session stays on the source, intact."""
    from kvferry import migration_in
    from kvferry import migration_out as server
    from kvferry import server as host_server

    a, b = pair
    c, s, twin = conversation(a)
    monkeypatch.setattr(migration_in, "PREPARED_TTL", 0.3)
    monkeypatch.setattr(host_server, "JANITOR_S", 0.05)
    time.sleep(5.5)  # the janitors' current 5 s naps end: from now on they sweep every 50 ms
    real = server.Link.wait_restored

    def slow_commit(self):
        real(self)
        time.sleep(1.0)  # idle past the target's TTL between "restored" and commit
    monkeypatch.setattr(server.Link, "wait_restored", slow_commit)
    with pytest.raises(RemoteError):
        s.migrate(to=b.address)
    assert s.id in a.host.sessions and s.id not in b.host.sessions
    monkeypatch.setattr(server.Link, "wait_restored", real)
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_a_drain_refuses_a_commit_that_would_land_after_its_listing(pair, monkeypatch):
    """A migration into a host that starts draining mid-transfer. Before: the commit
    landed after the drain had listed its sessions, the drain left it behind and
    the host exited with it (lost; seen in bench chaos). Now the target refuses the
    commit and the session runs on at the source."""
    from kvferry import migration_out as server

    a, b = pair
    c, s, twin = conversation(a)
    real = server.Link.wait_restored
    outcomes = []

    def drain_meanwhile(self):
        real(self)
        outcomes.extend(b.drain(timeout=5))  # the target drains between "restored" and commit
    monkeypatch.setattr(server.Link, "wait_restored", drain_meanwhile)
    try:
        with pytest.raises(RemoteError, match="draining"):
            s.migrate(to=b.address)
    finally:
        monkeypatch.setattr(server.Link, "wait_restored", real)
        b.draining = False
        b.set_serving(True)
    assert s.id in a.host.sessions and s.id not in b.host.sessions and s.host == a.address
    assert all(o["session"] != s.id for o in outcomes)
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_long_live_migration_that_keeps_sending_is_not_expired(pair, monkeypatch):
    """Expiry is by inactivity, not age: a pre-copy far longer than the TTL,
    with frames arriving all along, commits."""
    from kvferry import migration_in
    from kvferry import migration_out as server
    from kvferry import server as host_server
    from kvferry.checkpoint import snapshot

    a, b = pair
    c, s, twin = conversation(a, max_tokens=40)
    monkeypatch.setattr(migration_in, "PREPARED_TTL", 0.5)
    monkeypatch.setattr(host_server, "JANITOR_S", 0.05)
    time.sleep(5.5)
    monkeypatch.setattr(server, "PRECOPY_CHUNK", 1)  # 16-token frames
    real = snapshot.Snapshotter.encode

    def slow(self, extracted, batch=False, lasting=False):
        for f in real(self, extracted, batch, lasting):
            time.sleep(0.3)  # < TTL between frames, > TTL in all
            yield f
    monkeypatch.setattr(snapshot.Snapshotter, "encode", slow)
    t0 = time.time()
    s.migrate(to=b.address)
    assert time.time() - t0 > 1.0
    assert s.id in b.host.sessions and s.id not in a.host.sessions
    monkeypatch.undo()
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_mode_auto_measures_the_link_and_stays_bit_exact(pair, monkeypatch):
    """The default mode, auto: it times the link on the first KV (here every frame
    is small, so the probe is short) and picks raw or lossless — never a lossy
    codec unless allowed; the continuation is exact either way."""
    from kvferry import linkaware
    from kvferry import migration_out as server

    a, b = pair
    monkeypatch.setattr(server, "PRECOPY_CHUNK", 1)  # many small frames: acks come during the probe
    monkeypatch.setattr(linkaware, "PROBE_BYTES", 1)
    chosen = []
    real = linkaware.choose
    monkeypatch.setattr(server, "choose", lambda wire, costs: chosen.append((wire, set(costs))) or real(wire, costs))
    c, s, twin = conversation(a, max_tokens=24)
    m = s.migrate(to=b.address)  # mode auto, live
    assert m.mode in ("raw", "lossless") and chosen and chosen[0][1] <= {"lossless"}
    assert "".join(s.send("more")) == "".join(twin.send("more"))
    m = s.migrate(to=a.address, live=False, allow_lossy=True)
    assert chosen[-1][1] <= {"lossless", "int8"}
    with pytest.raises(RemoteError, match="unknown migration mode 'fast'"):
        s.migrate(to=b.address, mode="fast")


def test_a_landed_turn_nobody_reads_stops_and_resumes(pair, monkeypatch):
    """A reply that moved mid-generation while its client stopped reading: the target
    generates it for the host's grace period only, then holds the turn open; resume()
    later finishes it, equal to the twin's."""
    from dataclasses import replace

    from kvferry.session import Session

    a, b = pair
    saved = b.host.policy
    b.host.policy = replace(saved, unread_grace_s=1.0)
    real = Session.decode

    def slow(self, token):  # the tiny model would finish the reply before the grace is up
        time.sleep(0.03)
        return real(self, token)
    monkeypatch.setattr(Session, "decode", slow)
    try:
        c, s, twin = conversation(a, max_tokens=200)
        ref = [ch.token for ch in twin.events("tell me more") if ch.token >= 0]
        events = s.events("tell me more")
        got = [next(events).token for _ in range(3)]  # then the client stops reading
        Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True)
        time.sleep(3.0)  # past the grace
        n1 = b.host.sessions[s.id].turn and len(b.host.sessions[s.id].turn.tokens)
        time.sleep(1.5)
        n2 = b.host.sessions[s.id].turn and len(b.host.sessions[s.id].turn.tokens)
        assert n1 and n1 == n2 and n1 < 200, (n1, n2)  # stopped, with the turn still open
        rest = [ch.token for ch in Client(b.address, TOKEN).session(s.id).resume(3) if ch.token >= 0]
        assert got + rest == ref
    finally:
        b.host.policy = saved


def test_a_frame_message_built_by_hand_is_what_protobuf_reads():
    """The source encodes Transfer's frame messages itself (one join, no protobuf
    copies); the target parses them with protobuf, so they must agree."""
    import os

    from kvferry.migration_wire import frame_message
    from kvferry.proto import kvferry_pb2 as pb

    for seq in (0, 1, 127, 128, 300, 1 << 40):
        for n in (0, 1, 127, 128, 5000, 3 << 19):
            data = os.urandom(n)
            m = pb.MigrationMessage.FromString(frame_message(seq, data))
            assert m.WhichOneof("kind") == "frame" and m.frame.seq == seq and m.frame.data == data
            if seq and n:  # protobuf leaves zero fields out; otherwise the bytes are its own
                assert frame_message(seq, data) == pb.MigrationMessage(
                    frame=pb.FramePart(seq=seq, data=data)).SerializeToString()


def test_the_target_reads_frame_messages_in_place_and_anything_else_as_protobuf():
    """The target reads a frame message as the source writes it as a view of the
    received bytes; every other encoding protobuf accepts (fields left out or
    reordered, unknown fields, other kinds) reads as protobuf does, and bytes that
    are no message raise protobuf's error (grpc answers it, not the handler)."""
    import os

    from google.protobuf.message import DecodeError

    from kvferry.migration_wire import FrameView, _varint, frame_message, read_message
    from kvferry.proto import kvferry_pb2 as pb

    for seq in (0, 1, 300, 1 << 40):
        for n in (0, 1, 200, 3 << 19):
            data = os.urandom(n)
            raw = frame_message(seq, data)
            m = read_message(raw)
            assert isinstance(m, FrameView) and m.seq == seq and bytes(m.data) == data
            assert m.data.obj is raw  # a view, not a copy
            # what protobuf itself writes (zero seq or data left out) reads alike
            m = read_message(pb.MigrationMessage(frame=pb.FramePart(seq=seq, data=data)).SerializeToString())
            f = m if isinstance(m, FrameView) else m.frame
            assert (f.seq, bytes(f.data)) == (seq, data)
    data = os.urandom(1000)
    reordered = b"\x12" + _varint(len(data)) + data + b"\x08\x07"  # FramePart's data, then its seq
    others = [
        b"\x12" + _varint(len(reordered)) + reordered,
        pb.MigrationMessage(frame=pb.FramePart(seq=7, data=data)).SerializeToString() + b"\x28\x01",  # unknown field
        pb.MigrationMessage(begin=pb.Begin(migration_id="m", session_id="s")).SerializeToString(),
        pb.MigrationMessage(commit=pb.Empty()).SerializeToString(),
        pb.MigrationMessage(abort=pb.Empty()).SerializeToString(),
    ]
    for raw in others:
        got = read_message(raw)
        assert not isinstance(got, FrameView) and got == pb.MigrationMessage.FromString(raw)
    raw = frame_message(7, data)
    for bad in (raw[:-1], raw[:3], raw + b"\xff", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"):
        with pytest.raises(DecodeError):
            read_message(bad)


def test_the_kv_goes_on_a_lane_and_stream_only_keeps_it_on_the_stream(pair, monkeypatch):
    """By default a migration's frames take the target's lane (a socket beside the
    gRPC stream); ``lane=False`` keeps them on the stream. Both are bit-exact. On
    the lane, the lane's reader hashes the KV frames, not the handler that lands them."""
    import threading

    from kvferry.checkpoint import frames

    hashed: list = []
    real = frames._body_checksum
    monkeypatch.setattr(frames, "_body_checksum",
                        lambda v, kind, body: hashed.append((kind, threading.current_thread().name)) or
                        real(v, kind, body))
    a, b = pair
    c, s, twin = conversation(a)
    m = s.migrate(to=b.address, mode="raw")
    assert m.transport == "lane" and s.id in b.host.sessions and s.id not in a.host.sessions
    lane_kv = {name for kind, name in hashed if kind == frames.KV}
    assert lane_kv and all(name == "kvferry-lane-in" for name in lane_kv), lane_kv
    assert "".join(s.send("more")) == "".join(twin.send("more"))
    hashed.clear()
    m = s.migrate(to=a.address, mode="raw", lane=False)
    assert m.transport == "stream" and s.id in a.host.sessions and s.id not in b.host.sessions
    assert {kind for kind, name in hashed} >= {frames.HEADER, frames.KV}
    assert not any(name == "kvferry-lane-in" for _, name in hashed)  # the handler hashed them itself
    assert "".join(s.send("again")) == "".join(twin.send("again"))


def test_a_gpu_hosts_lane_reads_frames_into_kept_page_locked_blocks(pair, monkeypatch):
    """Where the copy engine reaches the host (a GPU; a stand-in runtime here), the
    lane reads each frame into the host's kept frame blocks, page-locked once, which
    the landing reads without staging; a block serves again once its frame has
    landed, so a second migration takes no new memory. Bit-exact either way."""
    import sys

    from fake_cuda import FakeCudaRuntime

    from kvferry.checkpoint import host_blocks, unified

    rt = FakeCudaRuntime()
    monkeypatch.setitem(unified._state, "runtime", rt)
    monkeypatch.setitem(unified._state, "loaded", True)
    kept = host_blocks.HostBlocks(block=1 << 20, cap=8 << 20)
    monkeypatch.setattr(host_blocks, "_frames", kept)
    monkeypatch.setattr(host_blocks, "_blocks", host_blocks.HostBlocks(block=1 << 20, cap=8 << 20))
    a, b = pair
    c, s, twin = conversation(a)
    m = s.migrate(to=b.address, mode="raw")
    assert m.transport == "lane" and s.id in b.host.sessions
    used = len(kept.blocks)
    assert used and kept.fresh == 0 and rt.pinned.count(1 << 20) >= used
    assert "".join(s.send("more")) == "".join(twin.send("more"))
    assert all(sys.getrefcount(blk) <= 3 for blk in kept.blocks)  # landed: no view of a block lives on
    for blk in kept.blocks:
        blk.fill(0)
    del blk  # a reference of its own would keep the last block taken
    m = s.migrate(to=a.address, mode="raw")
    assert m.transport == "lane" and s.id in a.host.sessions
    assert any(blk.any() for blk in kept.blocks[:used]) and kept.fresh == 0  # the first's blocks, again
    assert "".join(s.send("again")) == "".join(twin.send("again"))
    assert all(sys.getrefcount(blk) <= 3 for blk in kept.blocks)
    monkeypatch.setitem(unified._state, "runtime", None)  # a CPU host: the lane's own buffers
    assert host_blocks.frame(100) is None


def test_a_lane_that_cannot_be_dialled_leaves_the_frames_on_the_stream(pair, monkeypatch):
    """A lane port that refuses (a firewall, say): the source keeps the frames on
    the stream, and the migration completes."""
    import socket

    a, b = pair
    c, s, twin = conversation(a)
    closed = socket.create_server(("127.0.0.1", 0))
    dead = closed.getsockname()[1]
    closed.close()
    monkeypatch.setattr(b.lane, "port", dead)  # what b's acks now name: nothing listens there
    m = s.migrate(to=b.address)
    assert m.transport == "stream" and s.id in b.host.sessions and s.id not in a.host.sessions
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_a_lane_that_breaks_mid_transfer_resumes_on_a_new_one(pair, monkeypatch):
    """The lane's connection dies after a few frames: the source reconnects the
    stream, opens a new lane and resends only what the target has not verified."""
    import socket

    from kvferry import migration_lane

    a, b = pair
    c, s, twin = conversation(a)
    real_put = migration_lane.LaneWriter.put
    lanes: list = []

    def breaking(self, seq, frame):
        if self not in lanes:
            lanes.append(self)
        if len(lanes) == 1 and seq == 2:
            self.conn.shutdown(socket.SHUT_RDWR)  # the link under the first lane goes
        real_put(self, seq, frame)
    monkeypatch.setattr(migration_lane.LaneWriter, "put", breaking)
    m = s.migrate(to=b.address, mode="raw", live=False)  # every frame on the lane (see the next test)
    assert len(lanes) == 2 and m.transport == "lane"
    assert s.id in b.host.sessions and s.id not in a.host.sessions
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_a_lane_takes_only_a_ticket_its_stream_gave(pair, monkeypatch):
    """Strangers on the lane port (a wrong ticket, garbage, silence) are closed on
    without a word, and the host serves on."""
    import secrets
    import socket

    from kvferry import migration_lane

    monkeypatch.setattr(migration_lane, "HELLO_S", 0.5)
    a, b = pair
    for hello in (migration_lane.MAGIC + secrets.token_bytes(migration_lane.TICKET_BYTES),
                  b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(16), b""):
        with socket.create_connection(("127.0.0.1", b.lane.port), timeout=5) as conn:
            conn.sendall(hello)
            assert conn.recv(1) == b""  # closed on: the ticket was wrong, or none came in time
    c, s, twin = conversation(a)
    assert s.migrate(to=b.address).transport == "lane"
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_a_live_pause_sends_its_frames_on_the_stream_and_the_target_orders_them(pair, monkeypatch):
    """Live: the pre-copy's frames take the lane, the pause's few small ones the
    stream, and the target lands them in order even when the stream's come first
    (here the lane's last pre-copy frame is held back until the stream's arrived)."""
    from kvferry import migration_lane, migration_out

    a, b = pair
    c, s, twin = conversation(a, max_tokens=40)
    ref = [ch.token for ch in twin.events("keep going") if ch.token >= 0]
    real_put, real_link_put = migration_lane.LaneWriter.put, migration_out.Link._put
    held: list = []
    on_stream: list[int] = []

    def lane_put(self, seq, frame):
        if held or seq < 2:
            return real_put(self, seq, frame)
        held.append((self, seq, frame))  # this one waits for the pause's first frame

    def link_put(self, seq, frame):
        real_link_put(self, seq, frame)
        if self.on_stream:
            on_stream.append(seq)
            if held and held[0] is not None and len(on_stream) == 1:
                time.sleep(0.2)  # the stream's frame reaches the target first
                w, q, f = held[0]
                held[0] = None
                real_put(w, q, f)
    monkeypatch.setattr(migration_lane.LaneWriter, "put", lane_put)
    monkeypatch.setattr(migration_out.Link, "_put", link_put)
    th, got = reading(s, "keep going", first=4)
    m = Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True, mode="raw")
    th.join(60)
    assert m.transport == "lane" and on_stream and held == [None]
    assert s.id in b.host.sessions and s.id not in a.host.sessions and got == ref


def test_a_target_that_refuses_mid_transfer_is_heard_not_resumed(pair, monkeypatch):
    """A target out of KV room refuses while frames arrive on the lane, and closes
    the lane with the stream. The source reports the refusal (it once took the
    closed lane for a dropped link and resumed at a target that had forgotten the
    migration: 'frame 3 arrived, expected 0'); the session stays on the source."""
    a, b = pair
    monkeypatch.setattr(b.host, "max_kv_bytes", 2048)
    c, s, twin = conversation(a)
    for _ in range(3):
        with pytest.raises(RemoteError, match="out of memory"):
            s.migrate(to=b.address, mode="raw", live=False)
        assert s.host == a.address and s.id in a.host.sessions and s.id not in b.host.sessions
    assert "".join(s.send("more")) == "".join(twin.send("more"))


def test_the_handoff_trace_lines_up_both_hosts_on_one_clock(pair, monkeypatch, tmp_path):
    """KVFERRY_STEP_TRACE also records a live migration's handoff on both hosts, on
    one clock, in the order the protocol makes them happen: paused, last delta out,
    landed and prepared on the target, restored, commit, adopted, committed, the
    client told where to go; the target generates on and its client follows it."""
    import json

    from kvferry import handoff_trace

    monkeypatch.setenv("KVFERRY_STEP_TRACE", str(tmp_path))
    monkeypatch.setattr(handoff_trace, "_opened", False)
    monkeypatch.setattr(handoff_trace, "_file", None)
    a, b = pair
    c, s, twin = conversation(a, max_tokens=40)
    ref = [ch.token for ch in twin.events("keep going") if ch.token >= 0]
    th, got = reading(s, "keep going", first=4)
    Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=True, mode="raw")
    th.join(60)
    assert got == ref
    handoff_trace._file.close()
    events = [json.loads(line) for f in tmp_path.glob("handoff-*.jsonl") for line in f.read_text().splitlines()]
    t = {}
    for e in events:
        t.setdefault(e["event"], e["t"])  # (target_commit names the migration; the rest the session)
        assert e["session"] == s.id or e["event"] == "target_commit"
    order = ["source_paused", "source_final_frame0", "source_final_frame1", "target_landed", "target_prepared",
             "source_restored", "target_commit", "target_adopted", "source_committed", "source_moved_to",
             "target_followed"]
    assert [t[k] for k in order] == sorted(t[k] for k in order)
    assert t["source_sent"] <= t["source_restored"] and t["target_adopted"] <= t["target_first_token"]


@pytest.fixture(scope="module")
def speculating_pair(smollm):
    from kvferry.policy import HostPolicy

    # SmolLM2 (the tiny model repeats one token: a wrong K/V would not show in its reply)
    yield from _serving([ModelHost(lm=smollm, progress=False, policy=HostPolicy(speculate=True)) for _ in range(2)])


def _serving(hosts):
    """Two hosts served, each the other's migration peer, until the fixture ends."""
    servers = [HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in hosts]
    servers[0].peers, servers[1].peers = (servers[1].address,), (servers[0].address,)
    yield servers
    for s, h in zip(servers, hosts):
        s.stop()
        h.close()


@pytest.mark.parametrize("live,device", [(True, False), (False, False), (True, True)],
                         ids=["live", "stop-copy", "live-device-reads"])
def test_the_step_a_source_ran_ahead_goes_along_and_the_target_takes_it(speculating_pair, live, device,
                                                                        monkeypatch):
    """A speculating source has run the step of the turn's next token before the pause
    (its guest's token confirmed the guess): the pause sends that step's K/V and logits
    with the state, and the target's first step takes them instead of running the
    model. The reply goes on exactly as the unmigrated twin's. ``device``: the KV is
    read as on a GPU (MLX copies read once), the step's pieces riding with the last
    delta, and the guessed token taken without a Gather (an integer index on the
    device): no served step compiles its CUDA kernel, so a fresh GPU host compiled it
    inside its first migration's pause (2.1 s on an H100)."""
    import io

    import mlx.core as mx

    from kvferry.checkpoint import snapshot, step_ahead

    a, b = speculating_pair
    if device:
        monkeypatch.setattr(snapshot, "host_memory", lambda: False)
        rode = []
        real = step_ahead.frame
        def frame(token, parts, mode):
            rode.append(isinstance(parts[0][0], np.ndarray))  # read on the host with the delta already
            return real(token, parts, mode)
        monkeypatch.setattr(step_ahead, "frame", frame)
        graphs = []
        held = a.host.steps.held_guess
        def held_guess(session):
            guess = held(session)
            if guess is not None:
                dot = io.StringIO()
                mx.export_to_dot(dot, guess[0])  # the token's ops, not yet evaluated
                graphs.append(dot.getvalue())
            return guess
        monkeypatch.setattr(a.host.steps, "held_guess", held_guess)
    c, s, twin = conversation(a, max_tokens=80)  # long enough to move mid-reply
    ref = [ch.token for ch in twin.events("keep going") if ch.token >= 0]
    landed0 = b.host.steps.stats["landed_steps"]
    hits0 = b.host.steps.stats["speculation_hits"]
    th, got = reading(s, "keep going", first=4)
    Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=live, mode="raw")
    th.join(60)
    assert got == ref and len(got) == 80
    assert b.host.steps.stats["landed_steps"] == landed0 + 1
    assert b.host.steps.stats["speculation_hits"] > hits0  # taken, not turned down
    assert not device or rode == [True]  # read with the last delta, not on their own
    assert not device or (graphs and not any("Gather" in g for g in graphs))
    s.close()
    twin.close()


@pytest.fixture(scope="module")
def driving_pair(smollm):
    """The GPU's defaults on this CPU (guests on the step thread, greedy steps
    speculated), and the step thread queuing each reply's next decode before the
    session's thread comes back for it (run on, KVFERRY_RUN_ON=1)."""
    from kvferry.policy import HostPolicy

    with pytest.MonkeyPatch.context() as mp:  # (read when a host starts)
        mp.setenv("KVFERRY_RUN_ON", "1")
        hosts = [ModelHost(lm=smollm, progress=False, policy=HostPolicy(speculate=True, drive_guests=True))
                 for _ in range(2)]
    yield from _serving(hosts)


@pytest.mark.parametrize("live", [True, False], ids=["live", "stop-copy"])
def test_a_reply_whose_steps_run_on_pauses_at_a_still_boundary_and_moves_identically(driving_pair, live):
    """A driven reply's next decode is queued by the step thread before the session's
    own thread comes back for it. A migration's pause must not cut between the two:
    the session stops running on and pauses at the next boundary, so the checkpoint
    holds no decode its turn has not asked for, and the reply goes on as its twin's."""
    a, b = driving_pair
    c, s, twin = conversation(a, max_tokens=60)
    ref = [ch.token for ch in twin.events("keep going") if ch.token >= 0]
    ran_on = a.host.steps.stats["run_on"]
    th, got = reading(s, "keep going", first=6)
    assert a.host.steps.stats["run_on"] > ran_on  # its decodes were queued ahead of its thread
    Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=live, mode="raw")
    th.join(60)
    assert got == ref and len(got) == 60
    assert not a.host.steps.held and s.id not in {x.id for x in a.host.steps.run_on}
    s.close()
    twin.close()
