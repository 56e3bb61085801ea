"""Guest-driven sessions on a tiny llama (fast) and on SmolLM2 (end to end)."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvferry.guests import GUESTS_DIR
from kvferry.errors import ConfigError
from kvferry.guest import GuestTrap
from kvferry.host import ModelHost, UnknownSessionError
from kvferry.session import PromptTooLongError, SamplingParams, SessionError, SessionOptions

CHAT_WAT = """
(module
  (import "kvferry" "kv_decode" (func $decode (param i32) (result i32)))
  (import "kvferry" "kv_prefill" (func $prefill (param i32 i32) (result i32)))
  (memory (export "memory") 2 2)
  (global $n (mut i32) (i32.const 0))
  (func (export "kvferry_abi_version") (result i32) i32.const 1)
  (func (export "kvferry_buffer") (param i32) (result i32) i32.const 1024)
  (func (export "kvferry_chat_config") (param i32) (result i32) i32.const 0)
  (func (export "kvferry_chat_begin") (param i32 i32) (result i32)
    local.get 0 local.get 1 call $prefill drop i32.const 0)
  (func (export "kvferry_chat_step") (result i32) STEP)
)
"""
OOV = CHAT_WAT.replace("STEP", "i32.const 999999")
FOREVER = CHAT_WAT.replace("STEP", "i32.const 65")  # never returns a stop code
SPIN = CHAT_WAT.replace("STEP", "(loop $l br $l) i32.const 0")


@pytest.fixture(scope="module")
def host(tiny_model):
    h = ModelHost(str(tiny_model), progress=False)
    yield h
    h.close()


def greedy(**kw):
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def run(session, prompt):
    toks = [e.token for e in session.complete(prompt) if e.token >= 0]
    return toks


def test_greedy_matches_bare_mlx_lm(host):
    prompt = [5, 80, 121, 40, 77, 200, 9, 33]
    s = host.create_session(sampling=greedy(max_tokens=40))
    ours = run(s, prompt)
    bare = [int(t) for t, _ in generate_step(mx.array(prompt), host.lm.model, max_tokens=40)]
    assert ours == bare and len(ours) == 40


@pytest.mark.parametrize("prefill_step", [1, 3, 512])
def test_prefill_chunking_does_not_change_tokens(host, prefill_step):
    prompt = list(range(10, 60))
    ref = run(host.create_session(sampling=greedy(max_tokens=12)), prompt)
    s = host.create_session(sampling=greedy(max_tokens=12), options=SessionOptions(prefill_step=prefill_step))
    assert run(s, prompt) == ref


def test_seeded_sampling_is_reproducible(host):
    def sample(seed, **kw):
        s = host.create_session(sampling=SamplingParams(temperature=3.0, seed=seed, max_tokens=30,
                                                        ignore_eos=True, **kw))
        return run(s, [5, 6, 7])
    for kw in ({}, {"top_k": 20}, {"top_p": 0.95}, {"top_k": 50, "top_p": 0.9}):
        a, b, c = sample(1, **kw), sample(1, **kw), sample(2, **kw)
        assert a == b, kw
        assert a != c, kw
    # top_k=1 is greedy whatever the temperature
    assert sample(3, top_k=1) == run(host.create_session(sampling=greedy(max_tokens=30)), [5, 6, 7])


def test_sampling_distribution_follows_temperature(host):
    """Full-vocabulary sampling at high temperature spreads over many tokens."""
    s = host.create_session(sampling=SamplingParams(temperature=5.0, seed=0, max_tokens=60, ignore_eos=True))
    toks = run(s, [5, 6, 7])
    assert len(set(toks)) > 20


def test_multi_turn_prefills_only_new_tokens(host):
    s = host.create_session(sampling=SamplingParams(max_tokens=8))
    list(s.send("hello there"))
    first = s.last
    n_hist = len(s.history)
    list(s.send("and again"))
    full = len(host.lm.tokenizer.apply_chat_template(s.messages[:-1], add_generation_prompt=True))
    assert s.last.prompt_tokens < full - n_hist + 8
    assert s.last.prompt_tokens < full / 2
    assert first.finish_reason in ("stop", "length")
    assert s.messages[-1]["role"] == "assistant"


def test_stop_string_and_max_tokens(host):
    s = host.create_session(sampling=greedy(max_tokens=40))
    text = "".join(e.text for e in s.complete([5, 6, 7]))
    assert s.last.finish_reason == "length" and s.last.generation_tokens == 40
    stop = text[10:13]
    s2 = host.create_session(sampling=greedy(max_tokens=40, stop=(stop,)))
    out = "".join(e.text for e in s2.complete([5, 6, 7]))
    assert s2.last.finish_reason == "stop"
    assert out == text[: text.find(stop)]


def test_cache_kinds_and_memory_report(host):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    kinds = {None: KVCache, 64: RotatingKVCache}
    for ctx, cls in kinds.items():
        s = host.create_session(sampling=greedy(max_tokens=100), options=SessionOptions(ctx=ctx))
        run(s, list(range(5, 40)))
        assert isinstance(s.cache[0], cls)
        m = s.memory()
        assert m["kv_bytes"] > 0 and m["arena_bytes"] == 4 << 20 and m["tokens"] == len(s.history)
    with pytest.raises(ConfigError, match="head dim 16 is not a multiple of the KV group size 64"):
        host.create_session(options=SessionOptions(kv_bits=8))
    # rotating cache keeps going past its size
    r = host.create_session(sampling=greedy(max_tokens=100), options=SessionOptions(ctx=32))
    assert len(run(r, list(range(5, 20)))) == 100


def test_many_sessions_one_model(host):
    weights = host.memory()["weights_bytes"]
    model_id = id(host.lm.model)
    sessions = [host.create_session(sampling=greedy(max_tokens=5)) for _ in range(8)]
    outs = [run(s, [5, 6, 7]) for s in sessions]
    assert all(o == outs[0] for o in outs)
    assert id(host.lm.model) == model_id and host.memory()["weights_bytes"] == weights
    report = host.memory()["sessions"]
    assert all(report[s.id]["kv_bytes"] > 0 for s in sessions)
    for s in sessions:
        host.close_session(s.id)
    with pytest.raises(UnknownSessionError, match="unknown session"):
        host.get(sessions[0].id)


@pytest.mark.parametrize("wat,error,match", [
    (OOV, SessionError, r"emitted token id 999999, outside the vocabulary \(0\.\.\d+\)"),
    (SPIN, GuestTrap, r"exceeded its deadline of 300 ms in kvferry_chat_step\(\)"),
])
def test_bad_guests_are_isolated(host, tmp_path, wat, error, match):
    path = tmp_path / "bad.wasm"
    path.write_text(wat)
    good = host.create_session(sampling=greedy(max_tokens=10))
    ref = run(host.create_session(sampling=greedy(max_tokens=10)), [5, 6, 7])
    bad = host.create_session(str(path), greedy(max_tokens=10), SessionOptions(deadline_ms=300))
    with pytest.raises(error, match=match):
        run(bad, [5, 6, 7])
    with pytest.raises((SessionError, GuestTrap)):
        run(bad, [8])
    assert run(good, [5, 6, 7]) == ref  # the other session is undisturbed


def test_guest_that_never_stops_is_ended_by_max_tokens(host, tmp_path):
    path = tmp_path / "forever.wasm"
    path.write_text(FOREVER)
    s = host.create_session(str(path), greedy(max_tokens=25))
    toks = run(s, [5, 6, 7])
    assert toks == [65] * 25 and s.last.finish_reason == "length"


def test_prompt_longer_than_context(host):
    s = host.create_session(options=SessionOptions(ctx=32))
    with pytest.raises(PromptTooLongError, match="prompt is 40 tokens, the context holds 32"):
        list(s.complete(list(range(5, 45))))
    assert run(host.create_session(sampling=greedy(max_tokens=3)), [5]) != []


def test_bad_options():
    with pytest.raises(ConfigError, match="--kv-bits 7"):
        SessionOptions(kv_bits=7).validate(512)
    with pytest.raises(ConfigError, match="cannot be combined"):
        SessionOptions(kv_bits=4, ctx=64).validate(512)
    with pytest.raises(ConfigError, match="--ctx 100000"):
        SessionOptions(ctx=100000).validate(512)
    with pytest.raises(ConfigError, match="--top-p 0"):
        SamplingParams(top_p=0).validate()


def test_placement_is_reported(tiny_model):
    h = ModelHost(str(tiny_model), attn_cpu=0.5, progress=False)
    p = h.placement
    assert p["attention_layers_on_cpu"] == 1 and p["layers"] == 2
    if not p["gpu"]:
        assert p["active"] is False and "no-op" in p["note"]
    h.close()
    with pytest.raises(ConfigError, match="--attn-cpu 1.5"):
        ModelHost(str(tiny_model), attn_cpu=1.5, progress=False)


def test_placement_runs_on_the_step_thread(tiny_model):
    """Attention placed on the CPU, as on a GPU host, runs where the step scheduler
    runs the model (its own thread: MLX streams are per thread), with the same
    tokens as without placement."""
    from kvferry.host import apply_placement
    from kvferry.models import load

    def reply(lm) -> list[int]:
        h = ModelHost(lm=lm, progress=False)
        try:
            s = h.create_session(None, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            return [e.token for e in s.send("hello there") if e.token >= 0]
        finally:
            h.close()

    placed = load(str(tiny_model), progress=False)
    assert apply_placement(placed.model, 1.0, has_gpu=True)["active"]
    assert reply(placed) == reply(load(str(tiny_model), progress=False))


def test_step_trace_writes_a_line_per_step_and_refuses_a_bad_folder(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFERRY_STEP_TRACE", str(tmp_path / "trace"))
    h = ModelHost(str(tiny_model), progress=False)
    try:
        s = h.create_session(None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        list(s.send("hello there"))
    finally:
        h.close()
    lines = [json.loads(x) for f in (tmp_path / "trace").glob("steps-*.jsonl") for x in f.read_text().splitlines()]
    assert any(x["prompts"] for x in lines) and sum(1 for x in lines if x["rows"]) >= 3
    assert all({"t", "forward_ms", "lock_ms", "guests_ms", "gc_ms", "guessed", "rows", "prompts"} <= set(x)
               for x in lines)
    assert all(0 <= x["guessed"] <= len(x["rows"]) for x in lines)  # (a CPU host does not speculate)
    assert all(0 <= x["lock_ms"] <= x["forward_ms"] for x in lines)
    assert all(0 <= x["gc_ms"] <= x["forward_ms"] + x["guests_ms"] + 0.02 for x in lines)  # rounding
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVFERRY_STEP_TRACE", str(tmp_path / "file" / "x"))
    with pytest.raises(ConfigError, match="KVFERRY_STEP_TRACE=.*cannot write a step trace there"):
        ModelHost(str(tiny_model), progress=False)


def test_not_a_chat_guest(host):
    from kvferry.guest import GuestError

    with pytest.raises(GuestError, match="gemm.wasm: not a chat guest"):
        host.create_session(GUESTS_DIR / "gemm.wasm")


# ----------------------------------------------------------------------------- SmolLM2 end to end

def kvferry(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvferry", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def test_generate_cli_default_guest(smollm_dir):
    r = kvferry("generate", "--prompt", "What is the capital of France?", "--max-tokens", "20", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"
    assert out["session"]["guest"] == "chat.wasm" and out["generation_tps"] > 0
    assert out["device"]["kind"] == "cpu" and out["dtype"] == "float32" and out["peak_memory_mb"] > 0


def test_generate_cli_float16_kv(smollm_dir):
    """--dtype overrides the device's policy: float16 weights and KV on this CPU too."""
    r = kvferry("generate", "--prompt", "What is the capital of France?", "--max-tokens", "8", "--json",
                "--dtype", "float16")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["dtype"] == "float16" and out["weights"] == "float16" and "Paris" in out["text"]
    bad = kvferry("generate", "--prompt", "hi", "--dtype", "float8")
    assert bad.returncode != 0 and "invalid choice: 'float8'" in bad.stderr


