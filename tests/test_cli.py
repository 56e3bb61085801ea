"""The kvferry CLI: models, bench, demo — real processes, real model."""

import json
import os
import subprocess
import sys
import time



def kvferry(*args, env=None, timeout=600):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvferry", *args], capture_output=True,
                          text=True, env=e, timeout=timeout)


def test_models_list_shows_imported(tiny_gguf, tmp_path):
    env = {"KVFERRY_HOME": str(tmp_path)}
    r = kvferry("models", "import-gguf", str(tiny_gguf), "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    r = kvferry("models", "list", "--json", env=env)
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["tiny-llama"]["layers"] == 2
    assert rows["tiny-llama"]["path"] == str(tmp_path / "models" / "tiny-llama")
    r = kvferry("models", "list", env=env)
    assert "tiny-llama" in r.stdout


def test_import_progress_bar(tiny_gguf, tmp_path):
    # tqdm writes to stderr; force it on even though this is not a TTY
    code = ("import sys; from kvferry.convert import import_gguf, _progress; "
            f"import_gguf(r'{tiny_gguf}', r'{tmp_path / 'm'}', progress=True)")
    r = subprocess.run([sys.executable, "-c", code.replace("disable=not enabled", "")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / "config.json").exists()


def test_unknown_model_one_line(tmp_path):
    r = kvferry("demo", "--model", "no-such-model", env={"KVFERRY_HOME": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "kvferry: unknown model 'no-such-model' (installed: SmolLM2-135M-Instruct; "
        "or pass a model directory or a .gguf file)"]


def test_demo_streams_on_local_ray():
    """`kvferry demo`: local Ray, a model-host actor, a two-turn streamed conversation."""
    r = kvferry("demo", "--max-tokens", "16", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Ray actor pid" in r.stdout and "weights float32" in r.stdout
    assert r.stdout.count("assistant> ") == 2
    assert "Paris" in r.stdout


def test_bench_cpu_runs(smollm_dir):
    r = kvferry("bench", "cpu", "--json", "--prompt-tokens", "32", "--decode-tokens", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    for key in ("prefill_tps_fast", "prefill_tps_stock", "prefill_speedup",
                "decode_ms_per_token_fast", "decode_ms_per_token_stock"):
        assert out[key] > 0
    assert out["fast"] == {"blas": out["fast"]["blas"], "dtype": "float32"}
    assert out["fast"]["blas"] != "reference" and out["stock"]["blas"] == "reference"


def test_serve_cpus_is_checked_before_anything_starts():
    from kvferry.cli_remote import parse_cpus

    assert parse_cpus("0") == {0}
    have = sorted(os.sched_getaffinity(0))
    if len(have) > 1:
        assert parse_cpus(f"{have[0]}-{have[1]}") == set(have[:2])
    for bad, msg in (("x", "expected CPU numbers"), ("4096", "this machine offers CPUs"),
                     ("1-0", "this machine offers CPUs")):
        r = kvferry("serve", "--cpus", bad, "--port", "0", env={"KVFERRY_TOKEN": "t"}, timeout=60)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def _rep(downtime, identical=True, **kw):
    return {"context": 512, "mode": "live", "downtime_ms": downtime, "handoff_gap_ms": 80.0,
            "handoff_over_normal_ms": 10.0, "normal_gap_ms": 70.0, "twin_worst_gap_over_median_ms": 20.0,
            "total_ms": 900.0, "pause_ms": 9.0, "bytes": 1000, "migration_started_at": 8, "handoff_at": 20,
            "gaps_ms": [70, 71], "identical": identical, "mid_reply": True, "phases_ms": {"final": 3.0},
            "precopy_worst_over_normal": downtime / 40.0, "twin_worst_over_median": 1.5, **kw}


def test_bench_migrate_row_is_the_median_rep():
    from kvferry.bench.migrate import _targets, aggregate

    row = aggregate([_rep(40.0, tag="a"), _rep(12.0, tag="b"), _rep(90.0, tag="c")])
    assert row["downtime_ms"] == 40.0 and row["tag"] == "a"  # the median migration, whole
    assert row["downtime_ms_reps"] == [40.0, 12.0, 90.0] and row["downtime_ms_worst_rep"] == 90.0
    assert row["reps"] == 3 and row["identical"]
    assert aggregate([_rep(30.0), _rep(10.0)])["downtime_ms"] == 10.0  # even count: the lower median
    assert not aggregate([_rep(1.0), _rep(2.0, identical=False), _rep(3.0)])["identical"]  # one bad rep fails all
    big = aggregate([_rep(30.0, context=8000), _rep(45.0, context=8000), _rep(70.0, context=8000)])
    t = _targets([row, big])
    assert t["live_downtime_max_ms"] == 45.0 and t["live_downtime_worst_rep_ms"] == 90.0
    assert t["live_downtime_ratio_largest_vs_smallest"] == round(45.0 / 40.0, 2)
    assert t["live_precopy_worst_over_normal"] == 90.0 / 40.0  # the worst rep's steps beside pre-copy
    assert t["live_twin_worst_over_median"] == 1.5


def test_bench_migrate_rejects_zero_reps():
    r = kvferry("bench", "migrate", "--reps", "0", timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip() == "kvferry: --reps must be at least 1, not 0"


def test_bench_migrate_rejects_a_negative_rate():
    r = kvferry("bench", "migrate", "--rate", "-5", timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip() == "kvferry: --rate must be positive, not -5.0"


def test_bench_migrate_live_only_at_a_set_pace(smollm_dir):
    r = kvferry("bench", "migrate", "--json", "--contexts", "64", "--generate", "64", "--reps", "1",
                "--modes", "live", "--rate", "50", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [(row["mode"], row["reps"]) for row in out["rows"]] == [("live", 1)]
    assert out["rows"][0]["identical"] and out["precopy_rate_mb_s"] == 50.0
    assert "stop_copy_total_over_reprefill_at_2048" not in out["targets"]


def test_bench_migrate_runs(smollm_dir):
    r = kvferry("bench", "migrate", "--json", "--contexts", "64", "--generate", "64", "--reps", "2",
                timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [(row["mode"], row["reps"]) for row in out["rows"]] == [("live", 2), ("stop-copy", 2)]
    for row in out["rows"]:
        assert row["identical"] and row["mid_reply"] and len(row["downtime_ms_reps"]) == 2
        assert row["downtime_ms"] in row["downtime_ms_reps"] and row["bytes"] > 0
        assert {"extract", "encode", "wire", "land", "restored", "commit"} <= set(row["phases_ms"])
        assert row["transport"] == "lane"  # the default: frames on the target's lane
    assert out["targets"]["identical_everywhere"] and out["lane"] is True
    (t,) = out["transfers"]  # the raw transfer of an idle session, with its phases
    assert t["transfer_mb_s"] > 0 and len(t["transfer_mb_s_reps"]) == 2 and "transfer" in t["phases_ms"]
    assert t["grpc_ceiling_mb_s"] > 0 and len(t["grpc_ceiling_mb_s_reps"]) == 3 and t["transfer_over_ceiling"] > 0
    # the same moves with the frames on the gRPC stream, and a bare lane, in the same run
    assert t["transports"] == ["lane"] and len(t["stream_mb_s_reps"]) == 2 and t["stream_mb_s"] > 0
    assert t["lane_ceiling_mb_s"] > 0 and len(t["lane_ceiling_mb_s_reps"]) == 3 and t["lane_over_stream"] > 0
    assert out["targets"]["lane_over_stream_min"] == t["lane_over_stream"]
    assert out["targets"]["transfer_mb_s_min"] == t["transfer_mb_s"] and out["device"]["kind"] == "cpu"
    assert out["model"] == "SmolLM2-135M-Instruct"  # which model moved (the plot's title says it too)
    assert out["precopy_rate_mb_s"] == "host default"


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigterm_that_lands_in_a_gc_callback_still_stops_a_bench():
    """Python drops what a gc callback raises: a CI run's bench got its SIGTERM inside
    kvferry.collector's callback and ran on to its end (exit 0). The signal is sent again."""
    code = """if True:
        import gc, os, signal, threading, time
        from kvferry.cli import stop_on_sigterm
        stop_on_sigterm()
        def slow(phase, info):  # a collection still running when the SIGTERM comes
            t = time.time() + 1.0
            while phase == "start" and time.time() < t:
                pass
        gc.callbacks.append(slow)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            gc.collect()
            time.sleep(20)
            print("ran on")
        except KeyboardInterrupt:
            print("stopped")
    """
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "stopped", r.stdout + r.stderr
    assert time.time() - t0 < 15 and "Traceback" not in r.stderr, r.stderr


def test_a_sigterm_after_a_bench_stopped_does_not_kill_it_with_sigint():
    """A CI run's bench, stopped by SIGTERM, exited -2 instead of 130: a KeyboardInterrupt
    raised after main() had caught the first one escapes it, and Python then dies of SIGINT.
    Here the second SIGTERM is the one _interrupt_again re-sends (the first KeyboardInterrupt
    also landed in a gc callback), arriving once the bench has unwound."""
    code = """if True:
        import argparse, sys, time, types
        from kvferry import cli
        def bench(args):
            cli._interrupt_again(types.SimpleNamespace(exc_type=KeyboardInterrupt))  # re-sent in 50 ms
            raise KeyboardInterrupt  # the bench unwinds at once
        parser = argparse.ArgumentParser()
        parser.set_defaults(fn=bench, cmd="bench")
        cli.build_parser = lambda: parser
        code = cli.main([])
        time.sleep(0.3)  # the re-sent SIGTERM arrives here
        print("exits", code)
        sys.exit(code)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (130, "exits 130"), r.stderr


def test_a_bench_stopped_with_sigterm_stops_the_host_it_started(smollm_dir):
    """`timeout 60 kvferry bench serve …` (SIGTERM) stops the served host it started
    (its own process group: Ray's processes and the host actor with it) instead of
    leaving it serving."""
    import signal

    bench = subprocess.Popen([sys.executable, "-m", "kvferry", "bench", "serve", "--sessions", "1", "--tokens", "512",
                              "--long-prompt", "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in bench.stderr:
            if "concurrent sessions" in line:  # the host is up and serving the bench's clients
                break
        served = _descendants(bench.pid)
        assert len(served) >= 3 and all(_running(p) for p in _children(bench.pid))  # serve, its raylet, its host
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 130
        deadline = time.time() + 90
        while any(_running(p) for p in served) and time.time() < deadline:
            time.sleep(0.5)
        assert not any(_running(p) for p in served)
    finally:
        if bench.poll() is None:
            bench.kill()


def test_bench_serve_runs_and_reports_every_key(smollm_dir):
    """The CI variant of `kvferry bench serve`: small, keys only (never a timing)."""
    r = kvferry("bench", "serve", "--json", "--sessions", "1", "2", "--tokens", "4", "--long-prompt", "200",
                "--http", "--ttft-samples", "2", "--batch-kv", "shared", "--guest-thread", "step",
                "--prefill-thread", "on", "--speculate", "on", "--prefix-cache-mb", "32", "--stream-interval", "2",
                "--max-batch", "2", "--trace-steps", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["batch_kv"] == "shared" and out["consistency"]["kv"] == "shared"  # the GPU layout, served here
    assert out["guest_thread"] == "step"  # and the GPU's guests on the step thread
    assert out["prefill_thread"] == "on"  # and its prefill thread (the long prompt beside the decoders)
    assert out["speculate"] == "on"  # and its greedy guesses, queued before each step is waited for
    assert out["prefix_cache_mb"] == 32
    assert out["stream_interval"] == 2  # two tokens a message after the first: each still counted once below
    assert out["max_batch"] == 2 and out["trace_steps"] is True
    assert [p["sessions"] for p in out["points"]] == [1, 2]
    for p in out["points"]:
        for key in ("sessions", "aggregate_tps", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
                    "turn_tpot_ms_p50", "turn_tpot_ms_p99", "mlx_lm_tps"):
            assert key in p and p[key] is not None
        assert p["tokens"] == 4 * p["sessions"]
        st = p["steps"]  # --trace-steps: the served host's own steps of this point
        assert st["full_steps"] >= 1 and st["rows_p50"] >= p["sessions"] * 3 / 4, st
        assert st["full_steps"] <= 4 - 1, st  # its own decode steps only, not its warm-up's at the same shape
        assert st["period_ms_p50"] > 0 and st["forward_ms_p50"] > 0 and 0 <= st["guessed_share"] <= 1, st
        assert 0 <= st["ran_on_share"] <= 1, st  # (guests on the step thread: decodes queued ahead of their threads)
    assert out["long_prompt"]["prompt_tokens"] > 150 and "tpot_ms_p99_during" in out["long_prompt"]
    c = out["consistency"]
    assert c["prompts"] == 2 and 0 <= c["greedy_equal_solo"] <= 1 and 0 <= c["teacher_forced_top1"] <= 1
    assert out["batching"] is True and out["device"]["kind"] in ("cpu", "gpu") and out["device"]["backend"]
    hv = out["http_vs_grpc"]
    for key in ("ttft_ms_grpc_p50", "ttft_ms_http_p50", "ttft_http_minus_grpc_ms", "tps_grpc", "tps_http",
                "tps_http_over_grpc"):
        assert hv[key] is not None
    assert hv["streams"] == 2 and hv["ttft_samples"] == 2
    bad = kvferry("bench", "serve", "--long-prompt", "-5", timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip() == ("kvferry: --long-prompt takes a token count "
                                                          "(0: no long-prompt point), not -5")
    bad = kvferry("bench", "serve", "--max-batch", "0", timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip() == "kvferry: --max-batch must be at least 1, not 0"
    bad = kvferry("bench", "serve", "--stream-interval", "0", timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip() == "kvferry: --stream-interval must be at least 1, not 0"
    bad = kvferry("bench", "serve", "--model", "nope", "--sessions", "1", "--long-prompt", "0", timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr  # the host's refusal
    assert bad.stderr.startswith("kvferry: the served host did not start: ") and "unknown model 'nope'" in bad.stderr


def test_bench_step_runs_and_reports_every_key(smollm_dir):
    """`kvferry bench step`: each layout's forward pass per decode step; keys only."""
    r = kvferry("bench", "step", "--json", "--rows", "1", "2", "--steps", "2", "--warmup", "1", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [p["rows"] for p in out["points"]] == [1, 2] and out["device"]["kind"] == "cpu"
    # its own process imports MLX: the optimized BLAS must have loaded first (it once did not: 10x slower)
    assert out["device"]["blas"] in ("openblas", "scipy-openblas", "custom"), out["device"]
    for p in out["points"]:
        assert all(p[k] > 0 for k in ("shared_ms", "per_session_ms", "mlx_lm_ms", "shared_over_mlx_lm"))
        for name in ("shared_pipelined", "mlx_lm_pipelined"):  # a served step's host time, split
            q = p[name]
            assert q["build_ms"] > 0 and q["submit_ms"] > 0 and q["wait_ms"] >= 0, q
            assert q["step_ms"] >= max(q["build_ms"], q["submit_ms"]), q
    bad = kvferry("bench", "step", "--rows", "0", timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("kvferry: --rows takes counts >= 1")


def test_an_unknown_model_is_one_line_before_anything_starts():
    for args in (("serve", "--model", "nope", "--port", "0"),
                 ("bench", "migrate", "--model", "nope", "--contexts", "64", "--reps", "1")):
        r = kvferry(*args, timeout=120)
        assert r.returncode != 0
        assert r.stderr.strip().startswith("kvferry: unknown model 'nope'") and len(r.stderr.strip().splitlines()) == 1


def test_bench_numbers_out_of_range_are_one_line_naming_the_flag():
    """A bench given a count it cannot run (a negative context once ended in a traceback
    from the hosts) says so in one line, naming the flag the user gave, before it starts."""
    for args, want in ((("bench", "migrate", "--contexts", "-5"), "kvferry: --contexts takes token counts"),
                       (("bench", "migrate", "--contexts", "64", "--generate", "8"), "kvferry: --contexts takes"),
                       (("bench", "overhead", "--tokens", "0"), "kvferry: --tokens and --rounds must be"),
                       (("bench", "overhead", "--rounds", "0"), "kvferry: --tokens and --rounds must be"),
                       (("bench", "zero-copy", "--n", "300"), "kvferry: --n must be in 1..256"),
                       (("bench", "checkpoint", "--contexts", "0"), "kvferry: --windows must be at least 1 and")):
        r = kvferry(*args, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().startswith(want), (args, r.stderr[-500:])
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_temperature_is_spelled_either_way():
    """`--temp` as mlx-lm spells it, `--temperature` as vLLM and the OpenAI API do."""
    from kvferry.cli import build_parser

    for flag in ("--temp", "--temperature"):
        assert build_parser().parse_args(["generate", "--prompt", "x", flag, "0.5"]).temp == 0.5


def test_serve_refuses_tls_files_and_an_address_it_cannot_use_in_one_line(tmp_path, tiny_model):
    """A TLS file that cannot be read, a certificate without its key, and an address not
    this machine's: one line each, never the host actor's traceback (both once were)."""
    import pytest

    from kvferry.cluster import _last_error
    from kvferry.errors import ConfigError
    from kvferry.host import ModelHost
    from kvferry.server import HostServer

    key = tmp_path / "key.pem"
    key.write_text("not a key")
    for args, want in ((("--tls-cert", "/nonexistent.pem", "--tls-key", str(key)),
                        "kvferry: /nonexistent.pem: cannot read the TLS file (No such file or directory)"),
                       (("--tls-cert", str(key)), f"kvferry: {key}: a TLS certificate needs its private key")):
        r = kvferry("serve", "--port", "0", *args, env={"KVFERRY_TOKEN": "t"}, timeout=60)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [want + (" (--tls-key)" if "needs" in want
                                                                              else "")], r.stderr[-800:]
    host = ModelHost(str(tiny_model), progress=False)
    try:
        with pytest.raises(ConfigError, match=r"^cannot bind 198\.51\.100\.7:0 "):
            HostServer(host, "198.51.100.7:0", token="t")  # TEST-NET-2: on no interface here
    finally:
        host.close()

    class ActorDied(Exception):  # what Ray keeps of an actor's failed __init__: its text
        error_msg = ("The actor died because of an error raised in its creation task\n  File \"server.py\"\n"
                     "kvferry.errors.ConfigError: cannot bind 198.51.100.7:0 (an address of this machine?)\n")
    assert _last_error(ActorDied()) == "cannot bind 198.51.100.7:0 (an address of this machine?)"
    ActorDied.error_msg = "Traceback\nFileNotFoundError: [Errno 2] No such file"
    assert _last_error(ActorDied()) == "FileNotFoundError: [Errno 2] No such file"


def test_a_flag_is_never_taken_for_a_longer_one(capsys):
    """argparse's prefixes once made `kvferry drain --to HOST` mean --token HOST (then
    "auth failed"); a flag must be spelled out, in every subcommand."""
    import pytest

    from kvferry.cli import build_parser

    for argv in (["drain", "--to", "h:1"], ["generate", "--prompt", "x", "--max", "3"], ["bench", "serve", "--sess", "1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "unrecognized arguments: " + argv[-2] in capsys.readouterr().err
