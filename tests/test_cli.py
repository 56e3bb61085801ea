"""The kvferry CLI: models, bench, demo — real processes, real model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def kvferry(*args, env=None, timeout=600):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True,
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
    code = ("import runtime, sys; from runtime.convert import import_gguf, _progress; "
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
    from runtime.cli import parse_cpus

    assert parse_cpus("0") == {0}
    have = sorted(os.sched_getaffinity(0))
    if len(have) > 1:
        assert parse_cpus(f"{have[0]}-{have[1]}") == set(have[:2])
    for bad, msg in (("x", "expected CPU numbers"), ("4096", "this machine offers CPUs"),
                     ("1-0", "this machine offers CPUs")):
        r = kvferry("serve", "--cpus", bad, "--port", "0", env={"KVFERRY_TOKEN": "t"}, timeout=60)
        assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