def test_quantized_kv_cache_on_smollm(smollm):
    from mlx_lm.models.cache import QuantizedKVCache

    h = ModelHost(lm=smollm)
    s = h.create_session(sampling=SamplingParams(max_tokens=12), options=SessionOptions(kv_bits=8))
    text = "".join(e.text for e in s.send("What is the capital of France?"))
    assert isinstance(s.cache[0], QuantizedKVCache) and "Paris" in text
    h.close()


def test_generate_cli_digits_guest(smollm_dir):
    r = kvferry("generate", "--prompt", "Tell me about cats.", "--guest", str(GUESTS_DIR / "digits.wasm"),
                "--max-tokens", "12")
    assert r.returncode == 0, r.stderr[-2000:]
    reply = r.stdout.strip()
    assert len(reply) == 12 and reply.isdigit()
    assert "generation: 12 tokens" in r.stderr


def test_chat_cli_two_turns(smollm_dir):
    r = kvferry("chat", "--max-tokens", "24", stdin="What is the capital of France?\nAnd of Italy?\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout and "Rome" in r.stdout
    turns = [l for l in r.stderr.splitlines() if l.startswith("[prompt:")]
    assert len(turns) == 2
    n1, n2 = (int(t.split()[1]) for t in turns)
    assert n2 < n1  # the second turn prefills only its new tokens


@pytest.mark.parametrize("args,message", [
    (["--temp", "-1"], "kvferry: --temp -1.0: must be >= 0"),
    (["--kv-bits", "4", "--ctx", "256"], "kvferry: --kv-bits cannot be combined with --ctx"),
    (["--model", "no-such"], "kvferry: unknown model 'no-such'"),
    (["--guest", "/nonexistent.wasm"], "kvferry: guest file /nonexistent.wasm does not exist"),
])
def test_generate_bad_input_one_line(args, message):
    r = kvferry("generate", "--prompt", "hi", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr


def test_bench_overhead_runs(smollm_dir):
    r = kvferry("bench", "overhead", "--json", "--tokens", "8", "--rounds", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["tokens_equal"] is True
    for k in ("decode_tps_runtime", "decode_tps_bare", "ratio", "ratio_paired", "prefill_tps_runtime",
              "prefill_tps_bare"):
        assert out[k] > 0
    assert len(out["ratio_per_round"]) == 1 and out["ratio_paired"] == out["ratio_per_round"][0]


def test_decode_split_bench_runs(smollm_dir):
    """bench/decode_split.py (the build / eval split of a bare decode step): keys only."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "decode_split.py"
    r = subprocess.run([sys.executable, str(script), "--steps", "3", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)["rows"]
    assert row["model"] == "SmolLM2-135M-Instruct" and row["steps"] == 3
    assert row["build_ms_p50"] > 0 and row["eval_wait_ms_p50"] > 0
    assert row["step_ms_p50"] == pytest.approx(row["build_ms_p50"] + row["eval_wait_ms_p50"], abs=0.002)


def test_host_read_bench_runs(smollm_dir):
    """bench/host_read.py (a pipelined decode reading its logits, or the step's top-1,
    on the host): every variant runs, and its asserts hold the three reads equal."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "host_read.py"
    r = subprocess.run([sys.executable, str(script), "--steps", "3", "--reps", "1", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    assert [x["variant"] for x in rows] == ["bare", "read", "top1"]
    assert all(x["model"] == "SmolLM2-135M-Instruct" and x["ms_per_token_p50"] > 0 for x in rows)


def test_cpu_softmax_bench_runs(smollm_dir):
    """bench/cpu_softmax.py (MLX's exp against a polynomial one in a long prefill): its
    fast exp stays within float32 noise of MLX's, and both attentions agree on the model."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "cpu_softmax.py"
    r = subprocess.run([sys.executable, str(script), "--context", "200", "--chunk", "64", "--rounds", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["parts"]["fast_exp_max_rel_err"] < 1e-4 and out["parts"]["elements"] == 3 * 3 * 64 * 2048
    assert [x["attention"] for x in out["rows"]] == ["mx.fast", "fast_exp"]
    assert all(x["prefill_s"] > 0 and x["decode_ms_p50"] > 0 for x in out["rows"])
    assert out["agreement"]["last_argmax_equal"] and out["agreement"]["last_logits_max_abs_diff"] < 1e-2
