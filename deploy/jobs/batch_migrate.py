"""A `ray job submit` job: a batch of conversations across the cluster's hosts,
some migrated midway, with a summary.

    ray job submit --address http://HEAD:8265 --working-dir deploy/jobs -- \
        python batch_migrate.py --conversations 6 --migrate 3

It joins the cluster, makes sure every alive node runs a kvferry SessionHost
(``--hosts-per-node`` of them), places conversations on the least-loaded hosts,
migrates ``--migrate`` of them mid-reply to another host, and checks each
migrated conversation against an unmigrated twin (greedy: the continuation must
be identical). Exit status 0 only if every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import threading
import time

import ray

from kvferry import cluster
from kvferry import Client

QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "What is 2 + 2?",
    "Tell me about the sea.", "What do cats eat?", "Why is the sky blue?",
    "Name a planet.", "What is a lighthouse?",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--migrate", type=int, default=3)
    ap.add_argument("--hosts-per-node", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--base-port", type=int, default=50300)
    a = ap.parse_args()

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace=cluster.NAMESPACE)
    token = os.environ.get("KVFERRY_TOKEN")
    ctl = cluster.controller()
    hosts = [h for h in ray.get(ctl.hosts.remote()) if h["healthy"]]
    if hosts and not token:  # hosts started by `kvferry serve` have the fleet's token; so must we
        print("batch_migrate: the cluster's hosts need the fleet's token: pass KVFERRY_TOKEN to the job "
              "(ray job submit --runtime-env-json '{\"env_vars\": {\"KVFERRY_TOKEN\": \"...\"}}')")
        return 2
    token = token or secrets.token_urlsafe(24)  # only the hosts this job starts itself will use it
    started = []
    if len(hosts) < 2:
        port = a.base_port
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            for _ in range(a.hosts_per_node):
                actor, addr = cluster.start_host(None, f"127.0.0.1:{port}" if node["NodeManagerAddress"]
                                                 .startswith("127.") else f"0.0.0.0:{port}", token,
                                                 node_id=node["NodeID"])
                started.append(actor)
                port += 1
        hosts = [h for h in ray.get(ctl.hosts.remote()) if h["healthy"]]
    addrs = [h["address"] for h in hosts]
    print(f"hosts: {addrs}", flush=True)
    if len(addrs) < 2:
        print("need at least two hosts to migrate")
        return 2

    t0 = time.time()
    results = []
    for i in range(a.conversations):
        q = QUESTIONS[i % len(QUESTIONS)]
        place = ray.get(ctl.place.remote())
        client = Client(place, token)
        s = client.create_session(max_tokens=a.max_tokens)
        twin = client.create_session(max_tokens=a.max_tokens)
        reference = "".join(twin.send(q))
        migrate = i < a.migrate
        pieces: list[str] = []
        moved = None
        if migrate:
            target = next(x for x in addrs if x != place)
            th = threading.Thread(target=lambda: pieces.extend(s.send(q)))
            th.start()
            time.sleep(0.3)
            moved = Client(place, token).session(s.id).migrate(to=target)
            th.join()
        else:
            pieces.extend(s.send(q))
        reply = "".join(pieces)
        where = ray.get(ctl.lookup.remote(s.id))
        host = s.info()["host"]  # asked, not assumed: a live migration may commit after the reply ended
        results.append({"question": q, "host": host, "directory": where, "migrated": migrate,
                        "identical": reply == reference,
                        "migration_ms": round(moved.seconds * 1000, 1) if moved else None,
                        "migration_bytes": moved.bytes if moved else None, "reply": reply})
        s.close()
        twin.close()

    ok = all(r["identical"] for r in results) and all(
        r["directory"] == r["host"] for r in results)
    summary = {"conversations": len(results), "migrated": sum(r["migrated"] for r in results),
               "identical": all(r["identical"] for r in results),
               "directory_consistent": all(r["directory"] == r["host"] for r in results),
               "hosts": addrs, "seconds": round(time.time() - t0, 1)}
    for r in results:
        print(json.dumps(r), flush=True)
    print("SUMMARY " + json.dumps(summary), flush=True)
    for actor in started:
        try:
            ray.get(actor.stop.remote(), timeout=10)
        except Exception:
            pass
        ray.kill(actor)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
