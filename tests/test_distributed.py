"""Distribution on real processes: kvferry serve, gRPC, migration, SDK, Ray, ray job."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvferry import AsyncClient, AuthError, Client, ModelMismatchError, RemoteError, UnknownSessionError

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener_pids(port: int) -> list[int]:
    """PIDs holding a listening TCP socket on ``port`` (from /proc, no tools needed)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f[9])
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.append(int(pid))
                    break
        except OSError:
            continue
    return pids


class Serve:
    """A `kvferry serve` process (its own embedded Ray cluster)."""

    def __init__(self, *args: str, token: str = TOKEN, machine=None, port: int | None = None):
        """``machine``: a tests/netns.py Machine to run in (its namespace), bound to
        every interface there; else loopback on a free port."""
        self.port = port or (50051 if machine else free_port())
        self.machine = machine
        env = {**os.environ, "KVFERRY_TOKEN": token}
        argv = [sys.executable, "-m", "kvferry", "serve", "--port", str(self.port), *args]
        if machine is not None:
            argv = machine.cmd(*argv, "--bind", "0.0.0.0")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        self.address = f"{machine.ip if machine else '127.0.0.1'}:{self.port}"
        self.log: list[str] = []
        deadline = time.time() + 240
        for line in self.proc.stdout:
            self.log.append(line)
            if "kvferry serving on" in line:
                break
            if time.time() > deadline:
                break
        if self.proc.poll() is not None or not any("kvferry serving on" in l for l in self.log):
            self.stop()
            raise RuntimeError("kvferry serve did not start:\n" + "".join(self.log[-30:]))
        self.advertised = self.log[-1].split("kvferry serving on ")[1].split()[0]
        threading.Thread(target=lambda: [self.log.append(l) for l in self.proc.stdout], daemon=True).start()

    def kill(self) -> None:
        """SIGKILL the process that serves the port (a Ray worker) and the serve group."""
        for pid in ([] if self.machine else listener_pids(self.port)):
            os.kill(pid, signal.SIGKILL)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # kvferry serve shuts its Ray down itself
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in the group
        except ProcessLookupError:
            pass


_HELD: list[socket.socket] = []


