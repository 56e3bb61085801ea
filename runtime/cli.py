"""The ``kvferry`` command line. Each command group declares its own flags: the
local ones here, serving and the remote commands in :mod:`kvferry.cli_remote`,
benchmarks in :mod:`kvferry.bench.cli`. Nothing heavy loads until a command runs
(the BLAS choice happens where a model is loaded)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any, Callable

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from . import __version__  # noqa: E402
from .errors import KvferryError  # noqa: E402
from .console import print_json  # noqa: E402
from .params import OPTIONS, SAMPLING  # noqa: E402


# ----------------------------------------------------------------------------- models

def cmd_models_list(a) -> int:
    from .models import installed, store

    rows = installed()
    if a.json:
        print_json(rows)
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

    from .convert import import_gguf
    from .models import store

    out = Path(a.out) if a.out else store() / Path(a.file).stem
    path = import_gguf(a.file, out, progress=not a.quiet, force=a.force, quantize=a.quantize)
    if a.json:
        print_json({"model": str(path)})
    else:
        print(f"imported {a.file} -> {path}")
    return 0


# ----------------------------------------------------------------------------- demo

DEMO_TURNS = ["What is the capital of France?", "And the capital of Italy?"]


def cmd_demo(a) -> int:
    from . import __version__, blas
    from .models import resolve

    print(f"kvferry {__version__}: BLAS {blas.enable()['kind']}", flush=True)
    path = resolve(a.model)  # imports the bundled model on first run (progress bar)
    print(f"model: {path.name} ({path})", flush=True)
    import ray

    from .cluster import DemoHost, init_ray

    init_ray(a.address)
    try:
        host = DemoHost.remote(str(path))
        info = ray.get(host.info.remote())
        print(f"Ray actor pid {info['pid']}: on {info['device']['backend']}, weights {info['weights']}, "
              f"KV {info['dtype']}, BLAS {info['blas']}, "
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
    from .params import SamplingParams

    return SamplingParams(temperature=a.temp, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                          seed=a.seed, stop=tuple(a.stop or ()), ignore_eos=a.ignore_eos)


def _options(a):
    from .params import SessionOptions

    return SessionOptions(ctx=a.ctx, prefill_step=a.prefill_step, kv_bits=a.kv_bits,
                          deadline_ms=a.deadline_ms)


def _host(a):
    from .host import ModelHost

    sampling, options = _sampling(a), _options(a)
    sampling.validate()  # fail fast, before loading anything
    options.validate(1 << 30)
    if a.guest and not os.path.exists(a.guest):
        raise KvferryError(f"guest file {a.guest} does not exist")
    host = ModelHost(a.model, dtype=a.dtype, attn_cpu=a.attn_cpu)
    return host, sampling, options


def _stats_line(st) -> str:
    return (f"prompt: {st.prompt_tokens} tokens, {st.prompt_tps:.1f} tokens/s | "
            f"generation: {st.generation_tokens} tokens, {st.generation_tps:.1f} tokens/s | "
            f"finish: {st.finish_reason}")


def cmd_generate(a) -> int:
    from dataclasses import asdict

    if a.save:  # before the reply is generated, which a path that cannot be written would lose
        where = os.path.dirname(os.path.abspath(a.save))
        if os.path.isdir(a.save) or not os.path.isdir(where) or not os.access(where, os.W_OK):
            raise KvferryError(f"--save {a.save}: not a file that can be written "
                               f"({'a directory' if os.path.isdir(a.save) else f'no writable directory {where}'})")
    host, sampling, options = _host(a)
    if a.resume:
        expect = host.guest_module(a.guest).sha256 if a.guest else None
        s = host.load(a.resume, expect_guest_sha=expect)
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
        import mlx.core as mx

        print_json({"text": st.text, "tokens": st.tokens, **{k: v for k, v in asdict(st).items()
                     if k not in ("text", "tokens")}, "session": s.describe(),
                     "placement": host.placement, "device": host.device.as_dict(), "dtype": host.lm.dtype,
                     "weights": host.lm.weights, "peak_memory_mb": round(mx.get_peak_memory() / 1e6, 1)})
    else:
        print()
        print(_stats_line(st), file=sys.stderr)
        if host.placement.get("attn_cpu"):
            print(f"placement: {host.placement}", file=sys.stderr)
    if a.save:
        from .checkpoint.snapshot import save

        info = save(s, a.save, a.mode)
        print(f"saved {a.save}: {info['bytes']} bytes ({len(s.history)} tokens, KV "
              f"{info['raw_kv_bytes']} raw bytes, mode {a.mode})", file=sys.stderr)
    host.close()
    return 0


def cmd_checkpoint_inspect(a) -> int:
    from .checkpoint.inspect import inspect, summary

    info = inspect(a.file, decode=True)
    print(json.dumps(info, indent=2, default=str) if a.json else summary(info))
    return 0


def cmd_checkpoint_verify(a) -> int:
    from .errors import CheckpointError
    from .checkpoint.inspect import inspect

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


# ----------------------------------------------------------------------------- guests

def cmd_guest_check(a) -> int:
    from .abi import ABI_VERSION, V1
    from .errors import GuestError, GuestTrap
    from .guest import GuestEngine

    engine = GuestEngine(V1)
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



def gen_args(sp) -> None:
    sp.add_argument("--model", help="model name, directory or .gguf (default: SmolLM2-135M-Instruct)")
    sp.add_argument("--guest", help="chat guest .wasm (default: the bundled chat.wasm)")
    sp.add_argument("--max-tokens", type=int, default=SAMPLING.max_tokens)
    sp.add_argument("--seed", type=int, default=SAMPLING.seed)
    sp.add_argument("--temp", "--temperature", type=float, default=SAMPLING.temperature,
                    help="temperature; 0 = greedy")
    sp.add_argument("--top-p", type=float, default=SAMPLING.top_p)
    sp.add_argument("--top-k", type=int, default=SAMPLING.top_k)
    sp.add_argument("--stop", action="append", help="stop string (repeatable, up to 4)")
    sp.add_argument("--ignore-eos", action="store_true")
    sp.add_argument("--system", help="system message")
    sp.add_argument("--ctx", type=int, help="maximum context in tokens (rotating KV cache)")
    sp.add_argument("--prefill-step", type=int, default=OPTIONS.prefill_step, help="prompt chunk size (llama.cpp -b)")
    from .cli_remote import dtype_arg

    dtype_arg(sp)
    sp.add_argument("--kv-bits", type=int, help="quantize the KV cache (2, 3, 4, 5, 6, 8)")
    sp.add_argument("--attn-cpu", type=float, default=0.0,
                    help="fraction of layers whose attention runs on the CPU stream (GPU machines)")
    sp.add_argument("--deadline-ms", type=float, default=OPTIONS.deadline_ms, help="guest time per step")


def _register_local(sub, add: Callable) -> None:
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

    g = sub.add_parser("guest", help="Wasm guests").add_subparsers(dest="sub", required=True)
    gc = add(g, "check", cmd_guest_check, "say in one line whether a .wasm fits the kvferry ABI")
    gc.add_argument("file")


class _Parser(argparse.ArgumentParser):
    """Flags spelled out in full, in every subcommand (its parsers are of this class):
    argparse's prefixes made ``kvferry drain --to HOST`` mean ``--token HOST``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from . import cli_remote
    from .bench import cli as bench_cli

    p = _Parser(prog="kvferry", description="Movable LLM conversations on MLX.")
    p.add_argument("--version", action="version", version=f"kvferry {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(parent, name: str, fn: Callable, help: str):
        sp = parent.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    _register_local(sub, add)
    cli_remote.register(sub, add)
    bench_cli.register(sub, add)
    return p


_SAMPLING_FLAGS = ("--temp", "--temperature", "--top-p", "--top-k", "--seed", "--max-tokens", "--stop", "--ignore-eos")


class _Stop:
    """One SIGTERM stops a bench once. ``caught`` turns true when main() has caught the
    KeyboardInterrupt it raised: a SIGTERM after that (another one, or one re-sent by
    _interrupt_again below) is let go. Raised there, between main()'s return and the
    process's exit, it would escape main() and Python would die of SIGINT (exit -2, a
    CI run) instead of exiting 130 with its hosts stopped."""
    caught = False


def _interrupt(signum, frame) -> None:
    if not _Stop.caught:
        raise KeyboardInterrupt


def _send_again() -> None:
    if not _Stop.caught:
        os.kill(os.getpid(), signal.SIGTERM)


def _interrupt_again(unraisable, default=sys.unraisablehook) -> None:
    """Python drops what a gc callback or a ``__del__`` raises. A SIGTERM (or Ctrl-C) whose
    KeyboardInterrupt landed in one (kvferry.collector's, in a CI run) would leave a bench
    running to its end: a SIGTERM is sent again, to land in the bench's own code (its handler,
    installed with this hook, raises the same KeyboardInterrupt as Ctrl-C), unless the bench
    has stopped by then."""
    if unraisable.exc_type is KeyboardInterrupt:
        threading.Timer(0.05, _send_again).start()
    else:
        default(unraisable)


def stop_on_sigterm() -> None:
    """SIGTERM (`timeout`, a job runner) unwinds this process as Ctrl-C does, whatever it was running."""
    _Stop.caught = False  # (main() may run again in one process: a test's)
    signal.signal(signal.SIGTERM, _interrupt)
    sys.unraisablehook = _interrupt_again


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.sampling_given = any(a.split("=")[0] in _SAMPLING_FLAGS for a in argv)
    if args.cmd == "bench" and threading.current_thread() is threading.main_thread():
        # stopped by SIGTERM (`timeout`, a job runner), a bench unwinds as on Ctrl-C, so the hosts
        # it started are stopped too: Python's default would exit with them still serving
        stop_on_sigterm()
    try:
        return args.fn(args) or 0
    except KvferryError as e:
        print(f"kvferry: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _Stop.caught = True
        return 130
    except BrokenPipeError:  # `kvferry … | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
