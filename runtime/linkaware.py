"""``--mode auto``: choose how KV travels from what this link and these CPUs do now.

A migration starts raw. The first ``PROBE_BYTES`` of KV go out unpaced and the
source waits for the target to acknowledge them; the rate between the first and
the last of those acks is the end-to-end rate of raw frames (wire, and the target
verifying and landing them), the connection's warm-up left out. Meanwhile the
codecs are timed on a sample of the same KV, encoding and decoding here (the
target decodes at about our speed: an assumption, named). The transfer is a
pipeline — encode, wire, decode overlap frame by frame — so each mode costs its
slowest stage per raw byte; the cheapest wins for the rest of the migration.
Lossy modes compete only when the caller allows them. Nothing here is a
constant tuned to today's speeds: faster links or CPUs change the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack
import numpy as np

from .checkpoint import codecs

PROBE_BYTES = 16 << 20  # raw KV sent to time the link: a few acks' worth (less if the session has less)
SAMPLE_BYTES = 2 << 20  # KV the codecs are timed on


@dataclass
class Choice:
    mode: str = "raw"
    wire_mb_s: float = 0.0  # raw frames, end to end
    seconds_per_mb: dict = field(default_factory=dict)  # per candidate mode: its slowest stage
    ratio: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "wire_mb_s": round(self.wire_mb_s, 1),
                "seconds_per_mb": {k: round(v, 5) for k, v in self.seconds_per_mb.items()},
                "ratio": {k: round(v, 3) for k, v in self.ratio.items()}}


def codec_costs(sample: list[tuple[np.ndarray, str]], modes: tuple[str, ...]) -> dict[str, tuple[float, float, float]]:
    """Per mode: (ratio, encode s/MB, decode s/MB) measured on ``sample`` (KV bits, dtype)."""
    raw = sum(u.nbytes for u, _ in sample) / 1e6
    out = {}
    for mode in modes:
        t0 = time.perf_counter()
        blobs = [codecs.encode(u, dtype, mode, "keys" if i % 2 == 0 else "values")
                 for i, (u, dtype) in enumerate(sample)]
        t1 = time.perf_counter()
        for b in blobs:
            codecs.decode(b, "probe")
        t2 = time.perf_counter()
        wire = sum(len(msgpack.packb(b)) for b in blobs) / 1e6  # what a frame carries
        out[mode] = (raw / max(wire, 1e-9), (t1 - t0) / raw, (t2 - t1) / raw)
    return out


def choose(wire_mb_s: float, costs: dict[str, tuple[float, float, float]]) -> Choice:
    """The mode whose slowest pipeline stage per raw MB is the cheapest (raw: the wire)."""
    c = Choice(wire_mb_s=wire_mb_s)
    per_mb = {"raw": 1.0 / max(wire_mb_s, 1e-9)}
    c.ratio["raw"] = 1.0
    for mode, (ratio, enc, dec) in costs.items():
        per_mb[mode] = max(enc, 1.0 / (ratio * max(wire_mb_s, 1e-9)), dec)
        c.ratio[mode] = ratio
    c.seconds_per_mb = per_mb
    c.mode = min(per_mb, key=per_mb.get)
    return c
