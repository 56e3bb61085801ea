"""Hosts on their own addresses: each `kvferry serve` in a network namespace on a
bridge (a "machine"), the test itself in the root namespace (the user's laptop)."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvferry import netns
from kvferry import Client, RemoteError
from kvferry.transport import TLSConfig
from test_distributed import TOKEN, Serve

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=f"{netns.available()}")


@pytest.fixture(scope="module")
def lan(smollm_dir):
    """Two machines A and B, each serving on its own address, port 50051."""
    net = netns.Net(2)
    hosts = []
    try:
        for m, other in zip(net.machines, reversed(net.machines)):
            hosts.append(Serve("--peers", f"{other.ip}:50051", machine=m))
        yield net, hosts
    finally:
        for h in hosts:
            h.stop()
        net.close()


def test_a_host_bound_to_every_interface_advertises_its_own_address(lan):
    net, (a, b) = lan
    assert a.advertised == f"{net.machines[0].ip}:50051" and b.advertised == f"{net.machines[1].ip}:50051"
    c = Client(a.address, TOKEN)
    assert c.health()["address"] == a.address
    s = c.create_session(max_tokens=8)
    assert s.host == a.address  # a handle a client on another machine can use
    assert "".join(s.send("Hi!"))
    assert [x["host"] for x in c.sessions() if x["id"] == s.id] == [a.address]
    s.close()


def test_live_migration_across_machines_mid_reply(lan):
    _, (a, b) = lan
    c = Client(a.address, TOKEN)
    s = c.create_session(max_tokens=40, ignore_eos=True)
    twin = c.create_session(max_tokens=40, ignore_eos=True)
    chunks = []
    th = threading.Thread(target=lambda: chunks.extend(s.events("Tell me a long story about a ship.")))
    th.start()
    while len(chunks) < 3:
        time.sleep(0.02)
    m = Client(a.address, TOKEN).session(s.id).migrate(to=b.address)  # live, the default
    th.join(180)
    ref = list(twin.events("Tell me a long story about a ship."))
    tokens = [x.token for x in chunks if x.token >= 0]
    assert [x.index for x in chunks if x.token >= 0] == list(range(40))
    assert tokens == [x.token for x in ref if x.token >= 0]
    assert m.target == b.address and s.host == b.address  # the handle points at B's real address
    assert s.info()["host"] == b.address
    s.close()
    twin.close()


def test_tls_and_mutual_tls_by_ip_address(tiny_model, tmp_path):
    """make-certs.sh issues IP SANs: a client dials a host by its IP address over
    TLS, and over mutual TLS with the client certificate."""
    from kvferry.host import ModelHost
    from kvferry.server import HostServer

    with netns.Net(1) as net:
        ip = net.gateway  # a host in the root namespace, on the bridge's address
        subprocess.run(["sh", str(ROOT / "deploy/tls/make-certs.sh"), str(tmp_path), ip], check=True,
                       capture_output=True)
        cert, key, ca = (str(tmp_path / f) for f in (f"{ip}.pem", f"{ip}.key", "ca.pem"))
        host = ModelHost(str(tiny_model), progress=False)
        tls = HostServer(host, f"{ip}:0", token=TOKEN, tls=TLSConfig(cert, key)).start()
        mtls = HostServer(host, f"{ip}:0", token=TOKEN, tls=TLSConfig(cert, key, ca=ca)).start()
        try:
            assert tls.address.startswith(ip) and mtls.address.startswith(ip)
            assert Client(tls.address, TOKEN, tls=TLSConfig(ca=ca)).health()["status"] == "ok"
            with pytest.raises(RemoteError):  # mutual: no client certificate
                Client(mtls.address, TOKEN, tls=TLSConfig(ca=ca), timeout=5).health()
            client = TLSConfig(str(tmp_path / "client.pem"), str(tmp_path / "client.key"), ca)
            assert Client(mtls.address, TOKEN, tls=client).health()["status"] == "ok"
        finally:
            tls.stop()
            mtls.stop()
            host.close()


STORY = "Tell me a long story about a lighthouse."


def _kvferry(*args: str) -> subprocess.CompletedProcess:
    import os
    import sys

    return subprocess.run([sys.executable, "-m", "kvferry", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KVFERRY_TOKEN": TOKEN})


def test_sigterm_drains_every_session_to_a_peer(smollm_dir, tmp_path):
    """SIGTERM on A (serve --peers B): a reply being generated continues on B
    with its client following, an idle session is on B with its history, A exits."""
    import signal

    with netns.Net(2) as net:
        ma, mb = net.machines
        b = Serve(machine=mb)
        a = None
        try:
            a = Serve("--peers", b.address, "--drain-dir", str(tmp_path / "a"), machine=ma)
            ref = Client(b.address, TOKEN)  # the same model, greedy: B's own replies are the reference
            r1 = ref.create_session(max_tokens=40, ignore_eos=True)
            want = [x.token for x in r1.events(STORY) if x.token >= 0]
            r2 = ref.create_session(max_tokens=8)
            want_first, want_second = "".join(r2.send("Hi!")), "".join(r2.send("And then?"))
            r1.close()
            r2.close()
            c = Client(a.address, TOKEN)
            s = c.create_session(max_tokens=40, ignore_eos=True)
            idle = c.create_session(max_tokens=8)
            assert "".join(idle.send("Hi!")) == want_first
            chunks = []
            th = threading.Thread(target=lambda: chunks.extend(s.events(STORY)))
            th.start()
            while len(chunks) < 3:
                time.sleep(0.02)
            a.proc.send_signal(signal.SIGTERM)
            th.join(180)
            assert a.proc.wait(120) == 0
            assert [x.token for x in chunks if x.token >= 0] == want  # nothing lost, nothing repeated
            assert s.host == b.address
            log = "".join(a.log)
            assert f"session {s.id}: moved {b.address}" in log and f"session {idle.id}: moved {b.address}" in log
            assert "".join(Client(b.address, TOKEN).session(idle.id).send("And then?")) == want_second
            assert not list((tmp_path / "a").glob("*.kvf"))  # nothing had to be saved
        finally:
            if a is not None:
                a.stop()
            b.stop()


def test_drain_with_no_peer_saves_and_the_next_start_restores(smollm_dir, tmp_path):
    """`kvferry drain --keep-running`: health NOT_SERVING, new sessions refused,
    sessions saved (no peer). `kvferry drain`: the host stops. Started again with
    the same drain directory, the sessions are back and continue as they would have."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvferry import HostDrainingError  # noqa: F401  (exported by name)
    from kvferry.errors import HostDrainingError as Draining

    d = tmp_path / "drain"
    a = Serve("--drain-dir", str(d))
    a2 = None
    try:
        c = Client(a.address, TOKEN)
        s, twin = c.create_session(max_tokens=12), c.create_session(max_tokens=12)
        assert "".join(s.send("Hi!")) == "".join(twin.send("Hi!"))
        r = _kvferry("drain", "--host", a.address, "--keep-running", "--json")
        assert r.returncode == 0, r.stderr
        rows = {x["session"]: x for x in json.loads(r.stdout)}
        assert {rows[s.id]["outcome"], rows[twin.id]["outcome"]} == {"saved"}
        assert "no peer" in rows[s.id]["error"]
        assert sorted(p.stem for p in d.glob("*.kvf")) == sorted([s.id, twin.id])
        with grpc.insecure_channel(a.address) as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert st == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(Draining, match="draining"):
            c.create_session()
        r = _kvferry("drain", "--host", a.address)
        assert r.returncode == 0 and "drained 0 of 0 sessions; the host stops" in r.stdout, r.stdout + r.stderr
        assert a.proc.wait(120) == 0
        a2 = Serve("--drain-dir", str(d), port=a.port)
        assert f"session {s.id}: restored" in "".join(a2.log) and not list(d.glob("*.kvf"))
        c2 = Client(a2.address, TOKEN)
        assert "".join(c2.session(s.id).send("And then?")) == "".join(c2.session(twin.id).send("And then?"))
    finally:
        a.stop()
        if a2 is not None:
            a2.stop()



def test_bench_link_runs_and_reports_every_key(smollm_dir):
    """The CI variant of `kvferry bench link`: one tbf-shaped link, a short context;
    keys only (never a timing)."""
    r = subprocess.run([sys.executable, "-m", "kvferry", "bench", "link", "--json", "--links", "1gbit", "--tokens",
                        "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    (link,) = out["links"]
    assert link["link"] == "1gbit" and link["link_mb_s"] == 125.0 and link["auto_chose"]
    assert link["raw_transfer_mb_s"] > 0 and link["raw_share_of_link"] > 0 and out["raw_share_of_link_min"] > 0
    assert {r["mode"] for r in out["rows"]} == {"raw", "lossless", "auto"} and out["target_raw_share_of_link"] == 0.9
