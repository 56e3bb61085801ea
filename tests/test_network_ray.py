"""A real Ray cluster across two "machines" (network namespaces), driven from the
root namespace: the user's laptop."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvferry import netns
from kvferry import Client
from test_distributed import TOKEN, Serve

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(netns.available() is not None, reason=f"{netns.available()}")


def test_ray_cluster_across_machines_and_a_job_from_the_laptop(smollm_dir, monkeypatch):
    """`ray start --head` on A, `ray start --address` on B (each its own temp dir and
    node address), `kvferry serve --address` on both; from the root namespace the
    SDK sees both hosts, the controller's directory follows a migration, and a
    `ray job submit` of deploy/jobs/batch_migrate.py succeeds — as docs/deploy.md says."""
    import shutil
    import sys
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="kvr"))  # short: Ray's socket paths must fit 107 bytes

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "KVFERRY_TOKEN": TOKEN,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    ray = shutil.which("ray", path=env["PATH"])
    subprocess.run([ray, "get-auth-token", "--generate"], capture_output=True, env=env, timeout=60)
    with netns.Net(2) as net:
        ma, mb = net.machines
        gcs = f"{ma.ip}:6379"
        hosts: list[Serve] = []
        try:
            r = subprocess.run(ma.cmd(ray, "start", "--head", "--node-ip-address", ma.ip, "--port", "6379",
                                      "--dashboard-host", "0.0.0.0", "--dashboard-port", "8265", "--num-cpus", "2",
                                      "--disable-usage-stats", "--temp-dir", str(tmp / "a")),
                               capture_output=True, text=True, env=env, timeout=240)
            assert r.returncode == 0, r.stderr[-2000:]
            r = subprocess.run(mb.cmd(ray, "start", "--address", gcs, "--node-ip-address", mb.ip, "--num-cpus", "2",
                                      "--disable-usage-stats", "--temp-dir", str(tmp / "b")),
                               capture_output=True, text=True, env=env, timeout=240)
            assert r.returncode == 0, r.stderr[-2000:]
            monkeypatch.setenv("RAY_AUTH_MODE", "token")  # `kvferry serve` joins a cluster with token auth
            for m in (ma, mb):
                hosts.append(Serve("--address", gcs, machine=m))
            a, b = hosts
            c = Client(a.address, TOKEN)
            listed = {h["address"]: h for h in c.hosts()}
            assert set(listed) == {a.address, b.address} and all(h["healthy"] for h in listed.values())
            assert len({h["node"] for h in listed.values()}) == 2
            s, twin = c.create_session(max_tokens=12), c.create_session(max_tokens=12)
            assert "".join(s.send("Name a planet.")) == "".join(twin.send("Name a planet."))
            s.migrate(to=b.address)
            assert s.info()["host"] == b.address
            assert "".join(s.send("And another?")) == "".join(twin.send("And another?"))
            s.close()
            twin.close()
            job = subprocess.run(
                [ray, "job", "submit", "--address", f"http://{ma.ip}:8265", "--working-dir",
                 str(ROOT / "deploy" / "jobs"), "--runtime-env-json",
                 json.dumps({"env_vars": {"KVFERRY_TOKEN": TOKEN}}), "--",
                 "python", "batch_migrate.py", "--conversations", "3", "--migrate", "2"],
                capture_output=True, text=True, env=env, timeout=900)
            out = job.stdout + job.stderr
            assert job.returncode == 0, out[-3000:]
            summary = json.loads([x for x in out.splitlines() if x.startswith("SUMMARY ")][-1][8:])
            assert summary["migrated"] == 2 and summary["identical"] and summary["directory_consistent"]
            assert sorted(summary["hosts"]) == sorted([a.address, b.address])  # the namespaces' own addresses
        finally:
            for h in hosts:
                h.stop()
            for m in (ma, mb):  # both Ray nodes, whole: every process in their namespaces
                m.kill_all()
            shutil.rmtree(tmp, ignore_errors=True)


def test_chaos_short_run_keeps_the_invariants():
    """`kvferry bench chaos`, short: 3 namespace hosts, clients chatting, random live
    migrations, a cable cut, one host SIGKILLed, one drained. Invariants only:
    nothing duplicated, nothing lost that was not on the killed host."""
    import sys

    r = subprocess.run([sys.executable, "-m", "kvferry", "bench", "chaos", "--duration", "40", "--clients", "4",
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.stdout, r.stderr[-3000:]
    out = json.loads(r.stdout)
    for key in ("sessions_started", "sessions_completed", "sessions_on_killed_host", "sessions_lost",
                "sessions_duplicated", "tokens_duplicated", "tokens_lost", "greedy_identical_to_twin"):
        assert key in out
    assert out["sessions_started"] > 0 and out["sessions_completed"] > 0
    # a string, which pytest prints whole: the lost sessions' stories and the hosts' last words
    why = json.dumps(out, indent=1)
    assert out["sessions_lost"] == 0 and out["sessions_duplicated"] == 0, why
    assert out["tokens_duplicated"] == 0 and out["tokens_lost"] == 0, why
    assert r.returncode == 0, r.stderr[-3000:]
