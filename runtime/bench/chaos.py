"""``kvferry bench chaos``: many clients chatting while hosts move, die and drain.

Three ``kvferry serve`` hosts, each in its own network namespace (root needed),
peers of one another. ``clients`` threads chat from the root namespace, each
through scripted conversations whose greedy replies were recorded first on an
undisturbed host (the twin). Meanwhile: random live migrations; host B's cable
cut for a few seconds; host C SIGKILLed (every process in its namespace); host A
drained by SIGTERM (its sessions move to the survivors). At the end every
surviving host lists its sessions.

- ``sessions_on_killed_host``: sessions that lived only on the killed host, with
  no checkpoint: gone, by definition;
- ``sessions_lost``: any other session that vanished (must be 0);
- ``sessions_duplicated``: listed by two hosts at once; ``tokens_duplicated`` and
  ``tokens_lost``: a reply's token indices repeated or skipped (all must be 0);
- ``greedy_identical_to_twin``: the share of sessions never on the killed host
  whose replies equal the twin's (1.0).
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

SCRIPTS = [["Name a color.", "And another one?", "And a third?"], ["What is 2 + 3?", "And 4 + 4?", "And 5 + 1?"],
           ["Name a fruit.", "And a vegetable?", "And a tree?"], ["Say hello.", "Say goodbye.", "Say thanks."]]
MAX_TOKENS = 16
THINK_S = (0.2, 1.0)  # a client's pause between two turns: idle sessions get moved too


class _Host:
    def __init__(self, machine, token: str, peers: list[str], drain_dir: str):
        self.m, self.address = machine, f"{machine.ip}:50051"
        argv = machine.cmd(sys.executable, "-m", "kvferry", "serve", "--bind", "0.0.0.0", "--port", "50051",
                           "--threads", "1", "--peers", ",".join(peers), "--drain-dir", drain_dir,
                           "--drain-timeout", "30")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "KVFERRY_TOKEN": token}, start_new_session=True)
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if "kvferry serving on" in line:
                break
        else:
            raise RuntimeError(f"kvferry serve did not start in {machine.ns}: {''.join(self.log[-5:])}")
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()

    def kill(self) -> None:
        """SIGKILL everything in this machine's namespace (the host, its Ray, its actors)."""
        self.m.kill_all()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def run(duration: float = 120.0, clients: int = 8, seed: int = 0, progress=print) -> dict:
    from ..errors import ConfigError, KvferryError
    from ..netns import Net, available
    from ..sdk import Client

    if (why := available()) is not None:
        raise ConfigError(f"bench chaos needs network namespaces: {why}")
    if clients < 1 or duration < 10:
        raise ConfigError(f"bench chaos: at least 1 client and 10 s, not {clients} and {duration:g} s")
    rng = random.Random(seed)
    token = secrets.token_urlsafe(16)
    stats = {"sessions_started": 0, "sessions_completed": 0, "tokens_duplicated": 0, "tokens_lost": 0,
             "migrations": 0, "migrations_refused": 0, "client_errors": 0}
    refused_by: Counter[str] = Counter()  # a refused migration's error code: why moves did not happen
    refused_said: dict[str, str] = {}  # the first refusal's message, by code
    errors_by: Counter[str] = Counter()  # a client's error code
    lock = threading.Lock()
    sessions: dict[str, dict] = {}  # id -> {"host", "identical", "on_killed", "done"}
    with Net(3) as net, __import__("tempfile").TemporaryDirectory() as d:
        addrs = [f"{m.ip}:50051" for m in net.machines]
        hosts = []
        try:
            started: list = [None] * 3

            def start(i: int) -> None:
                try:
                    started[i] = _Host(net.machines[i], token, [x for x in addrs if x != addrs[i]], f"{d}/{i}")
                except Exception as e:  # reported below, after the others are up (and stopped)
                    started[i] = e
            ts = [threading.Thread(target=start, args=(i,)) for i in range(3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            hosts = [h for h in started if isinstance(h, _Host)]
            if len(hosts) < 3:
                raise ConfigError(f"bench chaos: a host did not start: {[e for e in started if not isinstance(e, _Host)][0]}")
            a, b, c = hosts
            progress(f"hosts up: A {a.address}, B {b.address}, C {c.address}")
            alive = {h.address for h in hosts}
            twin = {}  # the undisturbed replies, recorded on A before the chaos starts
            for k, script in enumerate(SCRIPTS):
                s = Client(a.address, token).create_session(max_tokens=MAX_TOKENS, ignore_eos=True)
                twin[k] = ["".join(s.send(q)) for q in script]
                s.close()
            killed: dict = {"address": None, "at": None}
            t_start = time.monotonic()
            deadline = t_start + duration

            def chat(n: int) -> None:
                r = random.Random(seed * 1000 + n)
                while time.monotonic() < deadline - 5:
                    k = r.randrange(len(SCRIPTS))
                    with lock:
                        start = r.choice(sorted(alive))
                    try:
                        s = Client(start, token, timeout=60).create_session(max_tokens=MAX_TOKENS, ignore_eos=True)
                    except KvferryError as e:
                        with lock:
                            stats["client_errors"] += 1
                            errors_by[e.code] += 1
                        time.sleep(0.5)
                        continue
                    rec = {"host": s.host, "identical": True, "on_killed": False, "done": False, "handle": s}
                    with lock:
                        sessions[s.id] = rec
                        stats["sessions_started"] += 1
                    try:
                        for q, want in zip(SCRIPTS[k], twin[k]):
                            chunks = list(s.events(q))
                            idx = [x.index for x in chunks if x.token >= 0]
                            with lock:
                                stats["tokens_duplicated"] += len(idx) - len(set(idx))
                                stats["tokens_lost"] += (max(idx) + 1 - len(set(idx))) if idx else 0
                            rec["host"] = s.host
                            if "".join(x.text for x in chunks) != want:
                                rec["identical"] = False
                            time.sleep(r.uniform(*THINK_S))
                        rec["done"] = True
                        with lock:
                            stats["sessions_completed"] += 1
                        s.close()
                    except KvferryError as e:
                        rec["host"], rec["error"] = s.host, f"{time.monotonic() - t_start:.1f}s {type(e).__name__}: {e}"
                        with lock:
                            stats["client_errors"] += 1
                            errors_by[e.code] += 1
                            if killed["address"] and rec["host"] == killed["address"]:
                                rec["on_killed"] = True

            movers = threading.Semaphore(3)  # live migrations in flight at once

            def move(sid: str, rec: dict, src: str, to: str) -> None:
                rec["moving_to"] = to
                rec.setdefault("moves", []).append(f"{time.monotonic() - t_start:.1f}s {src}->{to}")
                try:
                    Client(src, token, timeout=60).session(sid).migrate(to=to)
                    with lock:
                        stats["migrations"] += 1
                        rec["host"] = to  # where it lives now, whatever its client last saw
                    rec["moves"][-1] += " ok"
                except KvferryError as e:  # refused: the session ended, moved meanwhile, or a host is gone
                    rec["moves"][-1] += f" {type(e).__name__}: {e}"
                    with lock:
                        stats["migrations_refused"] += 1
                        refused_by[e.code] += 1
                        refused_said.setdefault(e.code, str(e))
                finally:
                    rec["moving_to"] = None
                    movers.release()

            def chaos() -> None:
                t0 = time.monotonic()
                plan = [(0.3, "cut"), (0.5, "kill"), (0.7, "drain")]
                while time.monotonic() < deadline - 5:
                    frac = (time.monotonic() - t0) / duration
                    if plan and frac >= plan[0][0]:
                        what = plan.pop(0)[1]
                        if what == "cut":
                            progress(f"{time.monotonic() - t_start:.1f}s chaos: host B's cable cut for 3 s")
                            b.m.link(False)
                            time.sleep(3)
                            b.m.link(True)
                        elif what == "kill":
                            progress(f"{time.monotonic() - t_start:.1f}s chaos: host C SIGKILLed")
                            with lock:
                                alive.discard(c.address)
                                killed.update(address=c.address, at=time.monotonic())
                                for rec in sessions.values():  # there, or on its way there
                                    if not rec["done"] and c.address in (rec["host"], rec.get("moving_to")):
                                        rec["on_killed"] = True
                            c.kill()
                        else:
                            progress(f"{time.monotonic() - t_start:.1f}s chaos: host A drained by SIGTERM")
                            with lock:
                                alive.discard(a.address)
                            a.proc.send_signal(signal.SIGTERM)
                        continue
                    with lock:
                        live = [(sid, r) for sid, r in sessions.items() if not r["done"] and r["host"] in alive]
                        targets = sorted(alive)
                    if live and len(targets) > 1 and movers.acquire(blocking=False):
                        sid, rec = rng.choice(live)
                        to = rng.choice([t for t in targets if t != rec["host"]])
                        threading.Thread(target=move, args=(sid, rec, rec["host"], to), daemon=True).start()
                    time.sleep(rng.uniform(0.2, 1.0))

            threads = [threading.Thread(target=chat, args=(n,), daemon=True) for n in range(clients)]
            threads.append(threading.Thread(target=chaos, daemon=True))
            for t in threads:
                t.start()
            for t in threads:
                t.join(duration + 180)
            for _ in range(3):  # let migrations in flight finish before the hosts are asked what they hold
                movers.acquire(timeout=120)
            try:
                a.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
            where: dict[str, list[str]] = {}
            for h in (a, b):
                if h.proc.poll() is not None:
                    continue
                for x in Client(h.address, token, timeout=30).sessions():
                    where.setdefault(x["id"], []).append(h.address)
            # a session that is neither finished (closed by its client) nor listed by a survivor
            # is gone: by definition if it lived on the killed host, else lost
            drain_log = "".join(a.log)
            saved = {x.split()[2].rstrip(":") for x in drain_log.splitlines() if ": saved " in x}
            # saved by the drain: on disk, restored when A starts again with its drain directory
            gone = [sid for sid, rec in sessions.items() if not rec["done"] and sid not in where and sid not in saved]
            on_killed = sum(sessions[sid]["on_killed"] for sid in gone)
            lost = len(gone) - on_killed
            lost_ids = [sid for sid in gone if not sessions[sid]["on_killed"]]
            never_killed = [r for r in sessions.values() if not r["on_killed"] and r["done"]]
            # a loss is a bug: each host's last words say where to look
            logs = {h.address: [x.rstrip() for x in h.log[-60:]] for h in hosts} if lost_ids else {}
        finally:
            for h in hosts:
                h.stop()
    return {**stats, "migrations_refused_by": dict(refused_by), "migrations_refused_said": refused_said,
            "client_errors_by": dict(errors_by),
            "duration_s": duration, "clients": clients, "hosts": 3,
            "sessions_on_killed_host": on_killed, "sessions_lost": lost, "lost_ids": lost_ids,
            "lost": [{k: v for k, v in sessions[sid].items() if k != "handle"} | {"id": sid} for sid in lost_ids],
            "sessions_saved_by_drain": len(saved), "host_logs": logs,
            "sessions_duplicated": sum(len(v) > 1 for v in where.values()),
            "greedy_identical_to_twin": round(sum(r["identical"] for r in never_killed) / max(1, len(never_killed)), 4),
            "drain_moved": drain_log.count(": moved "), "drain_saved": drain_log.count(": saved "),
            "drain_failed": drain_log.count(": failed "), "drain_ended": drain_log.count(": ended"),
            "drain_log": [x.strip() for x in drain_log.splitlines() if x.startswith("kvferry: session")]}
