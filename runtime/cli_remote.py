"""``kvferry serve`` and the commands that talk to hosts: sessions, hosts, migrate."""

from __future__ import annotations

import os
import sys
from typing import Callable

from .params import DRAIN_TIMEOUT
from .console import print_json
from .errors import KvferryError
from .params import MIGRATE_DEFAULTS, MIGRATE_MODES  # noqa: I001
from .policy import BATCH_KV, GUEST_THREAD, MAX_BATCH, PREFILL_THREAD, SPECULATE, HostPolicy

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
    from .cluster import serve
    from .paths import ensure_token
    from .transport import TLSConfig

    from .addresses import split

    bind = f"{a.bind}:{a.port}"
    peers = tuple(p.strip() for p in (a.peers or "").split(",") if p.strip())
    for addr in (*peers, *([a.advertise] if a.advertise else [])):
        split(addr)  # HOST:PORT, or one line naming it
    if a.token_file:
        from .keys import read_token_file
        a.token = read_token_file(a.token_file)
    if a.tokens:
        from .keys import parse_file
        parse_file(a.tokens)  # a bad keys file is one line here, not an actor's traceback
    token = None if a.tokens and not (a.token or os.environ.get("KVFERRY_TOKEN")) else ensure_token(a.token, a.no_auth)
    policy = {k: v for k, v in {"max_sessions": a.max_sessions, "session_ttl_s": a.session_ttl,
                                "max_deadline_ms": a.max_deadline_ms, "max_tokens": a.max_tokens,
                                "max_batch": a.max_batch, "max_queue": a.max_queue,
                                "guest_step_ms": a.guest_step_ms, "step_tokens": a.step_tokens,
                                "speculate": SPECULATE[a.speculate], "shared_kv": BATCH_KV[a.batch_kv],
                                "drive_guests": GUEST_THREAD[a.guest_thread],
                                "prefill_thread": PREFILL_THREAD[a.prefill_thread],
                                "stream_interval": a.stream_interval,
                                "prefix_cache_bytes": None if a.prefix_cache_mb is None
                                else int(a.prefix_cache_mb * 1e6)}.items()
              if v is not None}
    HostPolicy(**policy)  # its one-line errors, here
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
        from .transport import is_loopback
        if not is_loopback(a.bind):
            raise KvferryError(f"--no-auth is only allowed on a loopback address, not {a.bind}")

    def ready(addr: str, http: str | None = None) -> None:
        scheme = "https" if a.tls_cert else "http"  # the HTTP front serves with the gRPC certificate
        print(f"kvferry serving on {addr} (model {a.model or 'SmolLM2-135M-Instruct'}, "
              f"auth {'off' if token is None and not a.tokens else 'keys' if a.tokens else 'token'}, "
              f"TLS {'mutual' if a.tls_ca and a.tls_cert else 'on' if a.tls_cert else 'off'}"
              f"{f', OpenAI API on {scheme}://{http}/v1' if http else ''})", flush=True)

    def report(o: dict) -> None:
        print(f"kvferry: session {o['session']}: {o['outcome']} {o['where']} {o['error']}".rstrip(),
              file=sys.stderr, flush=True)

    for prefix, server in (("tls", True), ("peer_tls", False)):
        if t := _tls(a, prefix):
            TLSConfig(**t).check(server)
    if a.http_port is not None and not 0 <= a.http_port <= 65535:
        raise KvferryError(f"--http-port {a.http_port}: must be a port number (0..65535; 0: any free port)")
    if a.drain_timeout <= 0:
        raise KvferryError(f"--drain-timeout must be positive, not {a.drain_timeout}")
    if not -1 <= a.lane_port <= 65535:
        raise KvferryError(f"--lane-port {a.lane_port}: must be a port number (0: any free port; -1: no lane)")
    from .models import resolve

    resolve(a.model)  # an unknown model is one line here, not the host actor's traceback (imports a GGUF once)
    serve(a.model, bind, token, address=a.address, allow_no_auth=a.no_auth, tls=_tls(a),
          client_tls=_tls(a, "peer_tls"), ready=ready, report=report,
          max_kv_bytes=int(a.max_kv_mb * 1e6) if a.max_kv_mb else None, advertise=a.advertise,
          peers=peers, drain_dir=a.drain_dir or "", drain_timeout=a.drain_timeout, tokens_file=a.tokens,
          policy=policy, http_port=a.http_port, metrics_public=a.metrics_public, log_format=a.log_format,
          dtype=a.dtype, lane_port=None if a.lane_port < 0 else a.lane_port)
    return 0


