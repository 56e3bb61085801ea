"""Ray: a real two-node cluster on loopback, SessionHost actors, the controller, `ray job submit`."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_distributed import TOKEN, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ray_cluster(smollm_dir, tmp_path_factory):
    """A real two-node Ray cluster on loopback: `ray start --head` plus one worker node."""
    tmp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    port, dash = free_port(), free_port()
    # token auth is on by default: make sure this machine has a token (a fresh CI machine may not)
    subprocess.run(["ray", "get-auth-token", "--generate"], capture_output=True, env=env, timeout=60)
    head = subprocess.run(["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                           "--include-dashboard=true", "--num-cpus", "2", "--disable-usage-stats",
                           "--temp-dir", str(tmp)], capture_output=True, text=True, env=env, timeout=180)
    try:
        assert head.returncode == 0, head.stderr[-2000:]
        worker = subprocess.run(["ray", "start", "--address", f"127.0.0.1:{port}", "--node-ip-address",
                                 "127.0.0.1", "--num-cpus", "2", "--disable-usage-stats"],
                                capture_output=True, text=True, env=env, timeout=180)
        assert worker.returncode == 0, worker.stderr[-2000:]
        yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "env": env}
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env, timeout=120)


def test_ray_two_nodes(ray_cluster):
    """Two SessionHost actors on two Ray nodes; the controller's directory follows a migration."""
    code = f"""
import os, ray, json
from kvferry import blas, cluster
from kvferry.sdk import Client
ray.init(address="{ray_cluster['address']}", namespace=cluster.NAMESPACE, log_to_driver=False,
         runtime_env={{"env_vars": blas.worker_env()}})
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
assert len(nodes) == 2, nodes
hosts = [cluster.start_host(None, "127.0.0.1:0", "{TOKEN}", node_id=n) for n in nodes]
(h1, a1), (h2, a2) = hosts
ctl = cluster.controller()
listed = {{h["address"]: h for h in ray.get(ctl.hosts.remote())}}
assert set(listed) == {{a1, a2}} and all(h["healthy"] for h in listed.values())
assert len({{h["node"] for h in listed.values()}}) == 2
c = Client(a1, "{TOKEN}")
assert {{h["address"] for h in c.hosts()}} == {{a1, a2}}
s = c.create_session(max_tokens=16); twin = c.create_session(max_tokens=16)
assert ray.get(ctl.lookup.remote(s.id)) == a1
"".join(s.send("What is the capital of France?")); "".join(twin.send("What is the capital of France?"))
s.migrate(to=a2)
assert ray.get(ctl.lookup.remote(s.id)) == a2
a = "".join(s.send("And of Italy?")); b = "".join(twin.send("And of Italy?"))
assert a == b, (a, b)
for h, _ in hosts:
    ray.get(h.stop.remote()); ray.kill(h)
ray.kill(ctl)
print("OK", a)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**ray_cluster["env"], "RAY_AUTH_MODE": "token"})
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "Rome" in r.stdout


def test_ray_job_submit(ray_cluster):
    for _ in range(10):  # a fresh head's job agent may not be up yet: Ray says to try again later
        job = subprocess.run(["ray", "job", "submit", "--address", ray_cluster["dashboard"],
                              "--working-dir", str(ROOT / "deploy" / "jobs"), "--",
                              "python", "batch_migrate.py", "--conversations", "4", "--migrate", "2",
                              "--hosts-per-node", "1", "--base-port", str(free_port())],
                             capture_output=True, text=True, env={**ray_cluster["env"], "RAY_AUTH_MODE": "token"},
                             timeout=900)
        out = job.stdout + job.stderr
        if "No available agent to submit job" not in out:
            break
        time.sleep(3)
    assert job.returncode == 0, out[-3000:]
    summary = [line for line in out.splitlines() if line.startswith("SUMMARY ")]
    assert summary, out[-3000:]
    import json
    s = json.loads(summary[-1][len("SUMMARY "):])
    assert s["conversations"] == 4 and s["migrated"] == 2 and len(s["hosts"]) == 2
    assert s["identical"] is True and s["directory_consistent"] is True
