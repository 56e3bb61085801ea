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
    path = import_gguf(a.file, out, progress=not a.quiet, force=a.force, quantize=a.quantize)
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
        print(f"Ray actor pid {info['pid']}: weights {info['dtype']}, BLAS {info['blas']}, "
              f"conversation driven by the chat.wasm guest\n", flush=True)
        for q in DEMO_TURNS:
            print(f"user> {q}\nassistant> ", end="", flush=True)
            last = {}
            for ref in host.chat.options(num_returns="streaming").remote(q, max_tokens=a.max_tokens):
                last = ray.get(ref)
                print(last["text"], end="", flush=True)
            print(f"\n  [{last.get('generation_tokens', 0)} tokens, "
                  f"{last.get('generation_tps', 0):.1f} tok/s]\n", flush=True)
    finally:
        ray.shutdown()
    return 0


# ----------------------------------------------------------------------------- generate / chat

def _sampling(a):
    from runtime.session import SamplingParams

    return SamplingParams(temperature=a.temp, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                          seed=a.seed, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos)


def _options(a):
    from runtime.session import SessionOptions

    return SessionOptions(ctx=a.ctx, prefill_step=a.prefill_step, kv_bits=a.kv_bits,
                          deadline_ms=a.deadline_ms)


def _host(a):
    from runtime.host import ModelHost

    sampling, options = _sampling(a), _options(a)
    sampling.validate()  # fail fast, before loading anything
    options.validate(1 << 30)
    if a.guest and not os.path.exists(a.guest):
        raise KvferryError(f"guest file {a.guest} does not exist")
    host = ModelHost(a.model, attn_cpu=a.attn_cpu)
    return host, sampling, options


def _stats_line(st) -> str:
    return (f"prompt: {st.prompt_tokens} tokens, {st.prompt_tps:.1f} tokens/s | "
            f"generation: {st.generation_tokens} tokens, {st.generation_tps:.1f} tokens/s | "
            f"finish: {st.finish_reason}")


def cmd_generate(a) -> int:
    from dataclasses import asdict

    host, sampling, options = _host(a)
    if a.resume:
        from checkpoint import snapshot

        expect = host.guest_module(a.guest).sha256 if a.guest else None
        s = snapshot.load(host, a.resume, expect_guest_sha=expect)
        if a.sampling_given:
            s.configure(sampling)
    else:
        s = host.create_session(a.guest, sampling, options)
    if a.system and not a.resume:
        s.messages.append({"role": "system", "content": a.system})
    events = s.complete(a.prompt) if a.raw else s.send(a.prompt)
    for ev in events:
        if not a.json:
            print(ev.text, end="", flush=True)
    st = s.last
    if a.json:
        _print_json({"text": st.text, "tokens": st.tokens, **{k: v for k, v in asdict(st).items()
                     if k not in ("text", "tokens")}, "session": s.describe(),
                     "placement": host.placement})
    else:
        print()
        print(_stats_line(st), file=sys.stderr)
        if host.placement.get("attn_cpu"):
            print(f"placement: {host.placement}", file=sys.stderr)
    if a.save:
        from checkpoint import snapshot

        info = snapshot.save(s, a.save, a.mode)
        print(f"saved {a.save}: {info['bytes']} bytes ({len(s.history)} tokens, KV "
              f"{info['raw_kv_bytes']} raw bytes, mode {a.mode})", file=sys.stderr)
    host.close()
    return 0


def cmd_checkpoint_inspect(a) -> int:
    from checkpoint.inspect import inspect, summary

    info = inspect(a.file, decode=True)
    print(json.dumps(info, indent=2, default=str) if a.json else summary(info))
    return 0


