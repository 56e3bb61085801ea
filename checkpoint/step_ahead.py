"""The step a speculating source already ran for a reply's next token, carried by a
checkpoint's state frame (its ``ahead``) so the target's first step need not run it.

A host that speculates (kvferry.speculation) has run the forward pass of the
reply's next token before the guest confirms it. When the session is paused there,
:func:`read` takes that step's pieces (the token's K/V one past each cache's
offset, the guessed token, its logits) to ride with the last KV delta's one host
read, :func:`frame` writes them into the state frame if the guest's token was the
guess, and :func:`land` writes them into the target's caches (input treated as
hostile: a malformed ``ahead`` is a one-line :class:`CheckpointError`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import numpy as np

from . import codecs
from .errors import CheckpointError
from .mlxbits import cast_bits, joined, mx_bits_lazy, mx_from_bits, oom, split_joined

MAX_LOGITS = 1 << 22  # a step's logits a checkpoint may carry: a vocabulary this wide at most


def read(session: Any, st: Any, caches: list, lock: Any, shared: bool) -> tuple[int, list] | None:
    """The step ``session``'s host already ran for its turn's next token, where a
    speculated step is held for it: that token and, not yet read, its K/V (layer by
    layer), the guessed token and its logits, as lazy bits. ``caches`` are plain
    KVCaches (``shared``: rows of a buffer other steps rewrite, read under ``lock``).
    They ride with the last delta's read (Snapshotter's ``extra``): on MLX CUDA each
    host read waits for the device and frees what it moved, and a read of their own
    cost the pause ~12 ms on an H200. None where there is no such step."""
    import mlx.core as mx

    if os.environ.get("KVFERRY_STEP_AHEAD") == "0":  # (an A/B of it: the target then runs that step)
        return None
    held = getattr(getattr(getattr(session, "host", None), "steps", None), "held_guess", None)
    if held is None or lock is None or st.turn is None or not st.turn["tokens"]:
        return None
    token, n = st.turn["tokens"][-1], len(st.history)
    # shared buffers only under the lock (other rows' steps rewrite them); a session's own
    # caches are still while it is paused, and its guess stays until it comes back
    with lock if shared else contextlib.nullcontext():
        guess = held(session)
        if guess is None or any(c.offset != n or c.keys is None or c.keys.shape[2] <= n for c in caches):
            return None
        parts = [mx_bits_lazy(x[..., n:n + 1, :]) for c in caches for x in (c.keys, c.values)]
        parts += [mx_bits_lazy(guess[0]), mx_bits_lazy(guess[1])]  # whether it is the token's, read with it
        mx.async_eval([u for u, _ in parts])
    return token, parts


def frame(token: int, parts: list, mode: str) -> dict | None:
    """The state frame's ``ahead`` from :func:`read`'s parts (read on the host already
    if they went with the last delta), or None if the guess was another token."""
    arrays, names = [u for u, _ in parts], [name for _, name in parts]
    if not isinstance(arrays[0], np.ndarray):  # no delta read on a device to ride with
        arrays = split_joined(np.array(joined(arrays)), arrays)
    if int(np.asarray(arrays[-2]).reshape(-1)[0]) != token:  # (a one-element array)
        return None  # the guest chose another token than the guess: the target runs that step
    mode = "raw" if mode == "raw" else "lossless"  # exact, whatever the KV's codec
    blobs = [codecs.encode(np.ascontiguousarray(u), name, mode)
             for u, name in zip(arrays[:-2] + arrays[-1:], names[:-2] + names[-1:])]
    return {"token": int(token), "keys": blobs[0:-1:2], "values": blobs[1:-1:2], "logits": blobs[-1]}


def land(a: Any, caches: list, n: int, turn: dict | None, kv_dtype: str, lock: Any,
         declared: Callable[[Any, str, int], int]) -> tuple[int, Any] | None:
    """Write a state frame's ``ahead`` one past each of ``caches``' offset ``n``;
    returns (token, logits) for the session's first step, or None where there is none
    or no room for it (the step then runs here). ``declared`` checks a K/V blob's
    shape against the model before it is decoded (Restorer._declared)."""
    import mlx.core as mx

    if a is None:
        return None
    where = "state frame: ahead"
    logits = a.get("logits") if isinstance(a, dict) else None
    shape = logits.get("shape") if isinstance(logits, dict) else None  # one row: the model's output width
    if not (isinstance(a, dict) and isinstance(a.get("token"), int) and turn is not None and turn["tokens"]
            and a["token"] == turn["tokens"][-1] and isinstance(a.get("keys"), list)
            and isinstance(a.get("values"), list) and len(a["keys"]) == len(a["values"]) == len(caches)
            and isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)
            and 0 < shape[0] <= MAX_LOGITS and logits.get("dtype") == "float32"):
        raise CheckpointError(f"{where}: malformed (not the turn's next token, or not one step of this model)")
    if any(c.offset != n or c.keys is None or c.keys.shape[2] <= n for c in caches):
        return None
    sides = []
    for i in range(len(caches)):
        for side in ("keys", "values"):
            declared(a[side][i], f"{where} {side}[{i}]", 1)  # checked before it is decoded
            u, dtype = cast_bits(codecs.decode(a[side][i], f"{where} {side}[{i}]"), a[side][i]["dtype"],
                                 kv_dtype, f"{where} {side}[{i}]")
            sides.append(mx_from_bits(u, dtype))
    with oom(where), lock:
        for j, c in enumerate(caches):
            c.keys[..., n:n + 1, :] = sides[2 * j]
            c.values[..., n:n + 1, :] = sides[2 * j + 1]
        out = mx_from_bits(codecs.decode(logits, f"{where} logits"), "float32")
        mx.eval(out, [x for c in caches for x in (c.keys, c.values)])
    return a["token"], out
