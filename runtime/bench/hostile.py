"""``kvferry bench hostile``: every known attack on a live host, while a bystander chats.

One ``kvferry serve`` on loopback with three keys (``--tokens``): the admin, and two
client keys, alice (the attacker) and bob. A bystander session (admin) generates
all along. Each attack runs as alice would run it, through the SDK or raw gRPC;
per attack the report says whether it was ``contained`` (alice got a one-line
error or a refusal, and the host answered a health call within 1 s afterwards),
the bystander's TPOT during the attack over before it, the host's RSS growth and
the sessions lost (the bystander's, or any other that existed). The same attack
functions are the tests of tests/test_hostile.py.
"""

from __future__ import annotations

import functools
import os
import secrets
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .loopback import LoopbackHost

GUEST = """(module
  (import "kvferry" "kv_decode" (func $decode (param i32) (result i32)))
  (import "kvferry" "kv_prefill" (func $prefill (param i32 i32) (result i32)))
  (memory (export "memory") 2 2)
  (func (export "kvferry_abi_version") (result i32) i32.const 1)
  (func (export "kvferry_buffer") (param i32) (result i32) i32.const 1024)
  (func (export "kvferry_chat_config") (param i32) (result i32) i32.const 0)
  (func (export "kvferry_chat_begin") (param i32 i32) (result i32) i32.const 0)
  (func (export "kvferry_chat_step") (result i32) STEP)
  EXTRA)"""


def guest(step: str = "i32.const -1", extra: str = "") -> bytes:
    """A chat guest in WebAssembly text whose step runs ``step``."""
    return GUEST.replace("STEP", step).replace("EXTRA", extra).encode()


START_SPIN = guest(extra="(func $spin (loop $l (br $l))) (start $spin)")
DECODE_LOOP = guest(step="(loop $l (drop (call $decode (i32.const 1))) (br $l)) i32.const -1")
STEP_SPIN = guest(step="(loop $l (br $l)) i32.const -1")


@dataclass
class Target:
    """A live host and the keys the attacks use."""
    address: str
    admin: str
    alice: str  # the attacker's client key
    bob: str  # another client key
    max_sessions: int
    max_tokens: int
    max_deadline_ms: float
    notes: list = field(default_factory=list)


class Uncontained(AssertionError):
    """An attack got through: the host did what it should have refused."""


def _expect(fn: Callable, error: type, match: str) -> str:
    try:
        fn()
    except error as e:
        msg = str(e)
        if match not in msg or "\n" in msg.strip():
            raise Uncontained(f"refused, but not as expected: {msg!r}") from None
        return msg
    raise Uncontained(f"not refused (expected {error.__name__} with {match!r})")


def _client(t: Target, key: str):
    from ..sdk import Client

    return Client(t.address, key, timeout=60)


# ----------------------------------------------------------------------------- attacks

def start_function(t: Target) -> str:
    """A guest whose start function loops forever (finding 1)."""
    from ..errors import RemoteError

    msg = _expect(lambda: _client(t, t.alice).create_session(guest=START_SPIN), RemoteError, "start function")
    s = _client(t, t.alice).create_session(max_tokens=4)  # the host still creates and answers
    "".join(s.send("Hi"))
    s.close()
    return msg


def model_loop_in_step(t: Target) -> str:
    """A guest whose one step calls kv_decode forever (finding 2)."""
    from ..errors import RemoteError

    s = _client(t, t.alice).create_session(guest=DECODE_LOOP, max_tokens=4)
    try:
        return _expect(lambda: "".join(s.send("Hi")), RemoteError, "one decode per step")
    finally:
        s.close()


def spinning_guest(t: Target) -> str:
    """A guest that spins in its step, asking for a huge deadline first (finding 2)."""
    from ..errors import RemoteError

    msg = _expect(lambda: _client(t, t.alice).create_session(guest=STEP_SPIN, deadline_ms=1e9), RemoteError,
                  "over this host's limit")
    s = _client(t, t.alice).create_session(guest=STEP_SPIN)  # the host's maximum deadline, then a trap
    try:
        _expect(lambda: "".join(s.send("Hi")), RemoteError, "exceeded its deadline")
    finally:
        s.close()
    return msg