def cmd_checkpoint_verify(a) -> int:
    from checkpoint.errors import CheckpointError
    from checkpoint.inspect import inspect

    try:
        info = inspect(a.file, decode=True)
    except CheckpointError as e:
        print(f"{a.file}: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"{a.file}: ok ({info['frames']} frames, {info['bytes']} bytes, digest {info['digest']})")
    return 0


def cmd_chat(a) -> int:
    host, sampling, options = _host(a)
    s = host.create_session(a.guest, sampling, options)
    if a.system:
        s.messages.append({"role": "system", "content": a.system})
    interactive = sys.stdin.isatty()
    print("kvferry chat: /reset clears the conversation, /stats shows memory, /quit or EOF ends.",
          file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            host.close_session(s.id)
            s = host.create_session(a.guest, sampling, options)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if line == "/stats":
            print(json.dumps(s.describe(), indent=2), file=sys.stderr)
            continue
        for ev in s.send(line):
            print(ev.text, end="", flush=True)
        print()
        print(f"[{_stats_line(s.last)}]", file=sys.stderr, flush=True)
    host.close()
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


def cmd_bench_overhead(a) -> int:
    from runtime.bench.overhead import run

    r = run(a.model, a.tokens, a.rounds)
    if a.json:
        _print_json(r)
    else:
        print(f"decode: runtime {r['decode_tps_runtime']} tok/s, bare mlx-lm {r['decode_tps_bare']} "
              f"tok/s, ratio {r['ratio']}; prefill ratio {r['prefill_ratio']}; "
              f"tokens equal: {r['tokens_equal']}")
    return 0


def cmd_bench_checkpoint(a) -> int:
    from runtime.bench.checkpoint import run

    if a.windows < 1:
        raise KvferryError(f"--windows must be at least 1, not {a.windows}")
    r = run(a.model, tuple(a.contexts), windows=a.windows)
    if a.json:
        _print_json(r)
    else:
        for ctx, row in r["contexts"].items():
            for mode in ("lossless", "int8", "int4"):
                m = row[mode]
                print(f"ctx {ctx:>5} {mode:8} ratio {m['ratio']:6} (own dtype {m['ratio_own_dtype']}) "
                      f"enc {m['encode_mb_s']} MB/s dec {m['decode_mb_s']} MB/s top1 {m['top1_agreement']} "
                      f"(min {m['top1_agreement_min']})"
                      + (f" bit_exact {m['bit_exact']} bf16 ratio {m['lossless_bf16_ratio']}"
                         if mode == "lossless" else ""))
    return 0


def cmd_bench_fuzz(a) -> int:
    from runtime.bench.fuzz import run

    r = run(a.cases, a.seed)
    print(json.dumps(r, indent=2) if a.json else
          f"{r['cases']} mutated checkpoints: {r['rejected']} rejected with one-line errors, "
          f"{r['accepted_unchanged']} unchanged accepted, {r['failures']} failures")
    return 0 if r["failures"] == 0 else 1


def cmd_bench_migrate(a) -> int:
    from runtime.bench.migrate import plot, run

    if a.reps < 1:
        raise KvferryError(f"--reps must be at least 1, not {a.reps}")
    r = run(tuple(a.contexts), a.generate, threads=a.threads or None, pin=a.pin, reps=a.reps,
            progress=(lambda m: print(m, file=sys.stderr)))
    if a.plot:
        plot(r, a.plot)
    if a.json:
        _print_json(r)
    else:
        for row in r["rows"]:
            print(row)
        print(r["targets"])
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


# ----------------------------------------------------------------------------- serve / SDK

DEFAULT_HOST = "127.0.0.1:50051"


def _tls(a, prefix: str = "tls") -> dict | None:
    cert, key, ca = (getattr(a, f"{prefix}_{k}", None) for k in ("cert", "key", "ca"))
    return {"cert": cert, "key": key, "ca": ca} if (cert or ca) else None


def parse_cpus(spec: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; every CPU must exist on this machine."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise KvferryError(f"--cpus '{spec}': expected CPU numbers and ranges like 0-3,6") from None
    have = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if not cpus or not cpus <= have:
        raise KvferryError(f"--cpus '{spec}': this machine offers CPUs {_ranges(sorted(have))}")
    return cpus


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def cmd_serve(a) -> int:
    from runtime.cluster import ensure_token, serve

    bind = f"{a.bind}:{a.port}"
    token = ensure_token(a.token, a.no_auth)
    if a.cpus:
        if not hasattr(os, "sched_setaffinity"):
            raise KvferryError("--cpus needs CPU affinity, which this OS does not offer (Linux only)")
        os.sched_setaffinity(0, parse_cpus(a.cpus))  # inherited by Ray and the host's actor process
    if a.threads is not None:
        if a.threads < 1:
            raise KvferryError(f"--threads must be at least 1, not {a.threads}")
        os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)  # read when the host's BLAS loads
    if a.max_kv_mb is not None and a.max_kv_mb <= 0:
        raise KvferryError(f"--max-kv-mb must be positive, not {a.max_kv_mb}")
    if a.no_auth:
        from runtime.server import is_loopback
        if not is_loopback(a.bind):
            raise KvferryError(f"--no-auth is only allowed on a loopback address, not {a.bind}")

    def ready(addr: str) -> None:
        print(f"kvferry serving on {addr} (model {a.model or 'SmolLM2-135M-Instruct'}, "
              f"auth {'off' if token is None else 'token'}, "
              f"TLS {'mutual' if a.tls_ca and a.tls_cert else 'on' if a.tls_cert else 'off'})", flush=True)

    serve(a.model, bind, token, address=a.address, allow_no_auth=a.no_auth, tls=_tls(a),
          client_tls=_tls(a, "peer_tls"), ready=ready,
          max_kv_bytes=int(a.max_kv_mb * 1e6) if a.max_kv_mb else None)
    return 0


def _client(a):
    from runtime.sdk import Client
    from runtime.server import TLSConfig

    t = _tls(a, "tls")
    return Client(a.host or os.environ.get("KVFERRY_HOST", DEFAULT_HOST), a.token,
                  tls=TLSConfig(**t) if t else None)


def cmd_sessions(a) -> int:
    rows = _client(a).sessions()
    if a.json:
        _print_json(rows)
    else:
        print(f"{'ID':14} {'HOST':22} {'TOKENS':>7} {'KV MB':>7} {'GUEST':12} TURN")
        for r in rows:
            print(f"{r['id']:14} {r['host']:22} {r['tokens']:>7} {r['kv_bytes'] / 1e6:>7.1f} "
                  f"{r['guest']:12} {'yes' if r['in_turn'] else ''}")
    return 0


def cmd_hosts(a) -> int:
    rows = _client(a).hosts()
    if a.json:
        _print_json(rows)
    else:
        print(f"{'ADDRESS':22} {'NODE':16} {'MODEL':26} {'SESSIONS':>8} HEALTHY")
        for r in rows:
            print(f"{r['address']:22} {r['node']:16} {r['model']:26} {r['sessions']:>8} {r['healthy']}")
    return 0


def cmd_migrate(a) -> int:
    from tqdm import tqdm

    c = _client(a)
    s = c.session(a.session)
    bar = tqdm(total=None, unit="B", unit_scale=True, desc=f"migrate {a.session}", disable=a.json,
               leave=False)

    def progress(p):
        bar.total = bar.total or None
        bar.n = p.bytes_sent
        bar.set_postfix_str(f"frames {p.frames_sent}/{p.frames_total}")
        bar.refresh()

    if a.rate < 0:
        raise KvferryError(f"--rate must be positive, not {a.rate}")
    m = s.migrate(a.to, to_token=a.to_token, mode=a.mode, live=not a.stop_copy, rate_mb_s=a.rate,
                  progress=progress)
    bar.close()
    out = {"session": a.session, "target": m.target, "bytes": m.bytes, "seconds": round(m.seconds, 4),
           "raw_kv_bytes": m.raw_kv_bytes, "ratio": round(m.ratio, 3), "tokens": m.tokens,
           "pause_ms": round(m.pause_ms, 2), "live": not a.stop_copy}
    if a.json:
        _print_json(out)
    else:
        print(f"migrated {a.session} to {m.target}: {m.bytes} bytes in {m.seconds * 1000:.1f} ms "
              f"({m.tokens} tokens, KV ratio {m.ratio:.2f})")
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

    def gen_args(sp):
        sp.add_argument("--model", help="model name, directory or .gguf (default: SmolLM2-135M-Instruct)")
        sp.add_argument("--guest", help="chat guest .wasm (default: actor_guests/chat.wasm)")
        sp.add_argument("--max-tokens", type=int, default=256)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
        sp.add_argument("--top-p", type=float, default=1.0)
        sp.add_argument("--top-k", type=int, default=0)
        sp.add_argument("--stop", action="append", help="stop string (repeatable, up to 4)")
        sp.add_argument("--ignore-eos", action="store_true")
        sp.add_argument("--system", help="system message")
        sp.add_argument("--ctx", type=int, help="maximum context in tokens (rotating KV cache)")
        sp.add_argument("--prefill-step", type=int, default=512, help="prompt chunk size (llama.cpp -b)")
        sp.add_argument("--kv-bits", type=int, help="quantize the KV cache (2, 3, 4, 5, 6, 8)")
        sp.add_argument("--attn-cpu", type=float, default=0.0,
                        help="fraction of layers whose attention runs on the CPU stream (GPU machines)")
        sp.add_argument("--deadline-ms", type=float, default=5000.0, help="guest time per step")

    ge = add(sub, "generate", cmd_generate, "stream a reply from a guest-driven session")
    ge.add_argument("--prompt", required=True)
    ge.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    ge.add_argument("--resume", help="continue a saved checkpoint")
    ge.add_argument("--save", help="checkpoint the conversation when it ends")
    ge.add_argument("--mode", default="lossless", choices=["lossless", "raw", "int8", "int4"],
                    help="checkpoint KV codec for --save")
    ge.add_argument("--json", action="store_true")
    gen_args(ge)
    ch = add(sub, "chat", cmd_chat, "interactive multi-turn chat (history stays in the KV cache)")
    gen_args(ch)

    cp = sub.add_parser("checkpoint", help="checkpoint files").add_subparsers(dest="sub", required=True)
    ci = add(cp, "inspect", cmd_checkpoint_inspect, "header, model, tokens, per-layer sizes, ratio")
    ci.add_argument("file")
    ci.add_argument("--json", action="store_true")
    cv = add(cp, "verify", cmd_checkpoint_verify, "exit 0 only if every frame and the trailer check out")
    cv.add_argument("file")

    def tls_args(sp, prefix="tls", what="server"):
        sp.add_argument(f"--{prefix.replace('_', '-')}-cert", dest=f"{prefix}_cert", help=f"{what} certificate (PEM)")
        sp.add_argument(f"--{prefix.replace('_', '-')}-key", dest=f"{prefix}_key", help=f"{what} key (PEM)")
        sp.add_argument(f"--{prefix.replace('_', '-')}-ca", dest=f"{prefix}_ca",
                        help="CA to verify peers (on a server: require client certificates, mutual TLS)")

    sv = add(sub, "serve", cmd_serve, "run a session host on this machine (Ray + gRPC)")
    sv.add_argument("--model")
    sv.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=50051)
    sv.add_argument("--token", help="shared secret (default: $KVFERRY_TOKEN or $KVFERRY_HOME/token)")
    sv.add_argument("--no-auth", action="store_true", help="no token (loopback addresses only)")
    sv.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or an embedded Ray)")
    sv.add_argument("--threads", type=int, help="CPU threads for the model's matrix products (like llama.cpp "
                    "-t; default: all cores). Give each host its share when several share a machine")
    sv.add_argument("--cpus", metavar="LIST", help="run the host on these CPUs only, e.g. 0-3 (like llama.cpp "
                    "--cpu-range; Linux). Hosts sharing a machine then do not slow each other's steps")
    sv.add_argument("--max-kv-mb", type=float, help="KV cache memory this host may hold; restores and "
                    "incoming migrations beyond it are refused (default: no limit)")
    tls_args(sv)
    tls_args(sv, "peer_tls", "client certificate for outgoing migrations:")

    def client_args(sp):
        sp.add_argument("--host", help=f"session host (default: $KVFERRY_HOST or {DEFAULT_HOST})")
        sp.add_argument("--token", help="default: $KVFERRY_TOKEN or $KVFERRY_HOME/token")
        tls_args(sp, "tls", "client")
        sp.add_argument("--json", action="store_true")

    ss = add(sub, "sessions", cmd_sessions, "list the sessions on a host")
    client_args(ss)
    hs = add(sub, "hosts", cmd_hosts, "list the hosts of the cluster")
    client_args(hs)
    mg = add(sub, "migrate", cmd_migrate, "move a session to another host")
    mg.add_argument("session")
    mg.add_argument("--to", required=True, help="target host address")
    mg.add_argument("--to-token", help="the target's token if it differs")
    mg.add_argument("--mode", default="raw", choices=["raw", "lossless", "int8", "int4"],
                    help="how the KV travels: raw (default, fast links), lossless (~1.2x smaller), int8/int4")
    mg.add_argument("--rate", type=float, default=0.0, metavar="MB/S",
                    help="live pre-copy: MB/s of KV at most (default 0: about 3 MB per decode step of "
                         "the session, so generation keeps its pace; 40 MB/s if it is not generating)")
    mode = mg.add_mutually_exclusive_group()
    mode.add_argument("--live", action="store_true", help="pre-copy live migration (the default)")
    mode.add_argument("--stop-copy", action="store_true", help="stop-and-copy")
    client_args(mg)

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
    mi.add_argument("--quantize", type=int, choices=[4, 8],
                    help="re-quantize weights to MLX 4/8-bit, group 64 (for Apple GPUs)")
    mi.add_argument("--quiet", action="store_true", help="no progress bar")
    mi.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="benchmarks (print JSON with --json)").add_subparsers(
        dest="sub", required=True)
    bc = add(b, "cpu", cmd_bench_cpu, "Linux CPU fast path vs the stock mlx-cpu path")
    bc.add_argument("--model")
    bc.add_argument("--prompt-tokens", type=int, default=512)
    bc.add_argument("--decode-tokens", type=int, default=32)
    bc.add_argument("--json", action="store_true")
    bo = add(b, "overhead", cmd_bench_overhead, "guest-driven session vs bare mlx-lm decode speed")
    bo.add_argument("--model")
    bo.add_argument("--tokens", type=int, default=256, help="generated tokens per run")
    bo.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    bo.add_argument("--json", action="store_true")
    bk = add(b, "checkpoint", cmd_bench_checkpoint, "KV codecs: ratio, speed, top-1 agreement")
    bk.add_argument("--model")
    bk.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    bk.add_argument("--windows", type=int, default=8,
                    help="text windows per context for top-1 agreement (mean and min reported)")
    bk.add_argument("--json", action="store_true")
    bf = add(b, "fuzz", cmd_bench_fuzz, "mutate a real checkpoint N times; every case must fail cleanly")
    bf.add_argument("--cases", type=int, default=10000)
    bf.add_argument("--seed", type=int, default=0)
    bf.add_argument("--json", action="store_true")
    bm = add(b, "migrate", cmd_bench_migrate, "live vs stop-and-copy vs re-prefill on two loopback hosts")
    bm.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    bm.add_argument("--generate", type=int, default=400,
                    help="reply limit; each run reads until 16 tokens after the handoff")
    bm.add_argument("--threads", type=int, default=1,
                    help="BLAS threads per host (both share this machine; 0: the BLAS default)")
    bm.add_argument("--pin", action="store_true",
                    help="each host on its own half of the CPUs (serve --cpus), as on two machines "
                         "(default: both share every CPU)")
    bm.add_argument("--reps", type=int, default=5,
                    help="migrations per context and mode; each row is the median one, every rep listed")
    bm.add_argument("--plot", help="write a PNG figure (needs matplotlib)")
    bm.add_argument("--json", action="store_true")
    bz = add(b, "zero-copy", cmd_bench_zero_copy,
             "guest memory exposed to MLX in place vs copied (the seed's table)")
    bz.add_argument("--n", type=int, default=128, help="GEMM size (n x n)")
    bz.add_argument("--reps", type=int, default=100, help="GEMM repetitions per path (median)")
    bz.add_argument("--json", action="store_true")

    g = sub.add_parser("guest", help="Wasm guests").add_subparsers(dest="sub", required=True)
    gc = add(g, "check", cmd_guest_check, "say in one line whether a .wasm fits the kvferry ABI")
    gc.add_argument("file")
    return p


_SAMPLING_FLAGS = ("--temp", "--top-p", "--top-k", "--seed", "--max-tokens", "--stop", "--ignore-eos")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.sampling_given = any(a.split("=")[0] in _SAMPLING_FLAGS for a in argv)
    try:
        return args.fn(args) or 0
    except KvferryError as e:
        print(f"kvferry: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvferry … | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
