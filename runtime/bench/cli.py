"""``kvferry bench …``: each benchmark prints JSON with ``--json``; none is a test."""

from __future__ import annotations

import json
import sys
from typing import Callable

from ..console import print_json
from ..errors import KvferryError
from ..policy import BATCH_KV, GUEST_THREAD, PREFILL_THREAD, SPECULATE, HostPolicy
from .shape import SHAPES


def cmd_bench_cpu(a) -> int:
    from .cpu import run

    r = run(a.model, a.prompt_tokens, a.decode_tokens)
    if a.json:
        print_json(r)
    else:
        print(f"prefill ({r['prompt_tokens']} tokens): fast {r['prefill_tps_fast']} tok/s, "
              f"stock {r['prefill_tps_stock']} tok/s, speedup {r['prefill_speedup']}x")
        print(f"decode: fast {r['decode_ms_per_token_fast']} ms/token, "
              f"stock {r['decode_ms_per_token_stock']} ms/token")
    return 0


def cmd_bench_overhead(a) -> int:
    from .overhead import run

    if a.tokens < 1 or a.rounds < 1:
        raise KvferryError(f"--tokens and --rounds must be at least 1, not {a.tokens} / {a.rounds}")
    r = run(a.model, a.tokens, a.rounds, speculate=SPECULATE[a.speculate])
    if a.json:
        print_json(r)
    else:
        print(f"decode: runtime {r['decode_tps_runtime']} tok/s, bare mlx-lm {r['decode_tps_bare']} "
              f"tok/s, ratio {r['ratio']} (paired rounds {r['ratio_paired']}); prefill ratio {r['prefill_ratio']}; "
              f"tokens equal: {r['tokens_equal']}")
    return 0


def cmd_bench_checkpoint(a) -> int:
    from .checkpoint import run

    if a.windows < 1 or min(a.contexts) < 8:
        raise KvferryError(f"--windows must be at least 1 and --contexts at least 8 tokens each, "
                           f"not {a.windows} / {' '.join(map(str, a.contexts))}")
    r = run(a.model, tuple(a.contexts), windows=a.windows)
    if a.json:
        print_json(r)
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
    from .fuzz import run

    r = run(a.cases, a.seed)
    print(json.dumps(r, indent=2) if a.json else
          f"{r['cases']} mutated checkpoints: {r['rejected']} rejected with one-line errors, "
          f"{r['accepted_unchanged']} unchanged accepted, {r['failures']} failures")
    return 0 if r["failures"] == 0 else 1


def cmd_bench_migrate(a) -> int:
    from .migrate import plot, run, table

    if a.reps < 1:
        raise KvferryError(f"--reps must be at least 1, not {a.reps}")
    if min(a.contexts) < 16 or a.generate < 32:
        raise KvferryError(f"--contexts takes token counts of at least 16 and --generate at least 32, "
                           f"not {' '.join(map(str, a.contexts))} / {a.generate}")
    if a.rate < 0:
        raise KvferryError(f"--rate must be positive, not {a.rate}")
    r = run(tuple(a.contexts), a.generate, threads=a.threads or None, pin=a.pin, reps=a.reps,
            progress=(lambda m: print(m, file=sys.stderr)), transfer_only=a.transfer_only, model=a.model,
            modes=tuple(dict.fromkeys(a.modes)), rate_mb_s=a.rate, lane=not a.no_lane)
    if a.plot and r["rows"]:
        plot(r, a.plot)
    if a.json:
        print_json(r)
    else:
        print(table(r))
    return 0


def cmd_bench_shape(a) -> int:
    from .shape import build

    r = build(a.shape, a.name, force=a.force)
    if a.json:
        print_json(r)
    else:
        print(f"{'built' if r['built'] else 'already here'}: {r['name']} ({r['parameters'] / 1e9:.2f} B parameters) "
              f"at {r['path']}; use it with --model {r['name']}")
    return 0


def cmd_bench_zero_copy(a) -> int:
    from .zero_copy import run, table

    if not 1 <= a.n <= 256 or a.reps < 1:  # the gemm guest holds matrices of up to 256 x 256
        raise KvferryError(f"--n must be in 1..256 and --reps at least 1, not {a.n} / {a.reps}")
    r = run(a.n, a.reps)
    print(json.dumps(r, indent=2) if a.json else table(r))
    return 0


