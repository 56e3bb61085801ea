"""Read a checkpoint without restoring it: ``kvferry checkpoint inspect/verify``."""

from __future__ import annotations

import os

from . import codecs
from .errors import CheckpointError
from .frames import GUEST, HEADER, KV, STATE, TRAILER, iter_frames, read_file_chunks


def _blobs(body):
    if isinstance(body, dict):
        if "codec" in body and "parts" in body:
            yield body
        else:
            for v in body.values():
                yield from _blobs(v)
    elif isinstance(body, list):
        for v in body:
            yield from _blobs(v)


def inspect(path: str | os.PathLike, *, decode: bool = True) -> dict:
    """Verify every frame (checksums, trailer digest, and with ``decode`` every payload)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from None
    layers: dict[int, dict] = {}
    out: dict = {"file": str(path), "bytes": os.path.getsize(path), "frames": 0}
    with f:
        for fr in iter_frames(read_file_chunks(f)):
            out["frames"] += 1
            b = fr.body
            if fr.kind == HEADER:
                out["header"] = b
            elif fr.kind == KV:
                entries = b.get("batch") if isinstance(b.get("batch"), list) else [b]
                for e in entries:  # a batch frame's bytes are shared out evenly
                    e = e if isinstance(e, dict) else {}
                    i = e.get("layer")
                    row = layers.setdefault(i, {"layer": i, "frames": 0, "bytes": 0, "raw_bytes": 0,
                                                "tokens": 0})
                    row["frames"] += 1
                    row["bytes"] += fr.nbytes // len(entries)
                    row["tokens"] = max(row["tokens"], e.get("end", 0))
                    for blob in _blobs(e):
                        row["raw_bytes"] += int(blob.get("nbytes") or 0)
                        if decode:
                            codecs.decode(blob, fr.name)
            elif fr.kind == STATE:
                out["tokens"] = b.get("n_tokens")
                out["messages"] = len(b.get("messages") or [])
                if decode:
                    for blob in _blobs(b):
                        codecs.decode(blob, fr.name)
            elif fr.kind == GUEST:
                out["guest_memory_bytes"] = b.get("memory_size")
                out["guest_pages_saved"] = len(b.get("pages") or b"") // 4
                if decode:
                    for blob in _blobs(b):
                        codecs.decode(blob, fr.name)
            elif fr.kind == TRAILER:
                out["digest"] = b.get("digest")
    rows = [layers[k] for k in sorted(layers, key=lambda x: (x is None, x))]
    kv_bytes = sum(r["bytes"] for r in rows)
    kv_raw = sum(r["raw_bytes"] for r in rows)
    out["layers"] = rows
    out["kv_bytes"] = kv_bytes
    out["kv_raw_bytes"] = kv_raw
    out["ratio"] = round(kv_raw / kv_bytes, 3) if kv_bytes else None
    out["verified"] = True
    return out


def summary(info: dict) -> str:
    h = info.get("header", {})
    m, g, s = h.get("model", {}), h.get("guest", {}), h.get("session", {})
    lines = [
        f"checkpoint {info['file']}: {info['bytes']} bytes, {info['frames']} frames, verified",
        f"  format {h.get('format')} (kvferry {h.get('kvferry')}), created {h.get('created_at')} on "
        f"{h.get('created_on')}, mode {h.get('mode')}",
        f"  model  {m.get('name')} fingerprint {str(m.get('fingerprint'))[:16]}… "
        f"weights {m.get('weights') or m.get('dtype')}, KV {m.get('dtype')}",
        f"  guest  {g.get('label')} sha256 {str(g.get('sha256'))[:16]}…",
        f"  session {s.get('id')}: {info.get('tokens')} tokens, {info.get('messages')} messages, "
        f"context {s.get('context')}, cache {h.get('cache', {}).get('class')}",
        f"  KV     {info['kv_raw_bytes']} raw bytes -> {info['kv_bytes']} bytes (ratio {info['ratio']})",
        f"  guest memory {info.get('guest_memory_bytes')} bytes, {info.get('guest_pages_saved')} non-zero pages saved",
        "  layer  frames  tokens      raw bytes   stored bytes",
    ]
    for r in info["layers"]:
        lines.append(f"  {r['layer']:>5} {r['frames']:>7} {r['tokens']:>7} {r['raw_bytes']:>14} {r['bytes']:>14}")
    return "\n".join(lines)
