"""Hosts on their own addresses: each `kvferry serve` in a network namespace on a
bridge (a "machine"), the test itself in the root namespace (the user's laptop)."""

import subprocess
import threading
import time
from pathlib import Path

import pytest

import netns
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
        for m in net.machines:
            hosts.append(Serve(machine=m))
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