def cmd_bench_link(a) -> int:
    from .link import LINKS, run

    bad = [x for x in a.links if x != "veth" and not x[:-4].replace(".", "").isdigit()]
    if bad or a.reps < 1 or a.tokens < 16:
        raise KvferryError(f"--links takes RATE[k|m|g]bit or veth (got {' '.join(bad)}); --reps >= 1; --tokens >= 16"
                           if bad else f"--reps must be >= 1 and --tokens >= 16, not {a.reps} / {a.tokens}")
    r = run(a.tokens, tuple(a.links or LINKS), allow_lossy=a.allow_lossy, reps=a.reps,
            progress=(lambda m: print(m, file=sys.stderr)))
    if a.json:
        print_json(r)
    else:
        for t in r["links"]:
            print(t)
    return 0


def cmd_bench_chaos(a) -> int:
    from .chaos import run

    r = run(a.duration, a.clients, a.seed, progress=(lambda m: print(m, file=sys.stderr)))
    if a.json:
        print_json(r)
    else:
        for k, v in r.items():
            print(f"{k:28} {v}")
    ok = r["sessions_lost"] == 0 and r["sessions_duplicated"] == 0 and r["tokens_duplicated"] == 0 \
        and r["tokens_lost"] == 0
    return 0 if ok else 1


def cmd_bench_step(a) -> int:
    from .step import run

    if not a.rows or min(a.rows) < 1 or a.context < 1 or a.steps < 1 or a.warmup < 0:
        raise KvferryError("--rows takes counts >= 1; --context and --steps at least 1, --warmup at least 0")
    r = run(a.model, tuple(a.rows), a.context, a.steps, a.warmup, progress=(lambda m: print(m, file=sys.stderr)))
    if a.json:
        print_json(r)
    else:
        print(f"{'rows':>5} {'shared ms':>10} {'per-session ms':>15} {'mlx-lm ms':>10} {'shared/mlx-lm':>14}")
        for p in r["points"]:
            print(f"{p['rows']:>5} {p['shared_ms']:>10} {p['per_session_ms']:>15} {p['mlx_lm_ms']:>10} "
                  f"{p['shared_over_mlx_lm']:>14}")
        print("\npipelined (the next step queued before this one is waited for), ms a step:")
        print(f"{'rows':>5} {'layout':>7} {'build':>7} {'submit':>7} {'wait':>7} {'step':>7}")
        for p in r["points"]:
            for name in ("shared", "mlx_lm"):
                q = p[f"{name}_pipelined"]
                print(f"{p['rows']:>5} {name.replace('_', '-'):>7} {q['build_ms']:>7} {q['submit_ms']:>7} "
                      f"{q['wait_ms']:>7} {q['step_ms']:>7}")
    return 0


def cmd_bench_serve(a) -> int:
    from .serve import plot, run

    if a.sessions is None:  # the defaults: a GPU batches far more
        from ..device import current

        a.sessions = [1, 8, 32, 64] if current().is_gpu else [1, 4, 8]
    if not a.sessions or min(a.sessions) < 1 or a.tokens < 2:
        raise KvferryError("--sessions takes counts >= 1 and --tokens at least 2")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise KvferryError("--plot needs matplotlib: pip install 'kvferry[bench]'") from None
    if a.ttft_samples < 1:
        raise KvferryError("--ttft-samples must be at least 1")
    if a.long_prompt < 0:
        raise KvferryError(f"--long-prompt takes a token count (0: no long-prompt point), not {a.long_prompt}")
    HostPolicy(stream_interval=a.stream_interval, max_batch=a.max_batch)  # the served host's own checks, up front
    if a.prefix_cache_mb is not None and a.prefix_cache_mb < 0:
        raise KvferryError(f"--prefix-cache-mb must be >= 0, not {a.prefix_cache_mb:g}")
    r = run(a.model, tuple(a.sessions), a.tokens, a.long_prompt, progress=(lambda m: print(m, file=sys.stderr)),
            http=a.http, ttft_samples=a.ttft_samples, batch_kv=a.batch_kv, guest_thread=a.guest_thread,
            prefix_cache_mb=a.prefix_cache_mb, prefill_thread=a.prefill_thread, speculate=a.speculate,
            stream_interval=a.stream_interval, max_batch=a.max_batch, trace_steps=a.trace_steps)
    if a.plot:
        plot(r, a.plot)
    if a.json:
        print_json(r)
    else:
        print(f"{'sessions':>8} {'agg tok/s':>10} {'mlx-lm':>8} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} "
              f"{'tpot p99':>9}")
        for p in r["points"]:
            print(f"{p['sessions']:>8} {p['aggregate_tps']:>10} {p['mlx_lm_tps']:>8} {p['ttft_ms_p50']:>9} "
                  f"{p['ttft_ms_p99']:>9} {p['tpot_ms_p50']:>9} {p['tpot_ms_p99']:>9}")
        for p in r["points"]:
            if (st := p.get("steps")) and st["full_steps"]:
                print(f"{p['sessions']:>8} session{'s' if p['sessions'] > 1 else ''}: a full step every "
                      f"{st['period_ms_p50']} ms (forward pass {st['forward_ms_p50']}, guests {st['guests_ms_p50']}, "
                      f"between steps {st['between_ms_p50']}; "
                      f"{st['full_steps']} steps, {st['guessed_share']:.1%} of rows took their guess)")
        if (lp := r["long_prompt"]) is not None:
            print(f"TPOT p99 while a {lp['prompt_tokens']}-token prompt is prefilled: {lp['tpot_ms_p99_during']} ms "
                  f"({lp['ratio_p99_during_over_p50_without']}x the p50 without it)")
        if (hv := r.get("http_vs_grpc")) is not None:
            print(f"HTTP vs gRPC: TTFT p50 {hv['ttft_ms_http_p50']} vs {hv['ttft_ms_grpc_p50']} ms "
                  f"({hv['ttft_http_minus_grpc_ms']:+} ms); {hv['streams']} streams {hv['tps_http']} vs "
                  f"{hv['tps_grpc']} tok/s ({hv['tps_http_over_grpc']}x)")
        c = r["consistency"]
        print(f"batched vs solo, {c['prompts']} prompts x {c['tokens']} tokens: greedy replies equal "
              f"{c['greedy_equal_solo']:.0%}, teacher-forced top-1 {c['teacher_forced_top1']:.4f}")
    return 0


