"""``kvferry bench fuzz``: thousands of mutated real checkpoints.

A short SmolLM2 conversation is checkpointed in every mode (lossless, raw,
int8, int4); each case picks one of them and applies one random
mutation (bit flip, truncation, insertion, deletion, overwrite) and restores.
Every case must end in a one-line CheckpointError, or, if the mutation left
the bytes unchanged, in the same session. Anything else (another exception,
a changed file accepted, a session left behind) counts as a failure.
"""

from __future__ import annotations

import random
import time


def mutate(buf: bytearray, rng: random.Random) -> bytearray:
    op = rng.choice(["flip", "truncate", "insert", "delete", "overwrite"])
    pos = rng.randrange(len(buf))
    if op == "flip":
        buf[pos] ^= 1 << rng.randrange(8)
    elif op == "truncate":
        del buf[pos:]
    elif op == "insert":
        buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif op == "delete":
        del buf[pos:pos + rng.randint(1, 64)]
    else:
        chunk = rng.randbytes(rng.randint(1, 32))
        buf[pos:pos + len(chunk)] = chunk
    return buf


def run(cases: int = 10000, seed: int = 0, model: str | None = None) -> dict:
    import tempfile
    from pathlib import Path

    from ..checkpoint import restore, snapshot
    from ..checkpoint.errors import CheckpointError
    from ..host import ModelHost
    from ..session import SamplingParams

    host = ModelHost(model, progress=False)
    s = host.create_session(sampling=SamplingParams(max_tokens=8))
    for _ in s.send("Hello!"):
        pass
    from ..checkpoint.codecs import MODES

    goods = []
    with tempfile.TemporaryDirectory() as d:
        for mode in MODES:
            path = Path(d) / f"good-{mode}.kvf"
            snapshot.save(s, path, mode)
            goods.append(path.read_bytes())
    host.close_session(s.id)
    rng = random.Random(seed)
    rejected = unchanged = 0
    failures: list[str] = []
    t = time.perf_counter()
    for _ in range(cases):
        good = rng.choice(goods)
        buf = bytes(mutate(bytearray(good), rng))
        try:
            restored = restore.restore(host, [buf])
            if buf != good:
                failures.append("a changed checkpoint was accepted")
            unchanged += 1
            host.close_session(restored.id)
        except CheckpointError as e:
            if "\n" in str(e) or not str(e):
                failures.append(f"multi-line or empty error: {e!r}")
            rejected += 1
        except Exception as e:  # noqa: BLE001 - that is the point of a fuzzer
            failures.append(f"{type(e).__name__}: {e}")
        if host.sessions:
            failures.append("a session was left behind")
            for sid in list(host.sessions):
                host.close_session(sid)
    host.close()
    return {"cases": cases, "modes": list(MODES), "checkpoint_bytes": [len(g) for g in goods], "rejected": rejected,
            "accepted_unchanged": unchanged, "failures": len(failures),
            "failure_examples": failures[:5], "seconds": round(time.perf_counter() - t, 1)}