def reserved_port() -> int:
    """A port the kernel will not hand out for anything else until a host binds it:
    a socket bound with SO_REUSEPORT holds it (gRPC's server binds with SO_REUSEPORT
    too, so the host still can). Chosen minutes before use, a merely free port was
    once taken meanwhile by some connection's ephemeral port."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return s.getsockname()[1]


# Hosts migrate only to their peers (serve --peers): the ports of every host these
# tests start are chosen up front, so A and B can name the later ones as peers.
PORTS = {name: reserved_port() for name in ("a", "b", "other", "victim", "small")}


def peers(*names: str) -> tuple[str, str]:
    return "--peers", ",".join(f"127.0.0.1:{PORTS[n]}" for n in names)


def serving_pair(a_args: tuple, a_port: int, b_args: tuple, b_port: int):
    """Two `kvferry serve` hosts, yielded as (a, b) and stopped after (a fixture's body)."""
    a = Serve(*a_args, port=a_port)
    try:
        b = Serve(*b_args, port=b_port)
    except Exception:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def two_hosts(smollm_dir):
    yield from serving_pair(peers("b", "other", "victim", "small"), PORTS["a"],
                            peers("a", "other", "victim", "small"), PORTS["b"])


def test_migration_continues_identically(two_hosts):
    a, b = two_hosts
    c = Client(a.address, TOKEN)
    h = c.health()
    assert h["status"] == "ok" and h["device"].startswith("cpu") and h["dtype"] == "float32" and h["weights"]
    s = c.create_session(max_tokens=24)
    twin = c.create_session(max_tokens=24)
    first = "".join(s.send("What is the capital of France?"))
    assert first == "".join(twin.send("What is the capital of France?")) and "Paris" in first
    m = s.migrate(to=b.address, mode="lossless")  # compressed on the wire (the default is raw)
    assert m.bytes > 0 and m.tokens > 0 and m.ratio > 1.0 and s.host == b.address
    assert s.id not in [x["id"] for x in c.sessions()]
    assert s.id in [x["id"] for x in Client(b.address, TOKEN).sessions()]
    after = "".join(s.send("And the capital of Italy?"))
    assert after == "".join(twin.send("And the capital of Italy?")) and "Rome" in after
    # a client still pointed at the source is redirected
    stale = Client(a.address, TOKEN).session(s.id)
    assert "".join(stale.send("And of Spain?")) and stale.host == b.address
    s.close()
    twin.close()


@pytest.mark.parametrize("live", [False, True], ids=["stop-copy", "live"])
def test_mid_reply_migration_loses_and_repeats_nothing(two_hosts, live):
    a, b = two_hosts
    c = Client(a.address, TOKEN)
    s = c.create_session(max_tokens=48, ignore_eos=True)
    twin = c.create_session(max_tokens=48, ignore_eos=True)
    chunks = []
    th = threading.Thread(target=lambda: chunks.extend(s.events("Tell me a long story about a cat.")))
    th.start()
    while not chunks:
        time.sleep(0.05)
    m = Client(a.address, TOKEN).session(s.id).migrate(to=b.address, live=live)
    th.join(120)
    ref = list(twin.events("Tell me a long story about a cat."))
    tokens = [x.token for x in chunks if x.token >= 0]
    assert [x.index for x in chunks if x.token >= 0] == list(range(len(tokens)))
    assert tokens == [x.token for x in ref if x.token >= 0] and len(tokens) == 48
    assert "".join(x.text for x in chunks) == "".join(x.text for x in ref)
    assert 0 < m.tokens and s.host == b.address
    s.close()
    twin.close()


def test_live_migration_out_of_and_into_running_batches(two_hosts):
    """A session leaves host A's running batch mid-reply and joins host B's, where
    another session is generating: its reply, and both bystanders', are the tokens
    each would have had alone."""
    through_batches(*two_hosts, TOKEN)


def through_batches(a, b, token: str) -> None:
    """Move a session live from A's running batch into B's (see the test above)."""
    prompts = {"mover": "Tell me a long story about a cat.", "on_a": "Describe a river in spring.",
               "on_b": "Describe a mountain at night."}
    # on_b outlasts the move by a margin: on a loaded 2-core runner a live move's landing
    # has taken 7-8 s (CI, twice), by which time a 64-token bystander had finished
    n = {"mover": 40, "on_a": 40, "on_b": 160}
    ref = {}
    for k, p in prompts.items():  # alone: nothing else on the host
        t = Client(a.address, token).create_session(max_tokens=n[k], ignore_eos=True)
        ref[k] = [x.token for x in t.events(p) if x.token >= 0]
        t.close()
    where = {"mover": a, "on_a": a, "on_b": b}
    sessions = {k: Client(where[k].address, token).create_session(max_tokens=n[k], ignore_eos=True)
                for k in prompts}
    got = {k: [] for k in prompts}

    def run(k):
        for x in sessions[k].events(prompts[k]):
            if x.token >= 0:
                got[k].append(x.token)
    ts = [threading.Thread(target=run, args=(k,)) for k in prompts]
    for t in ts:
        t.start()
    deadline = time.time() + 120
    while (len(got["mover"]) < 4 or len(got["on_b"]) < 2) and time.time() < deadline:
        time.sleep(0.02)
    m = Client(a.address, token).session(sessions["mover"].id).migrate(to=b.address, live=True)
    on_b_at_move = len(got["on_b"])
    for t in ts:
        t.join(180)
    assert m.tokens > 0 and on_b_at_move < n["on_b"], (  # it joined B's batch while on_b was mid-reply
        f"on_b had finished ({on_b_at_move} tokens) when the move ended ({m.seconds:.1f} s, phases {m.phases_ms})")
    assert got == ref
    sessions["mover"].info()  # (its reply may have come relayed by A: a per-session call follows the move)
    assert sessions["mover"].host == b.address
    for s in sessions.values():
        s.close()


def test_wrong_token_and_unknown_session(two_hosts):
    a, _ = two_hosts
    with pytest.raises(AuthError, match="auth failed"):
        Client(a.address, "wrong").sessions()
    with pytest.raises(AuthError):
        Client(a.address, "").health()
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
        Client(a.address, TOKEN).session("nope").close()
    with pytest.raises(UnknownSessionError):
        list(Client(a.address, TOKEN).session("nope").send("hi"))


def test_snapshot_and_restore_through_the_sdk(two_hosts, tmp_path):
    a, b = two_hosts
    c = Client(a.address, TOKEN)
    s = c.create_session(max_tokens=16)
    twin = c.create_session(max_tokens=16)
    "".join(s.send("Name a fruit."))
    "".join(twin.send("Name a fruit."))
    s.snapshot(tmp_path / "s.kvf")
    s.close()
    r = Client(b.address, TOKEN).restore(tmp_path / "s.kvf")
    assert r.host == b.address
    assert "".join(r.send("And a vegetable?")) == "".join(twin.send("And a vegetable?"))
    r.close()
    twin.close()


def test_async_sdk(two_hosts):
    a, b = two_hosts

    async def go():
        async with AsyncClient(a.address, TOKEN) as c:
            assert (await c.health())["status"] == "ok"
            s = await c.create_session(max_tokens=16)
            text = "".join([p async for p in s.send("What is the capital of France?")])
            m = await s.migrate(to=b.address)
            more = "".join([p async for p in s.send("And of Italy?")])
            await s.close()
            return text, m, more
    text, m, more = asyncio.run(go())
    assert "Paris" in text and m.target == b.address and "Rome" in more


def test_target_without_the_model(two_hosts, tiny_model):
    a, _ = two_hosts
    other = Serve("--model", str(tiny_model), port=PORTS["other"])
    try:
        c = Client(a.address, TOKEN)
        s = c.create_session(max_tokens=16)
        twin = c.create_session(max_tokens=16)
        "".join(s.send("Hello!"))
        "".join(twin.send("Hello!"))
        with pytest.raises(ModelMismatchError, match="model mismatch"):
            s.migrate(to=other.address)
        assert s.host == a.address  # still here, intact
        assert "".join(s.send("How are you?")) == "".join(twin.send("How are you?"))
        with pytest.raises(ModelMismatchError):
            c.create_session(model="tiny-llama")
    finally:
        other.stop()


def test_target_killed_mid_stream(two_hosts):
    a, _ = two_hosts
    victim = Serve(port=PORTS["victim"])
    try:
        c = Client(a.address, TOKEN)
        s = c.create_session(max_tokens=8)
        twin = c.create_session(max_tokens=8)
        long = "Summarize this. " + " ".join(f"Item {i} is a small detail worth noting." for i in range(120))
        "".join(s.send(long))
        "".join(twin.send(long))

        def kill_on_first_ack(p):
            if p.frames_sent >= 1 and victim.proc.poll() is None:
                victim.kill()  # the target dies with most frames still to come
        with pytest.raises(RemoteError, match="migration to .* failed"):
            s.migrate(to=victim.address, progress=kill_on_first_ack)
        assert s.host == a.address and s.id in [x["id"] for x in c.sessions()]
        assert "".join(s.send("Thanks!")) == "".join(twin.send("Thanks!"))
    finally:
        victim.stop()


def test_source_killed_after_the_target_committed(two_hosts):
    """The source dies right after the handoff: the session lives on the target
    only, and the reply continues there with no token lost or repeated."""
    _, b = two_hosts
    victim = Serve(*peers("a", "b"), port=PORTS["victim"])
    try:
        s = Client(victim.address, TOKEN).create_session(max_tokens=40, ignore_eos=True)
        twin = Client(b.address, TOKEN).create_session(max_tokens=40, ignore_eos=True)
        ref = [c.token for c in twin.events("Tell me a long story about a fox.") if c.token >= 0]
        got, failed = [], []

        def consume():
            try:
                for c in s.events("Tell me a long story about a fox."):
                    if c.token >= 0:
                        assert c.index == len(got)
                        got.append(c.token)
            except RemoteError as e:  # the source died before telling us where the session went
                failed.append(str(e))
        th = threading.Thread(target=consume)
        th.start()
        while len(got) < 4:
            time.sleep(0.02)
        m = Client(victim.address, TOKEN).session(s.id).migrate(to=b.address, live=True)
        victim.kill()  # the target has committed: migrate() returns only after that
        th.join(120)
        assert m.target == b.address and 0 < len(got) <= 40
        rest = [c.token for c in Client(b.address, TOKEN).session(s.id).resume(len(got)) if c.token >= 0]
        assert got + rest == ref
        # from index 0, the target re-sends the tokens generated before the move too
        whole = [c for c in Client(b.address, TOKEN).session(s.id).resume(0) if c.token >= 0]
        assert [c.token for c in whole] == ref and [c.index for c in whole] == list(range(len(ref)))
        on_b = [x["id"] for x in Client(b.address, TOKEN).sessions()]
        assert on_b.count(s.id) == 1
        with pytest.raises(RemoteError):
            Client(victim.address, TOKEN, timeout=5).sessions()
        Client(b.address, TOKEN).session(s.id).close()
        twin.close()
    finally:
        victim.stop()


def test_target_out_of_memory(two_hosts):
    """A target that cannot hold the session's KV refuses it while frames
    arrive; the session stays on the source and continues identically."""
    a, _ = two_hosts
    small = Serve("--max-kv-mb", "4", port=PORTS["small"])
    try:
        c = Client(a.address, TOKEN)
        s = c.create_session(max_tokens=8)
        twin = c.create_session(max_tokens=8)
        long = "Summarize this. " + " ".join(f"Item {i} is a small detail worth noting." for i in range(60))
        assert "".join(s.send(long)) == "".join(twin.send(long))
        with pytest.raises(RemoteError, match="out of memory on this host.*4 MB"):
            s.migrate(to=small.address)
        assert s.host == a.address and s.id in [x["id"] for x in c.sessions()]
        assert Client(small.address, TOKEN).sessions() == []
        assert "".join(s.send("Thanks!")) == "".join(twin.send("Thanks!"))
        s.close()
        twin.close()
    finally:
        small.stop()


def test_no_auth_only_on_loopback():
    from kvferry.errors import ConfigError
    from kvferry.server import HostServer

    with pytest.raises(ConfigError, match="refusing to serve without a token"):
        HostServer(None, "0.0.0.0:0", token=None, allow_no_auth=True)
    r = subprocess.run([sys.executable, "-m", "kvferry", "serve", "--bind", "0.0.0.0", "--no-auth"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "only allowed on a loopback address" in r.stderr


def _certs(d: Path) -> dict:
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=kvferry-test-ca")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", "/CN=localhost")
        (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf")
    return {k: str(d / v) for k, v in {"ca": "ca.pem", "scert": "server.pem", "skey": "server.key",
                                       "ccert": "client.pem", "ckey": "client.key"}.items()}


def test_tls_and_mutual_tls(tiny_model, tmp_path):
    from kvferry.host import ModelHost
    from kvferry.server import HostServer
    from kvferry.transport import TLSConfig

    c = _certs(tmp_path)
    host = ModelHost(str(tiny_model), progress=False)
    tls = HostServer(host, "127.0.0.1:0", token=TOKEN, tls=TLSConfig(c["scert"], c["skey"])).start()
    mtls = HostServer(host, "127.0.0.1:0", token=TOKEN,
                      tls=TLSConfig(c["scert"], c["skey"], ca=c["ca"])).start()
    try:
        assert Client(tls.address, TOKEN, tls=TLSConfig(ca=c["ca"])).health()["status"] == "ok"
        with pytest.raises(RemoteError):  # plaintext client against a TLS server
            Client(tls.address, TOKEN, timeout=5).health()
        with pytest.raises(RemoteError):  # no client certificate
            Client(mtls.address, TOKEN, tls=TLSConfig(ca=c["ca"]), timeout=5).health()
        ok = Client(mtls.address, TOKEN, tls=TLSConfig(c["ccert"], c["ckey"], c["ca"]))
        assert ok.health()["status"] == "ok"
        with pytest.raises(AuthError):  # TLS does not replace the token
            Client(mtls.address, "wrong", tls=TLSConfig(c["ccert"], c["ckey"], c["ca"])).health()
        import requests

        from kvferry.http_front import HttpFront

        fronts = [HttpFront(tls, "127.0.0.1", 0).start(), HttpFront(mtls, "127.0.0.1", 0).start()]
        web, mweb = (f"https://{f.address}/health" for f in fronts)  # the HTTP front has the same TLS
        assert requests.get(web, verify=c["ca"], timeout=10).json()["status"] == "ok"
        with pytest.raises(requests.exceptions.ConnectionError):  # SSLError included: no client certificate
            requests.get(mweb, verify=c["ca"], timeout=10)
        assert requests.get(mweb, verify=c["ca"], cert=(c["ccert"], c["ckey"]), timeout=10).status_code == 200
        for f in fronts:
            f.stop()
    finally:
        tls.stop()
        mtls.stop()
        host.close()


def test_a_tls_host_sends_sessions_only_over_tls(tiny_model, tmp_path):
    """A host that serves TLS refuses to migrate out in plaintext (its sessions would
    cross the network in the clear): it needs --peer-tls-ca."""
    from kvferry.host import ModelHost
    from kvferry.server import HostServer
    from kvferry.transport import TLSConfig

    c = _certs(tmp_path)
    host = ModelHost(str(tiny_model), progress=False)
    a = HostServer(host, "127.0.0.1:0", token=TOKEN, tls=TLSConfig(c["scert"], c["skey"])).start()
    b = HostServer(host, "127.0.0.1:0", token=TOKEN, tls=TLSConfig(c["scert"], c["skey"])).start()
    a.peers = (b.address,)
    try:
        cl = Client(a.address, TOKEN, tls=TLSConfig(ca=c["ca"]))
        s = cl.create_session(max_tokens=2)
        with pytest.raises(RemoteError, match="only over TLS"):
            s.migrate(to=b.address)
        assert s.info()["id"] == s.id
    finally:
        a.stop()
        b.stop()
        host.close()


def test_migration_over_mutual_tls_takes_a_tls_lane(tiny_model, tmp_path):
    """Between hosts that serve mutual TLS, the KV's lane is TLS with the same
    certificates: the move takes the lane, and a plaintext dialler gets nothing."""
    import socket

    from kvferry.host import ModelHost
    from kvferry.server import HostServer
    from kvferry.transport import TLSConfig

    c = _certs(tmp_path)
    hosts = [ModelHost(str(tiny_model), progress=False) for _ in range(2)]
    tls = TLSConfig(c["scert"], c["skey"], ca=c["ca"])
    peer = TLSConfig(c["ccert"], c["ckey"], c["ca"])
    a, b = (HostServer(h, "127.0.0.1:0", token=TOKEN, tls=tls, client_tls=peer).start() for h in hosts)
    a.peers = (b.address,)
    try:
        cl = Client(a.address, TOKEN, tls=peer)
        s = cl.create_session(max_tokens=6, ignore_eos=True)
        twin = cl.create_session(max_tokens=6, ignore_eos=True)
        assert "".join(s.send("hi")) == "".join(twin.send("hi"))
        m = s.migrate(to=b.address, mode="raw")
        assert m.transport == "lane" and s.host == b.address
        assert "".join(s.send("more")) == "".join(twin.send("more"))
        with socket.create_connection(("127.0.0.1", b.lane.port), timeout=10) as conn:
            conn.sendall(b"KVFL" + bytes(32))  # not a TLS handshake
            try:
                assert conn.recv(1) == b""  # closed on (or reset by the failed handshake)
            except ConnectionResetError:
                pass
    finally:
        a.stop()
        b.stop()
        for h in hosts:
            h.close()


def test_message_size_limit(tiny_model):
    from kvferry.host import ModelHost
    from kvferry.server import HostServer
    from kvferry.transport import MAX_MESSAGE

    host = ModelHost(str(tiny_model), progress=False)
    srv = HostServer(host, "127.0.0.1:0", token=TOKEN).start()
    try:
        with pytest.raises(RemoteError):
            Client(srv.address, TOKEN).create_session(guest=b"\0asm" + bytes(MAX_MESSAGE + 10))
    finally:
        srv.stop()
        host.close()




def test_a_fault_inside_the_host_is_one_line_and_the_session_goes_on(tiny_model):
    """A bug that breaks a turn (here: an injected exception in its first step) reaches
    the client as one line, code ``internal``; the session is not stuck in that turn,
    and its next reply is the one it would have given had the broken turn never begun."""
    from kvferry.errors import InternalError
    from kvferry.host import ModelHost
    from kvferry.server import HostServer

    host = ModelHost(str(tiny_model), progress=False)
    srv = HostServer(host, "127.0.0.1:0", token=TOKEN).start()
    try:
        c = Client(srv.address, TOKEN)
        s, twin = (c.create_session(max_tokens=6, ignore_eos=True) for _ in range(2))
        assert "".join(s.send("Hello.")) == "".join(twin.send("Hello."))
        real, calls = host.steps.guest_step, []

        def broken(*a, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise IndexError("injected")
            return real(*a, **kw)

        host.steps.guest_step = broken
        with pytest.raises(InternalError, match=r"internal error in Send \(IndexError: injected\)") as e:
            "".join(s.send("A message the fault breaks."))
        assert "\n" not in str(e.value)
        assert "".join(s.send("Go on.")) == "".join(twin.send("Go on."))
        assert [m["role"] for m in host.get(s.id).messages] == ["user", "assistant"] * 2
    finally:
        srv.stop()
        host.close()


def test_a_session_closed_while_it_migrates_is_reported_as_closed(tiny_model):
    """Its client closes it between the migration's pre-copy and its pause (a close waits
    only for a turn): the migration fails as an unknown session that was closed, not as
    the closed guest it then read, and the session is on neither host."""
    from kvferry.host import ModelHost
    from kvferry.server import HostServer

    hs = [ModelHost(str(tiny_model), progress=False) for _ in range(2)]
    a, b = (HostServer(h, "127.0.0.1:0", token=TOKEN).start() for h in hs)
    a.peers = (b.address,)
    try:
        s = Client(a.address, TOKEN).create_session(max_tokens=4, ignore_eos=True)
        "".join(s.send("Hello."))
        pause = a.pause

        def close_then_pause(sid, slot):
            Client(a.address, TOKEN).session(sid).close()
            return pause(sid, slot)

        a.pause = close_then_pause
        with pytest.raises(UnknownSessionError, match=f"session {s.id} was closed during its migration to "
                                                      f"{b.address}; nothing moved"):
            s.migrate(to=b.address, live=True)
        assert s.id not in a.host.sessions and s.id not in b.host.sessions
    finally:
        a.stop()
        b.stop()
        for h in hs:
            h.close()


def test_stream_interval_sends_several_tokens_a_message(tiny_model):
    """serve --stream-interval 4: the first token alone, then up to 4 a message. A
    client that did not ask for them still gets one a message, and the SDK hands
    out one chunk a token: the same tokens, indices and texts either way."""
    from kvferry.host import ModelHost
    from kvferry.policy import HostPolicy
    from kvferry.proto import kvferry_pb2 as pb
    from kvferry.server import HostServer

    host = ModelHost(str(tiny_model), progress=False, policy=HostPolicy(stream_interval=4))
    srv = HostServer(host, "127.0.0.1:0", token=TOKEN).start()
    try:
        c = Client(srv.address, TOKEN)

        def messages(chunk_tokens: int) -> list:
            s = c.create_session(max_tokens=11, ignore_eos=True)
            req = pb.SendRequest(session_id=s.id, text="Count ferries.", chunk_tokens=chunk_tokens)
            return list(c._stub().Send(req, metadata=c._meta()))

        old, new = messages(0), messages(1024)
        assert all(not m.more_tokens for m in old) and len(old) == 12  # 11 tokens, then the end
        assert [1 + len(m.more_tokens) for m in new if m.token >= 0] == [1, 4, 4, 2]
        assert new[-1].token == -1 and new[-1].finish_reason == "length"
        flat = [(m.index + k, t, x) for m in new if m.token >= 0
                for k, (t, x) in enumerate(zip([m.token, *m.more_tokens], [m.text, *m.more_texts]))]
        one_a_message = [(m.index, m.token, m.text) for m in old if m.token >= 0]
        assert flat == one_a_message and [i for i, _, _ in flat] == list(range(11))
        via_sdk = [(e.index, e.token, e.text) for e in c.create_session(max_tokens=11, ignore_eos=True)
                   .events("Count ferries.") if e.token >= 0]
        assert via_sdk == one_a_message
    finally:
        srv.stop()
        host.close()


def test_coalesced_tokens_go_out_before_a_move_or_an_error():
    from kvferry.errors import ConfigError
    from kvferry.policy import HostPolicy
    from kvferry.proto import kvferry_pb2 as pb
    from kvferry.stream_chunks import coalesce, expand

    chunks = [pb.TokenChunk(index=i, token=100 + i, text=str(i)) for i in range(3)]
    moved = pb.TokenChunk(index=3, token=-1, moved_to="10.0.0.2:50051")
    out = list(coalesce(iter([*chunks, moved]), 8))
    assert [(m.index, m.token, list(m.more_tokens)) for m in out] == [(0, 100, []), (1, 101, [102]), (3, -1, [])]
    assert out[-1].moved_to == "10.0.0.2:50051"
    assert not chunks[1].more_tokens  # the chunks themselves are left as they were (a feed replays them)
    assert [(e.index, e.token) for m in out[:-1] for e in expand(m)] == [(0, 100), (1, 101), (2, 102)]
    bad = pb.TokenChunk(index=0, token=1, more_tokens=[2, 3], more_texts=["x"])
    with pytest.raises(RemoteError, match="carries 2 tokens but 1 texts"):
        list(expand(bad))
    with pytest.raises(ConfigError, match="--stream-interval must be at least 1, not 0"):
        HostPolicy(stream_interval=0)


def _python_blocks(path: Path) -> list[str]:
    text = path.read_text()
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


@pytest.mark.parametrize("doc", ["docs/sdk.md", "README.md"])
def test_doc_examples_run_as_written(two_hosts, tmp_path, doc):
    """Every Python example of the doc runs against real hosts; only the two
    documented addresses are replaced by the test hosts' ports."""
    a, b = two_hosts
    blocks = _python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python examples"
    for i, code in enumerate(blocks):
        code = code.replace("127.0.0.1:50051", a.address).replace("127.0.0.1:50052", b.address)
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "KVFERRY_TOKEN": TOKEN})
        assert r.returncode == 0, f"{doc} example {i + 1} failed:\n{code}\n{r.stderr[-3000:]}"


def test_async_client_has_everything_the_client_has(two_hosts):
    from kvferry import AsyncRemoteSession, RemoteSession, SessionError

    def public(cls):
        return {n for n in dir(cls) if not n.startswith("_")}
    assert public(Client) <= public(AsyncClient)
    assert public(RemoteSession) | {"last"} <= public(AsyncRemoteSession) | {"last"}
    a, b = two_hosts

    async def run():
        async with AsyncClient(a.address, TOKEN) as c:
            h = await c.health()
            assert h == Client(a.address, TOKEN).health()  # the same fields, the same values
            assert (await c.hosts())[0]["address"] == a.address
            s = await c.create_session(max_tokens=6, ignore_eos=True)
            chunks = [x async for x in s.events("Say hi.")]
            assert [x.index for x in chunks if x.token >= 0] == list(range(6))
            assert s.last["finish_reason"] == "length"
            with pytest.raises(SessionError, match="no turn in progress"):  # the turn ended
                [x async for x in s.resume(0)]
            assert (await s.info())["id"] == s.id
            with pytest.raises(UnknownSessionError):
                await c.session("nope").info()
            await s.close()
    asyncio.run(run())


def test_every_per_session_call_follows_a_move(two_hosts, tmp_path):
    """After a migration, a handle or client still pointed at the source reaches the
    session for Close, Snapshot, Migrate and info (the source answers
    session_moved with the new host); reusing the id on the source clears it."""
    from kvferry.errors import SessionMovedError

    a, b = two_hosts
    c = Client(a.address, TOKEN)
    s = c.create_session(max_tokens=6)
    "".join(s.send("Hi!"))
    Client(a.address, TOKEN).session(s.id).migrate(to=b.address)  # s itself still points at A
    assert s.host == a.address
    assert s.info()["host"] == b.address and s.host == b.address  # info followed the redirect
    stale = c.session(s.id)  # pointed at A again
    assert stale.snapshot(tmp_path / "s.kvf")["bytes"] > 0 and stale.host == b.address
    stale = c.session(s.id)
    stale.migrate(to=a.address)  # Migrate from A is redirected to B, which sends it back to A
    assert stale.host == a.address and s.info()["host"] == a.address
    c.session(s.id, host=b.address).close()  # Close at B is redirected to A
    with pytest.raises(UnknownSessionError) as e:
        s.info()
    assert not isinstance(e.value, SessionMovedError)
    # a moved id that comes back (created anew on the source) is the new session, no redirect
    t = c.create_session(session_id="reused-id", max_tokens=4)
    t.migrate(to=b.address)
    c.session("reused-id", host=b.address).close()
    again = c.create_session(session_id="reused-id", max_tokens=4)
    assert again.info()["host"] == a.address and again.host == a.address
    again.close()


def test_standard_health_needs_no_token_and_tells_only_the_status(two_hosts):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    a, _ = two_hosts
    with grpc.insecure_channel(a.address) as ch:  # a probe: no token at all
        probe = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvferry.v1.Sessions"):
            r = probe.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            probe.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(AuthError):  # everything else still needs the token
        Client(a.address, "").health()