def cmd_bench_hostile(a) -> int:
    from .hostile import ATTACKS, FAST, run

    names = FAST if a.fast else tuple(a.attack or ATTACKS)
    if unknown := [n for n in names if n not in ATTACKS]:
        raise KvferryError(f"unknown attack '{unknown[0]}' (choose from {', '.join(ATTACKS)})")
    r = run(names, progress=(lambda m: print(m, file=sys.stderr)))
    if a.json:
        print_json(r)
    else:
        for name, row in r["attacks"].items():
            print(f"{name:24} {'contained' if row['contained'] else 'NOT CONTAINED':14} tpot x{row['bystander_tpot_ratio']}"
                  f"  rss +{row['host_rss_growth_mb']} MB  lost {row['sessions_lost']}  {row['error'][:70]}")
    return 0 if r["all_contained"] and r["sessions_lost"] == 0 else 1


def register(sub, add: Callable) -> None:
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
    bo.add_argument("--speculate", choices=tuple(SPECULATE), default="auto",
                    help="run the greedy next step while the guest samples "
                         "(auto: the host's default, see serve --speculate)")
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
    bm.add_argument("--model", help="model name or directory (default: SmolLM2-135M-Instruct); e.g. one from "
                    "kvferry bench shape")
    bm.add_argument("--transfer-only", action="store_true",
                    help="only the raw transfer of an idle session (and re-prefill), no generating migrations")
    bm.add_argument("--modes", nargs="+", choices=("live", "stop-copy"), default=["live", "stop-copy"],
                    help="which generating migrations to run (default: both)")
    bm.add_argument("--rate", type=float, default=0.0, metavar="MB/S",
                    help="live pre-copy pace, as kvferry migrate --rate (default: the host's, ~3 MB a step)")
    bm.add_argument("--no-lane", action="store_true",
                    help="the generating migrations' KV on the gRPC stream, not the lane (to compare; the raw "
                         "transfer measures both either way)")
    bm.add_argument("--plot", help="write a PNG figure (needs matplotlib)")
    bm.add_argument("--json", action="store_true")
    bh = add(b, "shape", cmd_bench_shape, "install a random-weight model of a real model's dimensions (for "
             "timing), or host-proxy(-deep): a tiny one (2 or 30 layers) whose forward pass is cheap, so a "
             "host's own work shows")
    bh.add_argument("shape", choices=list(SHAPES))
    bh.add_argument("--name", help="its name in the model store (default: SHAPE-random)")
    bh.add_argument("--force", action="store_true", help="build it again")
    bh.add_argument("--json", action="store_true")
    bz = add(b, "zero-copy", cmd_bench_zero_copy,
             "guest memory exposed to MLX in place vs copied (the seed's table)")
    bz.add_argument("--n", type=int, default=128, help="GEMM size (n x n, up to 256)")
    bz.add_argument("--reps", type=int, default=100, help="GEMM repetitions per path (median)")
    bz.add_argument("--json", action="store_true")
    bl = add(b, "link", cmd_bench_link, "migration mode auto vs each fixed mode on tc-shaped links (needs root)")
    bl.add_argument("--tokens", type=int, default=2048, help="context of the migrated conversation")
    bl.add_argument("--links", nargs="+", default=["100mbit", "1gbit", "veth"],
                    help="tc tbf rates (e.g. 100mbit, 1gbit) and/or veth (unshaped)")
    bl.add_argument("--reps", type=int, default=1, help="migrations per link and mode (the median is reported)")
    bl.add_argument("--allow-lossy", action="store_true", help="include int8, and let auto pick it")
    bl.add_argument("--json", action="store_true")
    bh = add(b, "chaos", cmd_bench_chaos, "clients chatting while hosts migrate, lose their cable, die and drain "
             "(3 namespace hosts; needs root)")
    bh.add_argument("--duration", type=float, default=150.0, help="seconds of chaos (default 150)")
    bh.add_argument("--clients", type=int, default=8)
    bh.add_argument("--seed", type=int, default=0)
    bh.add_argument("--json", action="store_true")
    bt = add(b, "step", cmd_bench_step, "one decode step's forward pass: shared KV rows, per-session caches and "
             "mlx-lm's BatchKVCache on the same model (guests and streams left out)")
    bt.add_argument("--model")
    bt.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows per step (default 1 8; e.g. 8 64 on a GPU)")
    bt.add_argument("--context", type=int, default=64, help="prompt tokens per row (default 64)")
    bt.add_argument("--steps", type=int, default=20, help="timed steps per figure (the median is reported)")
    bt.add_argument("--warmup", type=int, default=3, help="steps before timing (a GPU compiles kernels in them)")
    bt.add_argument("--json", action="store_true")
    bs = add(b, "serve", cmd_bench_serve, "a real kvferry serve under N concurrent clients, next to mlx-lm's "
             "BatchGenerator (docs/performance.md)")
    bs.add_argument("--model")
    bs.add_argument("--sessions", type=int, nargs="+", help="concurrent sessions (default 1 4 8; on a GPU 1 8 32 64)")
    bs.add_argument("--batch-kv", choices=tuple(BATCH_KV), default="auto",
                    help="the served host's serve --batch-kv (default auto: shared)")
    bs.add_argument("--guest-thread", choices=tuple(GUEST_THREAD), default="auto",
                    help="the served host's serve --guest-thread (default auto: step on a GPU)")
    bs.add_argument("--prefill-thread", choices=tuple(PREFILL_THREAD), default="auto",
                    help="the served host's serve --prefill-thread (default auto: on a GPU)")
    bs.add_argument("--speculate", choices=tuple(SPECULATE), default="auto",
                    help="the served host's serve --speculate (default auto: see serve --speculate)")
    bs.add_argument("--prefix-cache-mb", type=float, metavar="MB", help="the served host's serve "
                    "--prefix-cache-mb (default: serve's; 0: every prompt prefilled whole, as mlx-lm's column)")
    bs.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="the served host's serve --stream-interval (default 1: a message a token)")
    bs.add_argument("--max-batch", type=int, metavar="N",
                    help="the served host's serve --max-batch (default: serve's, 32 on a CPU, 128 on a GPU)")
    bs.add_argument("--trace-steps", action="store_true",
                    help="the served host writes its step trace; each point gets 'steps': a full step's "
                         "period, forward pass, guests and time between steps (p50)")
    bs.add_argument("--tokens", type=int, default=64, help="tokens per turn (default 64)")
    bs.add_argument("--long-prompt", type=int, default=2000,
                    help="the long prompt's tokens (default 2000; 0: no long-prompt point)")
    bs.add_argument("--plot", metavar="PNG", help="draw throughput and TPOT against sessions")
    bs.add_argument("--http", action="store_true", help="also compare the OpenAI HTTP front with gRPC: TTFT "
                    "(median of --ttft-samples) and tokens/s at the largest --sessions")
    bs.add_argument("--ttft-samples", type=int, default=20, help="TTFT samples per path with --http (default 20)")
    bs.add_argument("--json", action="store_true")
    bo = add(b, "hostile", cmd_bench_hostile, "every known attack on a live host while a bystander chats "
             "(docs/security.md)")
    bo.add_argument("--attack", action="append", help="run only this attack (repeatable)")
    bo.add_argument("--fast", action="store_true", help="only the fast attacks (what CI runs)")
    bo.add_argument("--json", action="store_true")