def _client(a):
    from .sdk import Client
    from .transport import TLSConfig

    t = _tls(a, "tls")
    return Client(a.host or os.environ.get("KVFERRY_HOST", DEFAULT_HOST), a.token,
                  tls=TLSConfig(**t) if t else None)


def cmd_sessions(a) -> int:
    rows = _client(a).sessions()
    if a.json:
        print_json(rows)
    else:
        print(f"{'ID':14} {'HOST':22} {'TOKENS':>7} {'KV MB':>7} {'GUEST':12} TURN")
        for r in rows:
            print(f"{r['id']:14} {r['host']:22} {r['tokens']:>7} {r['kv_bytes'] / 1e6:>7.1f} "
                  f"{r['guest']:12} {'yes' if r['in_turn'] else ''}")
    return 0


def cmd_hosts(a) -> int:
    rows = _client(a).hosts()
    if a.json:
        print_json(rows)
    else:
        print(f"{'ADDRESS':22} {'NODE':16} {'MODEL':26} {'SESSIONS':>8} HEALTHY")
        for r in rows:
            print(f"{r['address']:22} {r['node']:16} {r['model']:26} {r['sessions']:>8} {r['healthy']}")
    return 0


def cmd_migrate(a) -> int:
    from tqdm import tqdm

    if a.rate < 0:
        raise KvferryError(f"--rate must be positive, not {a.rate}")
    c = _client(a)
    s = c.session(a.session)
    bar = tqdm(total=None, unit="B", unit_scale=True, desc=f"migrate {a.session}", disable=a.json,
               leave=False)

    def progress(p):
        bar.n = p.bytes_sent
        bar.set_postfix_str(f"frames {p.frames_sent}/{p.frames_total}")
        bar.refresh()

    try:
        m = s.migrate(a.to, to_token=a.to_token, mode=a.mode, live=not a.stop_copy, rate_mb_s=a.rate,
                      allow_lossy=a.allow_lossy, lane=not a.no_lane, progress=progress)
    finally:
        bar.close()  # cleared, so that an error is a line of its own
    out = {"session": a.session, "target": m.target, "bytes": m.bytes, "seconds": round(m.seconds, 4),
           "raw_kv_bytes": m.raw_kv_bytes, "ratio": round(m.ratio, 3), "tokens": m.tokens,
           "pause_ms": round(m.pause_ms, 2), "live": not a.stop_copy, "mode": m.mode,
           "transfer_mb_s": m.transfer_mb_s, "phases_ms": m.phases_ms, "transport": m.transport}
    if a.json:
        print_json(out)
    else:
        print(f"migrated {a.session} to {m.target}: {m.bytes} bytes in {m.seconds * 1000:.1f} ms "
              f"({m.tokens} tokens, KV ratio {m.ratio:.2f})")
    return 0


def dtype_arg(sp):
    from .models import DTYPES

    sp.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights and KV: auto follows the device (CPU: float32 with the optimized BLAS; "
                         "GPU: quantized weights kept, float16 activations and KV); quantized keeps them on a "
                         "CPU too; native loads the model as stored")


def tls_args(sp, prefix="tls", what="server"):
    sp.add_argument(f"--{prefix.replace('_', '-')}-cert", dest=f"{prefix}_cert", help=f"{what} certificate (PEM)")
    sp.add_argument(f"--{prefix.replace('_', '-')}-key", dest=f"{prefix}_key", help=f"{what} key (PEM)")
    sp.add_argument(f"--{prefix.replace('_', '-')}-ca", dest=f"{prefix}_ca",
                    help="CA to verify peers (on a server: require client certificates, mutual TLS)")


def client_args(sp):
    sp.add_argument("--host", help=f"session host (default: $KVFERRY_HOST or {DEFAULT_HOST})")
    sp.add_argument("--token", help="default: $KVFERRY_TOKEN or $KVFERRY_HOME/token")
    tls_args(sp, "tls", "client")
    sp.add_argument("--json", action="store_true")


