#!/usr/bin/env bash
# The GPU figures of docs/performance.md, set by set, each bench's JSON (and a short
# summary on stdout) in one folder:
#
#     bash bench/gpu_suite.sh OUTDIR SET [SET ...]
#
# SETs (each a few minutes; a fresh machine's first bench also compiles MLX's CUDA
# kernels, ~2 minutes, so give the first set room):
#   handoff     live migration at 2k, the step ahead on then off, with the handoff trace
#   migrate     SmolLM2 live and stop-and-copy at 512 / 2k / 8k (5 reps)
#   migrate-1b  the same live, on a random-weight Llama-3.2-1B shape (built first)
#   serve       bench serve at 1 / 8 / 32 / 64 sessions, with the step trace
#   overhead    guest overhead against bare mlx-lm
#   serve-run-on  bench serve at 64 sessions with KVFERRY_RUN_ON=1 then 0 (docs/sessions.md)
#   newcomers   bench serve at 64 sessions with the host's step trace kept, and its steps
#               that took prompts listed (the first token of a burst, docs/performance.md)
#   serve-burst bench serve at 32 / 64 sessions with KVFERRY_BURST=1 then 0 (BURST_ORDER; kvferry.burst)
#
# Every bench has its own timeout (SECONDS_<SET>, default below): a cut bench leaves
# its error file and the next set still runs. Six files at most a set, so a device
# call that brings back eight files can take one set.
set -u
out=${1:?usage: bench/gpu_suite.sh OUTDIR SET [SET ...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--pin --threads 4)

bench() {  # name timeout args...: kvferry bench ARGS --json > out/name.json
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T), at most ${limit}s): kvferry bench $*"
  timeout "$limit" kvferry bench "$@" --json > "$out/$name.json" 2> "$out/$name.err"
  echo "   rc=$? ($(date +%T))"
}

summary() {  # name: the rows' headline figures
  python3 - "$out/$1.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"   no JSON ({e})")
keys = ("context", "mode", "downtime_ms", "downtime_ms_reps", "handoff_gap_ms", "precopy_worst_over_normal",
        "total_ms", "reprefill_ms", "transfer_mb_s", "sessions", "aggregate_tps", "mlx_lm_tps", "ratio_to_mlx_lm",
        "tpot_ms_p50", "tpot_ms_p99", "ratio", "steps")
for r in d.get("rows", d.get("points", [d])):
    print("  ", {k: r[k] for k in keys if k in r})
PY
}

prompt_steps() {  # trace files...: the steps that took prompts, and how long each ran
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    steps = [json.loads(line) for line in open(path)]
    for i, s in enumerate(steps):
        if s["prompts"]:
            print(f"   step {i}: {len(s['rows'])} rows, {len(s['prompts'])} prompts "
                  f"({sum(n for _, n in s['prompts'])} tokens), forward {s['forward_ms']} ms, join {s['join_ms']} ms")
PY
}

handoff() {  # name env...: a live 2k migration with the handoff trace, its spans summarised
  local name=$1 trace
  shift
  trace=$(mktemp -d)
  env "$@" KVFERRY_STEP_TRACE="$trace" timeout "${SECONDS_HANDOFF:-300}" kvferry bench migrate --json \
      --contexts 2048 --modes live --reps 5 "${common[@]}" > "$out/$name.json" 2> "$out/$name.err"
  echo "   rc=$?"
  summary "$name"
  python3 bench/handoff.py "$trace" > "$out/${name}_spans.txt" 2>&1
  tail -n 1 "$out/${name}_spans.txt"
  rm -rf "$trace"
}

for set in "$@"; do
  case $set in
    handoff)
      echo "== handoff, the step ahead on then off ($(date +%T))"
      handoff handoff_ahead KVFERRY_STEP_AHEAD=1
      handoff handoff_without KVFERRY_STEP_AHEAD=0 ;;
    migrate)
      bench migrate "${SECONDS_MIGRATE:-560}" migrate --contexts 512 2048 8192 --generate 600 --reps 5 "${common[@]}"
      summary migrate ;;
    migrate-1b)
      kvferry bench shape llama-3.2-1b > "$out/shape.txt" 2>&1
      bench migrate_1b "${SECONDS_MIGRATE_1B:-560}" migrate --model llama-3.2-1b-random --contexts 512 2048 8192 \
          --generate 600 --reps 5 --modes live "${common[@]}"
      summary migrate_1b ;;
    serve)
      bench serve "${SECONDS_SERVE:-560}" serve --sessions 1 8 32 64 --tokens 64 --trace-steps
      summary serve ;;
    overhead)
      bench overhead "${SECONDS_OVERHEAD:-300}" overhead --tokens 256 --rounds 3
      summary overhead ;;
    serve-run-on)  # the step thread queuing decodes ahead of the sessions' threads, on then off
      for ro in 1 0; do
        KVFERRY_RUN_ON=$ro bench "serve_run_on_$ro" "${SECONDS_SERVE:-280}" serve --sessions 64 --tokens 64 \
            --long-prompt 0 --trace-steps
        summary "serve_run_on_$ro"
      done ;;
    newcomers)  # which steps took the burst's prompts, and how long each ran
      mkdir -p "$out/trace"
      KVFERRY_STEP_TRACE="$out/trace" bench newcomers "${SECONDS_SERVE:-280}" serve --sessions 64 --tokens 64 \
          --long-prompt 0
      summary newcomers
      prompt_steps "$out"/trace/steps-*.jsonl ;;
    serve-burst)  # short prompts prefilled as one batch into the shared rows (kvferry.burst), on then off
      for b in ${BURST_ORDER:-1 0}; do
        KVFERRY_BURST=$b bench "serve_burst_$b" "${SECONDS_SERVE:-280}" serve --sessions 32 64 --tokens 64 \
            --long-prompt 0 --trace-steps
        summary "serve_burst_$b"
      done ;;
    *)
      echo "unknown set '$set' (handoff, migrate, migrate-1b, serve, overhead, serve-run-on, newcomers, serve-burst)" >&2
      exit 2 ;;
  esac
done
