"""``kvferry bench cpu``: the Linux CPU fast path against the stock path.

fast  = weights dequantized to float32 + optimized BLAS (kvferry's default)
stock = weights as imported (Q4) + the wheel's reference BLAS (what plain
        ``mlx_lm.load`` gives on the stock ``mlx-cpu`` wheel)

BLAS binding is per process, so each path runs in its own subprocess, one
after the other in the same invocation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _worker(kind: str, model: str | None, prompt_tokens: int, decode_tokens: int) -> dict:
    from .. import blas

    blas.enable()  # the choice comes from the environment (KVFERRY_BLAS)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..models import load

    lm = load(model, dtype="float32" if kind == "fast" else "native", progress=False)
    text = open(__file__).read() * 4
    ids = lm.tokenizer.encode(text)[:prompt_tokens]
    if len(ids) < prompt_tokens:
        raise SystemExit("bench text too short")
    prompt = mx.array(ids)[None]

    def prefill() -> tuple[float, list]:
        cache = make_prompt_cache(lm.model)
        t = time.perf_counter()
        logits = lm.model(prompt, cache=cache)
        mx.eval(logits, [c.state for c in cache])
        return time.perf_counter() - t, cache, logits

    prefill_warm = lm.model(prompt[:, :16], cache=make_prompt_cache(lm.model))  # warm-up
    mx.eval(prefill_warm)
    runs = 3 if kind == "fast" else 1
    best = min(prefill()[0] for _ in range(runs))
    _, cache, logits = prefill()
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tok)
    t = time.perf_counter()
    for _ in range(decode_tokens):
        logits = lm.model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(tok)
    dt = time.perf_counter() - t
    return {"path": kind, "blas": blas.status()["kind"], "dtype": lm.dtype,
            "prefill_tps": prompt_tokens / best, "decode_ms_per_token": 1000 * dt / decode_tokens}


def run(model: str | None = None, prompt_tokens: int = 512, decode_tokens: int = 32) -> dict:
    from ..models import resolve

    resolve(model)  # import once, before the timed subprocesses
    results = {}
    for kind in ("fast", "stock"):
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        env["KVFERRY_BLAS"] = "auto" if kind == "fast" else "reference"
        cmd = [sys.executable, "-m", "kvferry.bench.cpu", "--worker", kind,
               "--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens)]
        if model:
            cmd += ["--model", str(model)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"bench worker '{kind}' failed: {out.stderr.strip().splitlines()[-1:]}")
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    f, s = results["fast"], results["stock"]
    return {
        "model": model or "SmolLM2-135M-Instruct",
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "prefill_tps_fast": round(f["prefill_tps"], 2),
        "prefill_tps_stock": round(s["prefill_tps"], 2),
        "prefill_speedup": round(f["prefill_tps"] / s["prefill_tps"], 2),
        "decode_ms_per_token_fast": round(f["decode_ms_per_token"], 2),
        "decode_ms_per_token_stock": round(s["decode_ms_per_token"], 2),
        "decode_speedup": round(s["decode_ms_per_token"] / f["decode_ms_per_token"], 2),
        "fast": {"blas": f["blas"], "dtype": f["dtype"]},
        "stock": {"blas": s["blas"], "dtype": s["dtype"]},
    }


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["fast", "stock"], required=True)
    ap.add_argument("--model")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    a = ap.parse_args()
    print(json.dumps(_worker(a.worker, a.model, a.prompt_tokens, a.decode_tokens)))