def cmd_drain(a) -> int:
    if a.timeout < 0:
        raise KvferryError(f"--timeout must be positive, not {a.timeout}")
    rows = _client(a).drain(timeout=a.timeout, exit=not a.keep_running)
    if a.json:
        print_json(rows)
    else:
        for r in rows:
            print(f"{r['session']}: {r['outcome']} {r['where']} {r['error']}".rstrip())
        print(f"drained {sum(r['outcome'] != 'failed' for r in rows)} of {len(rows)} sessions"
              + ("" if a.keep_running else "; the host stops"))
    return 0 if all(r["outcome"] != "failed" for r in rows) else 1


def register(sub, add: Callable) -> None:
    sv = add(sub, "serve", cmd_serve, "run a session host on this machine (Ray + gRPC)")
    sv.add_argument("--model")
    sv.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=50051)
    sv.add_argument("--advertise", metavar="HOST:PORT", help="the address clients and peers dial (default: "
                    "the bind address, or with --bind 0.0.0.0 the address of the interface that routes to the "
                    "peers; never loopback)")
    sv.add_argument("--peers", metavar="HOST:PORT[,...]", help="hosts this one may hand its sessions to "
                    "(drain; later the only allowed migration targets). Default: the cluster's healthy hosts")
    sv.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT, metavar="S",
                    help=f"SIGTERM or `kvferry drain` moves every session to a peer within S seconds "
                         f"(default {DRAIN_TIMEOUT:g}: inside systemd's and launchd's stop timeouts in deploy/)")
    sv.add_argument("--lane-port", type=int, default=0, metavar="PORT",
                    help="where peers send a migration's KV frames, on a socket beside the gRPC stream (same "
                         "bind address, TLS and auth; default 0: any free port, told to each peer on the "
                         "stream; -1: none, the frames go on the stream). Fix it where a firewall filters")
    sv.add_argument("--drain-dir", metavar="DIR", help="where a drain saves the sessions no peer takes; they "
                    "are restored when a host starts with it (default: $KVFERRY_HOME/drain/<address>)")
    sv.add_argument("--token", help="the admin key (default: $KVFERRY_TOKEN or $KVFERRY_HOME/token); "
                    "prefer --token-file or the environment: argv is visible to every user of the machine")
    sv.add_argument("--token-file", metavar="FILE", help="read the admin key from FILE")
    sv.add_argument("--tokens", metavar="FILE", help="several keys, one per line: NAME ROLE TOKEN, ROLE one of "
                    "admin, client (sees only its own sessions), peer (host-to-host only); see docs/security.md")
    sv.add_argument("--max-sessions", type=int, help=f"sessions held at once (default {HostPolicy.max_sessions})")
    sv.add_argument("--session-ttl", type=float, metavar="S", help="close a session idle for S seconds "
                    f"(default {HostPolicy.session_ttl_s:g}; 0: never)")
    sv.add_argument("--max-deadline-ms", type=float, help="the most guest time per call a session may ask for "
                    f"(default {HostPolicy.max_deadline_ms:g})")
    sv.add_argument("--max-tokens", type=int, help=f"the most tokens one reply may ask for (default "
                    f"{HostPolicy.max_tokens})")
    sv.add_argument("--http-port", type=int, metavar="N", help="also serve the OpenAI API (/v1/chat/completions, "
                    "/v1/completions, /v1/models), /health and /metrics over HTTP on port N of the same address, "
                    "with the same keys (0: any free port); see docs/http.md")
    sv.add_argument("--metrics-public", action="store_true", help="/metrics without a key (for a scraper "
                    "inside a trusted network)")
    sv.add_argument("--log-format", choices=("text", "json"), default="text",
                    help="log lines on stderr as text or one JSON object per line")
    sv.add_argument("--max-batch", type=int, metavar="N", help="replies generated at once, one decode batch "
                    f"(default {MAX_BATCH['cpu']} on a CPU, {MAX_BATCH['gpu']} on a GPU); more wait in a first-come queue")
    sv.add_argument("--max-queue", type=int, metavar="N", help="replies that may wait for a place (default "
                    f"{HostPolicy.max_queue}); beyond, clients get RESOURCE_EXHAUSTED (host_full)")
    sv.add_argument("--guest-step-ms", type=float, metavar="MS", help="a guest's own time per step (sampling), "
                    f"at most (default {HostPolicy.guest_step_ms:g}); a step never waits longer for a guest, and "
                    "one over it ends its session with an error")
    sv.add_argument("--prefix-cache-mb", type=float, metavar="MB", help="KV of recent prompts that new "
                    "sessions start from when their prompt begins the same way, e.g. a system prompt (default "
                    f"{HostPolicy.prefix_cache_bytes / 1e6:g}; 0: off; like vLLM's prefix caching)")
    sv.add_argument("--step-tokens", type=int, metavar="N", help="prompt tokens a step prefills beside its "
                    "decodes (default: adaptive, about half a decode step's time; like vLLM's chunked prefill)")
    sv.add_argument("--speculate", choices=tuple(SPECULATE), default="auto",
                    help="queue each greedy row's next step on the device's argmax before this step is waited "
                         "for, as mlx-lm does (auto: on a GPU; a guest that picks another token costs a step)")
    sv.add_argument("--batch-kv", choices=tuple(BATCH_KV), default="auto",
                    help="where a decode batch's KV lives: shared (one buffer per layer, one attention for every "
                         "row; mlx-lm's BatchKVCache) or per-session (each row its own cache and attention); auto: "
                         "shared")
    sv.add_argument("--guest-thread", choices=tuple(GUEST_THREAD), default="auto",
                    help="where a decode step's guests sample: on the host's step thread, one after another "
                         "(one thread switch a token) or each on its session's thread; auto: step on a GPU")
    sv.add_argument("--prefill-thread", choices=tuple(PREFILL_THREAD), default="auto",
                    help="prefill a long prompt that arrives while others decode on a thread of its own, beside "
                         "the decode steps, instead of in chunks inside them; auto: on a GPU")
    sv.add_argument("--stream-interval", type=int, metavar="N", help="tokens a streamed reply sends in one "
                    f"message, at most (default {HostPolicy.stream_interval}: each token at once; the first "
                    "always alone). More cost the host less per token under load, at a coarser stream; "
                    "like vLLM's --stream-interval")
    sv.add_argument("--no-auth", action="store_true", help="no token (loopback addresses only)")
    sv.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS or an embedded Ray)")
    sv.add_argument("--threads", type=int, help="CPU threads for the model's matrix products (like llama.cpp "
                    "-t; default: all cores). Give each host its share when several share a machine")
    sv.add_argument("--cpus", metavar="LIST", help="run the host on these CPUs only, e.g. 0-3 (like llama.cpp "
                    "--cpu-range; Linux). Hosts sharing a machine then do not slow each other's steps")
    dtype_arg(sv)
    sv.add_argument("--max-kv-mb", type=float, help="KV cache memory this host may hold; restores and "
                    "incoming migrations beyond it are refused (default: half the machine's memory)")
    tls_args(sv)
    tls_args(sv, "peer_tls", "client certificate for outgoing migrations:")

    ss = add(sub, "sessions", cmd_sessions, "list the sessions on a host")
    client_args(ss)
    hs = add(sub, "hosts", cmd_hosts, "list the hosts of the cluster")
    client_args(hs)
    mg = add(sub, "migrate", cmd_migrate, "move a session to another host")
    mg.add_argument("session")
    mg.add_argument("--to", required=True, help="target host address")
    mg.add_argument("--to-token", help="the target's token if it differs")
    mg.add_argument("--mode", default=MIGRATE_DEFAULTS["mode"], choices=MIGRATE_MODES,
                    help="how the KV travels: auto (default: measured on this link, raw or lossless, int8 with "
                         "--allow-lossy), raw, lossless (~1.2x smaller), int8/int4 (lossy)")
    mg.add_argument("--allow-lossy", action="store_true", help="let --mode auto pick int8 on slow links")
    mg.add_argument("--no-lane", action="store_true", help="keep the KV frames on the gRPC stream, not on the "
                    "target's lane (a socket beside it; docs/migration.md)")
    mg.add_argument("--rate", type=float, default=0.0, metavar="MB/S",
                    help="live pre-copy: MB/s of KV at most (default 0: about 3 MB per decode step of "
                         "the session, so generation keeps its pace; 40 MB/s if it is not generating)")
    mode = mg.add_mutually_exclusive_group()
    mode.add_argument("--live", action="store_true", help="pre-copy live migration (the default)")
    mode.add_argument("--stop-copy", action="store_true", help="stop-and-copy")
    client_args(mg)
    dr = add(sub, "drain", cmd_drain, "move every session of a host to its peers (live), then stop it")
    dr.add_argument("--timeout", type=float, default=0.0, metavar="S", help="bound the drain (default: the "
                    "host's --drain-timeout)")
    dr.add_argument("--keep-running", action="store_true", help="leave the host up (draining: it takes no "
                    "new sessions and health says NOT_SERVING)")
    client_args(dr)