def _checkpoint(t: Target) -> list:
    """The frames of a real checkpoint of one of alice's sessions."""
    import tempfile

    from ..checkpoint.frames import iter_frames, read_file_chunks

    s = _client(t, t.alice).create_session(max_tokens=4)
    "".join(s.send("Hello there"))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.kvf")
        s.snapshot(path)
        s.close()
        with open(path, "rb") as f:
            return list(iter_frames(read_file_chunks(f)))


def _restore(t: Target, frames: list):
    import tempfile

    from ..checkpoint.frames import TRAILER, FrameWriter

    w = FrameWriter()
    data = b"".join(w.frame(f.kind, f.body) for f in frames if f.kind != TRAILER) + w.trailer()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "crafted.kvf")
        with open(path, "wb") as f:
            f.write(data)
        return _client(t, t.alice).restore(path)


@functools.lru_cache(maxsize=2)
def zero_bomb(nbytes: int) -> bytes:
    """A zstd stream of ``nbytes`` zeros: a few tens of KB per GiB (made once: the
    attacker's own CPU is not the host's)."""
    import zstandard as zstd

    c = zstd.ZstdCompressor(level=19).compressobj(size=nbytes)
    chunk = bytes(16 << 20)
    out = [c.compress(chunk) for _ in range(nbytes // len(chunk))]
    return b"".join(out) + c.flush()


def restore_bomb(t: Target) -> str:
    """A checkpoint of ~100 KB whose KV frame declares two 1 GiB tensors (under the
    8 GiB tensor limit, over anything this model's KV can be) filled by zstd
    run-length data (finding 3): decompressed before its shape was checked."""
    from ..checkpoint.frames import KV
    from ..errors import RemoteError

    frames = _checkpoint(t)
    kv = next(f for f in frames if f.kind == KV)
    body = dict(kv.body)
    if "batch" in body:
        body = dict(body["batch"][0])
    shape = [1, 4096, 1024, 64]  # float32: 1 GiB
    big = {"codec": "zstd", "dtype": "float32", "shape": shape, "nbytes": 1 << 30, "parts": [zero_bomb(1 << 30)],
           "meta": {}}
    body.update(keys=big, values=big)
    rest = [f for f in frames if f.kind != KV]
    crafted = rest[:1] + [type(kv)(kv.index, KV, body, 0)] + rest[1:]  # the header, the bomb, the others
    return _expect(lambda: _restore(t, crafted), RemoteError, "declares")


def checkpoint_sandbox(t: Target) -> str:
    """A checkpoint that asks for a 4 GiB guest memory and an endless deadline, and one
    with an option this host does not know (finding 4)."""
    from ..errors import RemoteError

    frames = _checkpoint(t)
    header = frames[0]
    opts = dict(header.body["session"]["options"])
    body = {**header.body, "session": {**header.body["session"], "options": {**opts, "memory_cap": 4 << 30,
                                                                              "deadline_ms": 1e12}}}
    s = _restore(t, [type(header)(header.index, header.kind, body, 0)] + frames[1:])
    try:
        arena = s.info()["arena_bytes"]
        if arena > 64 << 20:
            raise Uncontained(f"the restored guest got {arena} bytes of memory")
    finally:
        s.close()
    body = {**header.body, "session": {**header.body["session"], "options": {**opts, "sandbox": "off"}}}
    return _expect(lambda: _restore(t, [type(header)(header.index, header.kind, body, 0)] + frames[1:]),
                   RemoteError, "unknown session option")


def bad_prompt(t: Target) -> str:
    """A prompt over the context, then a 2 MiB one; the conversation goes on (finding 6)."""
    from ..errors import RemoteError

    c = _client(t, t.alice)
    s, twin = c.create_session(max_tokens=4), c.create_session(max_tokens=4)
    try:
        _expect(lambda: "".join(s.send("word " * 9000)), RemoteError, "the context holds")
        msg = _expect(lambda: "".join(s.send("x" * (2 << 20))), RemoteError, "bytes, this host takes at most")
        if "".join(s.send("Hi")) != "".join(twin.send("Hi")):
            raise Uncontained("the conversation changed after a refused prompt")
        return msg
    finally:
        s.close()
        twin.close()


def migrate_anywhere(t: Target) -> str:
    """A migration to an address that is not a peer (finding 7)."""
    from ..errors import RemoteError

    s = _client(t, t.alice).create_session(max_tokens=4)
    try:
        return _expect(lambda: s.migrate(to="10.255.255.1:50051"), RemoteError, "not a peer of this host")
    finally:
        s.close()


def session_flood(t: Target) -> str:
    """More sessions than the host holds; a reply far over its limit (finding 8)."""
    from ..errors import RemoteError

    c = _client(t, t.alice)
    _expect(lambda: c.create_session(max_tokens=t.max_tokens * 100), RemoteError, "over this host's limit")
    made = []
    try:
        def flood():
            for _ in range(t.max_sessions + 1):
                made.append(c.create_session(max_tokens=4))
        return _expect(flood, RemoteError, "serve --max-sessions")
    finally:
        for s in made:
            s.close()


def other_keys_session(t: Target) -> str:
    """Bob reads, sends to and closes alice's session (finding 9)."""
    from ..errors import UnknownSessionError

    s = _client(t, t.alice).create_session(max_tokens=4)
    try:
        bob = _client(t, t.bob)
        if any(x["id"] == s.id for x in bob.sessions()):
            raise Uncontained("bob lists alice's session")
        _expect(lambda: bob.session(s.id).info(), UnknownSessionError, "unknown session")
        _expect(lambda: "".join(bob.session(s.id).send("hi")), UnknownSessionError, "unknown session")
        return _expect(lambda: bob.session(s.id).close(), UnknownSessionError, "unknown session")
    finally:
        s.close()


def client_on_peer_service(t: Target) -> str:
    """Alice pushes a session through the host-to-host Transfer service (finding 9)."""
    import grpc

    from ..proto import kvferry_pb2 as pb
    from ..proto import kvferry_pb2_grpc as pbg
    from ..transport import auth_metadata, channel

    ch = channel(t.address)
    try:
        stub = pbg.MigrationStub(ch)
        msgs = iter([pb.MigrationMessage(begin=pb.Begin(migration_id="x", session_id="y"))])
        try:
            list(stub.Transfer(msgs, metadata=auth_metadata(t.alice), timeout=10))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                raise Uncontained(f"refused, but not as expected: {e.code().name}: {e.details()}") from None
            return e.details()
        raise Uncontained("a client key reached the Transfer service")
    finally:
        ch.close()


def call_flood(t: Target) -> str:
    """Alice opens 40 slow uploads at once, each holding a worker thread while it
    dribbles (finding 5): past her key's share she is refused at once."""
    import grpc

    from ..checkpoint.frames import preamble
    from ..proto import kvferry_pb2 as pb
    from ..proto import kvferry_pb2_grpc as pbg
    from ..transport import auth_metadata, channel

    def dribble():
        yield pb.CheckpointChunk(data=preamble())
        time.sleep(4.0)  # then the upload just ends: a truncated checkpoint

    ch = channel(t.address)
    try:
        stub = pbg.SessionsStub(ch)
        calls = [stub.Restore.future(dribble(), metadata=auth_metadata(t.alice), timeout=60) for _ in range(40)]
        codes = []
        for f in calls:
            try:
                f.result()
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.details() or e.code().name)
    finally:
        ch.close()
    refused = [c for c in codes if "calls in flight" in c]
    if not refused or len(refused) > 40 - 16:
        raise Uncontained(f"40 slow uploads at once: {len(refused)} refused ({codes[:2]})")
    return refused[0]


ATTACKS: dict[str, Callable[[Target], str]] = {
    "start_function": start_function, "model_loop_in_step": model_loop_in_step, "spinning_guest": spinning_guest,
    "restore_bomb": restore_bomb, "checkpoint_sandbox": checkpoint_sandbox, "bad_prompt": bad_prompt,
    "migrate_anywhere": migrate_anywhere, "session_flood": session_flood, "other_keys_session": other_keys_session,
    "client_on_peer_service": client_on_peer_service, "call_flood": call_flood,
}
FAST = ("start_function", "model_loop_in_step", "restore_bomb", "checkpoint_sandbox", "migrate_anywhere",
        "other_keys_session", "client_on_peer_service")


# ----------------------------------------------------------------------------- the bench

def keys_file(path: str) -> dict:
    keys = {"alice": secrets.token_urlsafe(24), "bob": secrets.token_urlsafe(24)}
    with open(path, "w") as f:
        f.write("".join(f"{name} client {tok}\n" for name, tok in keys.items()))
    os.chmod(path, 0o600)
    return keys


def rss_mb(port: int, field: str = "VmRSS") -> float:
    """Resident memory of the process listening on ``port`` (the host actor);
    ``field`` VmHWM: its peak so far."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    pids = {int(x.split("pid=")[1].split(",")[0]) for x in out.split() if "pid=" in x}
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        except (OSError, StopIteration):
            pass
    return total / 1024


class Bystander:
    """A session of the admin's generating all along; token times, to compare TPOT."""

    def __init__(self, t: Target):
        self.s = _client(t, t.admin).create_session(max_tokens=24, ignore_eos=True)
        self.times: list[float] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ..errors import KvferryError

        while not self.stop.is_set():
            try:
                for c in self.s.events("Tell me about ferries."):
                    if c.token >= 0:
                        self.times.append(time.perf_counter())
            except KvferryError as e:
                self.errors.append(str(e))
                return

    def tpot(self, t0: float, t1: float) -> float | None:
        ts = [x for x in self.times if t0 <= x <= t1]
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        return statistics.median(gaps) if gaps else None


def run(attacks: tuple[str, ...] = tuple(ATTACKS), progress=print) -> dict:
    import tempfile

    from ..sdk import Client

    admin = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory() as d:
        keys = keys_file(os.path.join(d, "keys"))
        limits = {"max_sessions": 16, "max_tokens": 256, "max_deadline_ms": 1000.0}
        host = LoopbackHost(admin, "--tokens", os.path.join(d, "keys"), "--max-sessions", str(limits["max_sessions"]),
                            "--max-tokens", str(limits["max_tokens"]), "--max-deadline-ms",
                            str(limits["max_deadline_ms"]))
        port = host.port
        try:
            t = Target(host.address, admin, keys["alice"], keys["bob"], **limits)
            zero_bomb(1 << 30)  # the attacker's preparation, before anything is timed
            by = Bystander(t)
            time.sleep(3)
            # the reference: a polite second user chatting, for what sharing 2 cores costs by itself
            before = time.perf_counter()
            time.sleep(1.5)
            t0 = time.perf_counter()
            polite = _client(t, t.bob).create_session(max_tokens=16)
            "".join(polite.send("Name three rivers."))
            polite.close()
            time.sleep(max(0.0, t0 + 2.0 - time.perf_counter()))
            b0, d0 = by.tpot(before, t0), by.tpot(t0, time.perf_counter())
            reference = round(d0 / b0, 3) if b0 and d0 else None
            rows = {}
            for name in attacks:
                progress(f"attack: {name}")
                before = time.perf_counter()
                rss0, peak0 = rss_mb(port), rss_mb(port, "VmHWM")
                time.sleep(1.5)
                t0 = time.perf_counter()
                try:
                    error, ok = ATTACKS[name](t), True
                except Exception as e:  # an attack that got through, or failed unexpectedly
                    error, ok = f"{type(e).__name__}: {e}", False
                t1 = time.perf_counter()
                time.sleep(max(0.0, t0 + 2.0 - t1))  # the window: the attack and its aftermath, 2 s at least
                answered, health_ms = False, None
                for _ in range(3):  # a loaded machine may miss one probe; a frozen host misses all
                    h0 = time.perf_counter()
                    try:
                        Client(t.address, admin, timeout=1).health()
                    except Exception:
                        continue
                    health_ms = round((time.perf_counter() - h0) * 1000, 1)
                    if answered := health_ms <= 1000:
                        break
                base, during = by.tpot(before, t0), by.tpot(t0, max(t1, t0 + 2.0))
                present = {x["id"] for x in Client(t.address, admin, timeout=10).sessions()}
                rows[name] = {"contained": ok and answered, "error": error.splitlines()[0] if error else "",
                              "seconds": round(t1 - t0, 2), "health_ms": health_ms,
                              "bystander_tpot_ratio": round(during / base, 3) if base and during else None,
                              "host_rss_growth_mb": round(rss_mb(port) - rss0, 1),
                              "host_peak_rss_growth_mb": round(rss_mb(port, "VmHWM") - peak0, 1),
                              "sessions_lost": int(by.s.id not in present)}
            by.stop.set()
            by.thread.join(60)
            rows_lost = sum(r["sessions_lost"] for r in rows.values())
            return {"attacks": rows, "all_contained": all(r["contained"] for r in rows.values()),
                    "polite_user_tpot_ratio": reference,
                    "sessions_lost": rows_lost, "bystander_errors": by.errors[:3], "limits": limits}
        finally:
            host.stop()
