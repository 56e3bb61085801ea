"""A host no client can freeze, flood or fool: each attack of `kvferry bench hostile`
run against a real `kvferry serve` (its own Ray), with a bystander session that must
keep working. The attacks themselves live in kvferry.bench.hostile (one copy: the
benchmark and these tests run the same code)."""

import json
import subprocess
import sys

import pytest

from kvferry import Client
from kvferry.bench import hostile
from test_distributed import TOKEN, Serve


@pytest.fixture(scope="module")
def target(smollm_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    keys = hostile.keys_file(str(d / "keys"))
    limits = {"max_sessions": 12, "max_tokens": 256, "max_deadline_ms": 1000.0}
    srv = Serve("--tokens", str(d / "keys"), "--max-sessions", str(limits["max_sessions"]),
                "--max-tokens", str(limits["max_tokens"]), "--max-deadline-ms", str(limits["max_deadline_ms"]))
    bystander = Client(srv.address, TOKEN).create_session(max_tokens=6, ignore_eos=True)
    twin = Client(srv.address, TOKEN).create_session(max_tokens=6, ignore_eos=True)
    yield hostile.Target(srv.address, TOKEN, keys["alice"], keys["bob"], **limits), (bystander, twin)
    srv.stop()


@pytest.mark.parametrize("attack", list(hostile.ATTACKS))
def test_attack_is_contained(target, attack):
    t, (bystander, twin) = target
    msg = hostile.ATTACKS[attack](t)  # raises Uncontained when the host did what it should refuse
    assert msg and "\n" not in msg.strip() and "Traceback" not in msg  # one line, naming the problem
    h = Client(t.address, TOKEN, timeout=5).health()  # the host answers (bench hostile times it: within 1 s)
    assert h["status"] == "ok"
    # the bystander (the admin's) is intact and still answers as its twin does
    assert bystander.id in [x["id"] for x in Client(t.address, TOKEN).sessions()]
    assert "".join(bystander.send(f"After {attack}.")) == "".join(twin.send(f"After {attack}."))


def test_keys_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text("alice client short\n")
    r = subprocess.run([sys.executable, "-m", "kvferry", "serve", "--tokens", str(bad), "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "shorter than 16 characters" in r.stderr.strip().splitlines()[-1]


def test_bench_hostile_fast_runs_and_reports_every_attack(smollm_dir):
    """The CI variant: the fast attacks, invariants only (never a timing)."""
    r = subprocess.run([sys.executable, "-m", "kvferry", "bench", "hostile", "--fast", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.stdout, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert set(out["attacks"]) == set(hostile.FAST)
    for name, row in out["attacks"].items():
        for key in ("contained", "bystander_tpot_ratio", "host_rss_growth_mb", "sessions_lost"):
            assert key in row
        assert row["contained"] and row["sessions_lost"] == 0, (name, row)
    assert out["sessions_lost"] == 0 and r.returncode == 0


def test_idle_sessions_expire_and_used_ones_stay(smollm_dir):
    """serve --session-ttl: a session nobody uses is closed (whoever made it), one in
    use is kept; the janitor sweeps every 5 s."""
    import time

    from kvferry.errors import UnknownSessionError

    srv = Serve("--session-ttl", "3")
    try:
        c = Client(srv.address, TOKEN)
        idle, used = c.create_session(max_tokens=2), c.create_session(max_tokens=2)
        t0 = time.time()
        while time.time() - t0 < 11:
            used.info()  # any use resets its idle time
            time.sleep(1)
        with pytest.raises(UnknownSessionError):
            idle.info()
        assert used.info()["id"] == used.id
    finally:
        srv.stop()
