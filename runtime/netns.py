"""Several "machines" on one Linux box: network namespaces on a bridge (for the
tests and the benchmarks that need real addresses and real, shapeable links).

``Net(n)`` makes a bridge in the root namespace (the user's laptop, address
``.1``) and ``n`` namespaces, each with its own address on it (``.2``, ``.3``,
…) and its own loopback. Everything is named after a random tag and removed by
``close()`` (namespaces first: that deletes their veth pairs too). Traffic goes
only to these addresses. Root is required; ``available()`` says why not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys


def available() -> str | None:
    """None if namespaces can be made here, else a one-line reason."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (`ip`)"
    return None


def _bits(rate: str) -> int:
    """"100mbit" -> 100_000_000 (tc's units: kbit, mbit, gbit)."""
    for unit, k in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * k)
    raise ValueError(f"rate '{rate}': expected a number and kbit, mbit or gbit")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Machine:
    def __init__(self, ns: str, ip: str, veth: str):
        self.ns, self.ip, self.veth = ns, ip, veth

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this machine's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def kill_all(self) -> None:
        """SIGKILL every process in this machine's namespace (what a power cut does)."""
        import signal

        pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout.split()
        for pid in map(int, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def link(self, up: bool) -> None:
        """Cut or restore this machine's cable (its end of the veth pair)."""
        _ip("-n", self.ns, "link", "set", self.veth, "up" if up else "down")

    def shape(self, rate: str | None) -> None:
        """Limit what this machine sends to ``rate`` (tc tbf, e.g. "100mbit"); None: unshaped."""
        base = ["ip", "netns", "exec", self.ns, "tc", "qdisc"]
        subprocess.run([*base, "del", "dev", self.veth, "root"], capture_output=True, timeout=30)
        if rate:
            burst = max(64 << 10, _bits(rate) // 8 // 100)  # ~10 ms of the rate: tbf needs >= rate/HZ
            subprocess.run([*base, "add", "dev", self.veth, "root", "tbf", "rate", rate, "burst", str(burst),
                            "latency", "100ms"], check=True, capture_output=True, text=True, timeout=30)


class Net:
    def __init__(self, n: int = 2):
        if (why := available()) is not None:
            raise RuntimeError(why)
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.bridge = f"kvb{self.tag}"
        self.gateway = f"{self.subnet}.1"  # the root namespace: the user's laptop
        self.machines: list[Machine] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                ns, host_end, ns_end = f"kvf{self.tag}{i}", f"kvh{self.tag}{i}", f"kvn{self.tag}{i}"
                _ip("netns", "add", ns)
                self.machines.append(Machine(ns, f"{self.subnet}.{i + 2}", ns_end))
                _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                _ip("link", "set", ns_end, "netns", ns)
                _ip("link", "set", host_end, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", ns_end)
                _ip("-n", ns, "link", "set", ns_end, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill what still runs inside, then remove the namespaces (their veth pairs go
        with them) and the bridge."""
        for m in self.machines:
            m.kill_all()
            _ip("netns", "del", m.ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.machines = []

    def __enter__(self) -> "Net":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
