"""``kvferry bench link``: ``--mode auto`` against every fixed mode, on real links.

Two ``kvferry serve`` hosts, each in its own network namespace on a bridge (root
needed). For each link — ``tc tbf``-shaped rates and the unshaped veth — the same
checkpointed conversation is restored on A and moved to B by stop-and-copy once
per mode, in the same run: the transfer time of each fixed mode, and what auto
chose and took. ``auto_over_best`` is auto's time over the best fixed mode's on
that link (target: <= 1.2). Bit-exact modes only, unless ``--allow-lossy``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILLER = ("The ferry crossed the strait at dawn; the captain logged the wind, the tide, the passengers "
          "and the cargo, and the engineer checked the pumps. ")
LINKS = ("100mbit", "1gbit", "veth")


def _serve(machine, token: str, peer: str) -> subprocess.Popen:
    env = {**os.environ, "KVFERRY_TOKEN": token}
    p = subprocess.Popen(machine.cmd(sys.executable, "-m", "kvferry", "serve", "--bind", "0.0.0.0", "--port",
                                     "50051", "--peers", peer, "--threads", "1"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    for line in p.stdout:
        if "kvferry serving on" in line:
            return p
    raise RuntimeError(f"kvferry serve did not start in {machine.ns}")


def run(tokens: int = 2048, links: tuple[str, ...] = LINKS, allow_lossy: bool = False, reps: int = 1,
        progress=print) -> dict:
    from ..errors import ConfigError
    from ..netns import Net, _bits, available
    from ..sdk import Client

    if (why := available()) is not None:
        raise ConfigError(f"bench link needs network namespaces: {why}")
    modes = ["raw", "lossless", *(["int8"] if allow_lossy else []), "auto"]
    token = secrets.token_urlsafe(16)
    rows: list[dict] = []
    with Net(2) as net, tempfile.TemporaryDirectory() as d:
        a, b = net.machines
        addr_a, addr_b = f"{a.ip}:50051", f"{b.ip}:50051"
        procs = [_serve(a, token, addr_b), _serve(b, token, addr_a)]
        try:
            c = Client(addr_a, token)
            s = c.create_session(max_tokens=1, ignore_eos=True, ctx=None)
            text, ids = FILLER, 0
            while True:  # about `tokens` tokens of context
                n = len(text.split()) * 1.3
                if n >= tokens:
                    break
                text += FILLER
            progress(f"prefilling ~{tokens} tokens on A")
            "".join(s.send(text))
            ckpt = Path(d) / "conv.kvf"
            s.snapshot(ckpt, mode="raw")
            s.close()
            for link in links:
                a.shape(None if link == "veth" else link)
                for mode in modes:
                    for r in range(reps):
                        sid = f"l{ids}"
                        ids += 1
                        rs = c.restore(ckpt, session_id=sid)
                        t0 = time.perf_counter()
                        m = rs.migrate(to=addr_b, mode=mode, live=False, allow_lossy=allow_lossy)
                        wall = time.perf_counter() - t0
                        rows.append({"link": link, "mode": mode, "chosen": m.mode, "seconds": round(m.seconds, 3),
                                     "transfer_mb_s": round(m.transfer_mb_s, 1),
                                     "client_seconds": round(wall, 3), "bytes": m.bytes, "raw_kv_bytes": m.raw_kv_bytes,
                                     "mb_s": round(m.bytes / 1e6 / max(m.seconds, 1e-9), 1), "tokens": m.tokens})
                        progress(f"{link:8} {mode:9} -> {m.mode:9} {m.seconds:7.3f} s  {m.bytes / 1e6:7.1f} MB")
                        rs.close()
            a.shape(None)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    table = []
    for link in links:
        best = {}
        for mode in modes:
            times = sorted(r["seconds"] for r in rows if r["link"] == link and r["mode"] == mode)
            best[mode] = times[len(times) // 2] if times else None
        fixed = min(v for k, v in best.items() if k != "auto")
        chosen = [r["chosen"] for r in rows if r["link"] == link and r["mode"] == "auto"]
        raw = sorted(r["transfer_mb_s"] for r in rows if r["link"] == link and r["mode"] == "raw")
        raw_mb_s = raw[(len(raw) - 1) // 2] if raw else None
        rate = _bits(link) / 8e6 if link != "veth" else None  # the shaped rate, MB/s
        table.append({"link": link, **{f"{k}_seconds": v for k, v in best.items()}, "auto_chose": chosen,
                      "best_fixed": min((k for k in best if k != "auto"), key=best.get),
                      "auto_over_best": round(best["auto"] / fixed, 3) if fixed else None,
                      # the raw KV's rate (pause to verified landing) against the link's own
                      "raw_transfer_mb_s": raw_mb_s, "link_mb_s": rate,
                      "raw_share_of_link": round(raw_mb_s / rate, 3) if rate and raw_mb_s else None})
    shares = [t["raw_share_of_link"] for t in table if t["raw_share_of_link"] is not None]
    return {"tokens": tokens, "allow_lossy": allow_lossy, "reps": reps, "rows": rows, "links": table,
            "target_auto_over_best": 1.2, "met": all(t["auto_over_best"] is not None and t["auto_over_best"] <= 1.2
                                                   for t in table),
            "target_raw_share_of_link": 0.9, "raw_share_of_link_min": min(shares, default=None)}
