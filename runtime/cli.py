"""The ``kvferry`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import runtime  # noqa: E402  (optimized BLAS before MLX)
from runtime.errors import KvferryError  # noqa: E402


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


# ----------------------------------------------------------------------------- models

def cmd_models_list(a) -> int:
    from runtime.models import installed, store

    rows = installed()
    if a.json:
        _print_json(rows)
        return 0
    if not rows:
        print(f"no models in {store()}")
        return 0
    print(f"{'NAME':32} {'ARCH':6} {'LAYERS':>6} {'CTX':>6} {'WEIGHTS':10} {'SIZE MB':>8}")
    for r in rows:
        print(f"{r['name']:32} {r['architecture'] or '-':6} {r['layers'] or '-':>6} "
              f"{r['context'] or '-':>6} {r['weights']:10} {r['size_mb'] or '-':>8}")
    return 0


def cmd_models_import(a) -> int:
    from pathlib import Path

    from runtime.convert import import_gguf
    from runtime.models import store

    out = Path(a.out) if a.out else store() / Path(a.file).stem
    path = import_gguf(a.file, out, progress=not a.quiet, force=a.force)
    if a.json:
        _print_json({"model": str(path)})
    else:
        print(f"imported {a.file} -> {path}")
    return 0


# ----------------------------------------------------------------------------- demo

DEMO_TURNS = ["What is the capital of France?", "And the capital of Italy?"]


def cmd_demo(a) -> int:
    from runtime import blas
    from runtime.models import resolve

    print(f"kvferry {runtime.__version__}: BLAS {blas.status()['kind']}", flush=True)
    path = resolve(a.model)  # imports the bundled model on first run (progress bar)
    print(f"model: {path.name} ({path})", flush=True)
    import ray

    from runtime.ray_host import init_local, model_host

    init_local(a.address)
    try:
        host = model_host(str(path))
        info = ray.get(host.info.remote())
        print(f"Ray actor pid {info['pid']}: weights {info['dtype']}, BLAS {info['blas']}\n",
              flush=True)
        messages: list[dict] = []
        for q in DEMO_TURNS:
            messages.append({"role": "user", "content": q})
            print(f"user> {q}\nassistant> ", end="", flush=True)
            reply, last = "", {}
            for ref in host.chat.options(num_returns="streaming").remote(
                    messages, max_tokens=a.max_tokens):
                last = ray.get(ref)
                reply += last["text"]
                print(last["text"], end="", flush=True)
            messages.append({"role": "assistant", "content": reply})
            print(f"\n  [{last.get('generation_tokens', 0)} tokens, "
                  f"{last.get('generation_tps', 0):.1f} tok/s]\n", flush=True)
    finally:
        ray.shutdown()
    return 0


# ----------------------------------------------------------------------------- bench

def cmd_bench_cpu(a) -> int:
    from runtime.bench.cpu import run

    r = run(a.model, a.prompt_tokens, a.decode_tokens)
    if a.json:
        _print_json(r)
    else:
        print(f"prefill ({r['prompt_tokens']} tokens): fast {r['prefill_tps_fast']} tok/s, "
              f"stock {r['prefill_tps_stock']} tok/s, speedup {r['prefill_speedup']}x")
        print(f"decode: fast {r['decode_ms_per_token_fast']} ms/token, "
              f"stock {r['decode_ms_per_token_stock']} ms/token")
    return 0


def cmd_bench_zero_copy(a) -> int:
    from runtime.bench.zero_copy import run, table

    r = run(a.n, a.reps)
    print(json.dumps(r, indent=2) if a.json else table(r))
    return 0


# ----------------------------------------------------------------------------- guests

def cmd_guest_check(a) -> int:
    from runtime.abi import ABI_VERSION
    from runtime.guest import GuestEngine, GuestError, GuestTrap

    engine = GuestEngine()
    try:
        gm = engine.compile(a.file)
        engine.instantiate(gm).close()  # runs kvferry_abi_version()
    except (GuestError, GuestTrap) as e:
        print(f"{e}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    extra = [n for n in gm.exports if n not in ("memory", "kvferry_abi_version")]
    print(f"{gm.label}: ok: kvferry ABI v{ABI_VERSION}, {gm.kind} guest "
          f"(exports {', '.join(extra) or 'nothing else'})")
    return 0


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvferry", description="Movable LLM conversations on MLX.")
    p.add_argument("--version", action="version", version=f"kvferry {runtime.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(parent, name: str, fn: Callable, help: str):
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    d = add(sub, "demo", cmd_demo, "hold a short conversation on a local Ray (embedded defaults)")
    d.add_argument("--model", help="model name, directory or .gguf (default: SmolLM2-135M-Instruct)")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--address", help="Ray address (default: $RAY_ADDRESS or a local in-process Ray)")

    m = sub.add_parser("models", help="install and list models").add_subparsers(dest="sub", required=True)
    ml = add(m, "list", cmd_models_list, "list installed models")
    ml.add_argument("--json", action="store_true")
    mi = add(m, "import-gguf", cmd_models_import, "convert a llama GGUF into an MLX model directory")
    mi.add_argument("file")
    mi.add_argument("--out", help="output directory (default: the model store)")
    mi.add_argument("--force", action="store_true", help="re-import even if cached")
    mi.add_argument("--quiet", action="store_true", help="no progress bar")
    mi.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="benchmarks (print JSON with --json)").add_subparsers(
        dest="sub", required=True)
    bc = add(b, "cpu", cmd_bench_cpu, "Linux CPU fast path vs the stock mlx-cpu path")
    bc.add_argument("--model")
    bc.add_argument("--prompt-tokens", type=int, default=512)
    bc.add_argument("--decode-tokens", type=int, default=32)
    bc.add_argument("--json", action="store_true")
    bz = add(b, "zero-copy", cmd_bench_zero_copy,
             "guest memory exposed to MLX in place vs copied (the seed's table)")
    bz.add_argument("--n", type=int, default=128, help="GEMM size (n x n)")
    bz.add_argument("--reps", type=int, default=100, help="GEMM repetitions per path (median)")
    bz.add_argument("--json", action="store_true")

    g = sub.add_parser("guest", help="Wasm guests").add_subparsers(dest="sub", required=True)
    gc = add(g, "check", cmd_guest_check, "say in one line whether a .wasm fits the kvferry ABI")
    gc.add_argument("file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except KvferryError as e:
        print(f"kvferry: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
