"""The OpenAI-compatible HTTP front of `kvferry serve --http-port`, driven by the real
`openai` package, curl and requests, on real hosts."""

import json
import shutil
import subprocess
import threading
import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvferry import Client
from test_distributed import TOKEN, Serve, reserved_port, serving_pair

MODEL = "SmolLM2-135M-Instruct"
PORTS = {"a": reserved_port(), "b": reserved_port()}


def http_of(serve: Serve) -> str:
    line = next(x for x in serve.log if "kvferry serving on" in x)
    return line.split("OpenAI API on ")[1].split(")")[0].rstrip("/")  # http://HOST:PORT/v1


@pytest.fixture(scope="module")
def hosts(smollm_dir):
    yield from serving_pair(("--http-port", "0", "--peers", f"127.0.0.1:{PORTS['b']}"), PORTS["a"],
                            ("--http-port", "0", "--peers", f"127.0.0.1:{PORTS['a']}"), PORTS["b"])


@pytest.fixture()
def oai(hosts):
    return openai.OpenAI(base_url=http_of(hosts[0]), api_key=TOKEN, max_retries=0, timeout=300)


def ask(text):
    return [{"role": "user", "content": text}]


def test_models_chat_stream_and_usage(oai):
    assert [m.id for m in oai.models.list()] == [MODEL]
    r = oai.chat.completions.create(model=MODEL, messages=ask("What is the capital of France?"),
                                    temperature=0, max_tokens=16)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason in ("stop", "length")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert 0 < r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ask("What is the capital of France?"),
                                              temperature=0, max_tokens=16, stream=True,
                                              stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the stream says exactly what the whole reply says
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    raw = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert raw.object == "text_completion" and raw.usage.completion_tokens == 5 and raw.choices[0].text


def test_bad_keys_and_values_get_openai_errors(hosts, oai):
    wrong = openai.OpenAI(base_url=http_of(hosts[0]), api_key="not-a-key-at-all", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for kw, param in [({"temperature": 5}, "temperature"), ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"),
                      ({"logit_bias": {"5": 1}}, "logit_bias"),
                      ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                      ({"extra_body": {"frobnicate": 1}}, "frobnicate")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=ask("hi"), **kw)
        assert e.value.body["param"] == param and param in e.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="gpt-4o", messages=ask("hi"))
    url, auth = http_of(hosts[0]) + "/chat/completions", {"Authorization": f"Bearer {TOKEN}"}
    r = requests.post(url, json={"messages": ask("hi"), "max_tokens": 2}, headers=auth, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text  # no model named: the host's one
    r = requests.post(url, json={"model": 5, "messages": ask("hi")}, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = requests.post(http_of(hosts[0]) + "/chat/completions", data=b"{not json",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    assert "Traceback" not in r.text


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_sse_framing_byte_for_byte(hosts):
    body = json.dumps({"model": MODEL, "messages": ask("Say hello."), "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    out = subprocess.run(["curl", "-N", "-s", "-H", f"Authorization: Bearer {TOKEN}", "-H",
                          "Content-Type: application/json", "-d", body, http_of(hosts[0]) + "/chat/completions"],
                         capture_output=True, timeout=120).stdout
    events = out.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-2])
    data = [json.loads(e[6:]) for e in events[:-2]]
    assert all(d["object"] == "chat.completion.chunk" and d["id"] == data[0]["id"] for d in data)
    assert data[0]["choices"][0]["delta"]["role"] == "assistant" and data[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for d in data if d["choices"][0]["delta"].get("content") is not None) <= 6


def test_a_conversation_continues_its_session_and_reuses_its_kv(oai):
    first = oai.chat.completions.with_raw_response.create(model=MODEL, messages=ask("Name a fruit."),
                                                          temperature=0, max_tokens=8)
    sid = first.headers["X-Kvferry-Session"]
    reply = first.parse().choices[0].message.content
    msgs = ask("Name a fruit.") + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another?"}]
    second = oai.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    assert second.headers["X-Kvferry-Session"] == sid  # the same session continued
    u = second.parse().usage
    assert u.prompt_tokens_details.cached_tokens > 10 and u.prompt_tokens > u.prompt_tokens_details.cached_tokens
    named = oai.chat.completions.with_raw_response.create(model=MODEL, messages=ask("And a colour?"), temperature=0,
                                                          max_tokens=4, extra_headers={"X-Kvferry-Session": sid})
    assert named.headers["X-Kvferry-Session"] == sid


def test_two_requests_on_one_conversation_never_share_a_session(oai):
    """Reuse continues an idle session; a second request extending the same
    conversation meanwhile gets its own session, and both replies are right."""
    first = oai.chat.completions.with_raw_response.create(model=MODEL, messages=ask("Name a city."),
                                                          temperature=0, max_tokens=6)
    sid = first.headers["X-Kvferry-Session"]
    msgs = ask("Name a city.") + [{"role": "assistant", "content": first.parse().choices[0].message.content},
                                  {"role": "user", "content": "And a river?"}]
    out = {}
    go = threading.Barrier(2)

    def one(i):
        go.wait()
        r = oai.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12,
                                                          extra_body={"ignore_eos": True})
        out[i] = (r.headers["X-Kvferry-Session"], r.parse().choices[0].message.content)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    sids = {out[0][0], out[1][0]}
    assert len(sids) == 2 and sid in sids  # one continued the session, the other got its own
    alone = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12,
                                        extra_body={"ignore_eos": True}).choices[0].message.content
    assert out[0][1] == out[1][1] == alone  # neither request disturbed the other


def test_eight_concurrent_streams_complete(oai):
    done = {}

    def one(i):
        s = oai.chat.completions.create(model=MODEL, messages=ask(f"Count to {i + 3}."), temperature=0,
                                        max_tokens=12, extra_body={"ignore_eos": True}, stream=True)
        done[i] = sum(1 for c in s if c.choices and c.choices[0].delta.content is not None)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert sorted(done) == list(range(8)) and all(n >= 1 for n in done.values())


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_health_and_metrics(hosts, oai):
    base = http_of(hosts[0]).rsplit("/v1", 1)[0]
    health = requests.get(base + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["device"].startswith("cpu") and health["dtype"] == "float32"
    assert requests.get(base + "/metrics", timeout=10).status_code == 401
    before = metric(base, "kvferry_generated_tokens_total")
    oai.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body={"ignore_eos": True})
    assert metric(base, "kvferry_generated_tokens_total") >= before + 5
    assert metric(base, "kvferry_time_to_first_token_seconds_count") >= 1
    assert metric(base, "kvferry_sessions") >= 1 and metric(base, "kvferry_kv_bytes") > 0
    # the host froze its start-up heap (Ray, gRPC, mlx-lm: tens of thousands of objects) and times collections
    assert metric(base, "kvferry_gc_frozen_objects") > 10_000
    assert metric(base, "kvferry_gc_pause_seconds_count") >= 1


def test_a_stream_survives_a_live_migration_of_its_session(hosts):
    a, b = hosts
    body = {"model": MODEL, "messages": ask("Tell me a long story about a ferry."), "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    ref = requests.post(http_of(a) + "/chat/completions", json={**body, "stream": False}, headers=auth,
                        timeout=300).json()["choices"][0]["message"]["content"]
    with requests.post(http_of(a) + "/chat/completions", json=body, headers=auth, stream=True, timeout=300) as r:
        sid = r.headers["X-Kvferry-Session"]
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line:
                events.append(line)
            if len(events) >= 4:
                break
        m = Client(a.address, TOKEN).session(sid).migrate(to=b.address, live=True)
        events += [x for x in lines if x]
    assert m.tokens > 0 and events[-1] == b"data: [DONE]"
    data = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in data if d["choices"])
    assert text == ref and data[-1]["usage"]["completion_tokens"] == 48  # nothing lost, nothing repeated
    assert sid in [s["id"] for s in Client(b.address, TOKEN).sessions()]
    later = requests.post(http_of(a) + "/chat/completions", headers={**auth, "X-Kvferry-Session": sid},
                          json={**body, "stream": False, "max_tokens": 2}, timeout=60)
    assert later.status_code == 404 and later.json()["error"]["code"] == "session_moved"
    assert later.headers["X-Kvferry-Moved-To"] == b.address  # a later request is redirected, not relayed
    deadline = time.time() + 10
    while not any("moved to" in x and sid in x for x in a.log) and time.time() < deadline:
        time.sleep(0.2)
    assert any("moved to" in x and sid in x for x in a.log)  # the source host's log line for the move


def test_kvferry_errors_map_to_openai_statuses():
    from kvferry.errors import (AuthError, ConfigError, HostDrainingError, HostFullError, SessionBusyError,
                                UnknownSessionError)
    from kvferry.http_front import as_http

    for err, status in [(HostFullError("busy"), 429), (HostDrainingError("draining"), 503),
                        (ConfigError("bad"), 400), (UnknownSessionError("gone"), 404), (AuthError("who"), 401),
                        (SessionBusyError("busy"), 409)]:
        h = as_http(err)
        assert h.status == status and h.body()["error"]["message"] == str(err) and h.body()["error"]["code"]
    assert as_http(HostFullError("busy")).headers == {"Retry-After": "1"}
    h = as_http(RuntimeError("boom"))  # never a traceback, never the internals
    assert h.status == 500 and h.body()["error"]["message"] == "internal error: RuntimeError"


def test_json_log_lines():
    import io
    import logging

    from kvferry.logs import setup

    out = io.StringIO()
    setup("json", stream=out, ring=False)
    logging.getLogger("kvferry.migration").info("session %s moved to %s (pause %.1f ms)", "abc", "h:1", 3.0)
    line = json.loads(out.getvalue().splitlines()[-1])
    assert line["msg"] == "session abc moved to h:1 (pause 3.0 ms)" and line["level"] == "info"
    assert line["logger"] == "kvferry.migration"
    setup("text", stream=out, ring=False)
    logging.getLogger("kvferry").info("host up")
    assert out.getvalue().splitlines()[-1].endswith("kvferry INFO kvferry: host up")
    setup("text", ring=False)  # back to stderr for the rest of the session


def test_a_client_key_holds_at_most_its_share_of_requests(tiny_model):
    """serve's calls-per-key limit holds on HTTP too: 429 with Retry-After, one line."""
    from kvferry.host import ModelHost
    from kvferry.http_front import HttpFront
    from kvferry.keys import Key, Keyring
    from kvferry.params import SamplingParams
    from kvferry.policy import HostPolicy
    from kvferry.server import HostServer

    host = ModelHost(str(tiny_model), progress=False, policy=HostPolicy(calls_per_key=1, max_batch=1))
    srv = HostServer(host, "127.0.0.1:0", keys=Keyring({"alice-key-0123456789": Key("alice", "client"),
                                                        TOKEN: Key("admin", "admin")})).start()
    front = HttpFront(srv, "127.0.0.1", 0).start()
    url = f"http://{front.address}/v1/chat/completions"
    alice = {"Authorization": "Bearer alice-key-0123456789"}
    body = {"model": host.lm.name, "messages": ask("hi"), "max_tokens": 4, "ignore_eos": True, "stream": True}
    holder = host.create_session(sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    hold = holder.send("hold the batch")
    next(hold)  # the batch's only place is taken: alice's first request waits in the queue, in flight
    try:
        with requests.post(url, json=body, headers=alice, stream=True, timeout=120) as first:
            second = requests.post(url, json={**body, "stream": False}, headers=alice, timeout=60)
            assert second.status_code == 429 and second.headers["Retry-After"] == "1"
            assert second.json()["error"]["code"] == "too_many_calls" and "alice" in second.json()["error"]["message"]
            hold.close()  # the place frees: alice's first request runs to its end
            assert [x for x in first.iter_lines() if x][-1] == b"data: [DONE]"
        admin = requests.post(url, json={**body, "stream": False}, headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=60)
        assert admin.status_code == 200  # the limit is per client key
    finally:
        front.stop()
        srv.stop(0)
        host.close()


def test_stream_interval_sends_several_tokens_an_event(tiny_model):
    """serve --stream-interval 4 over HTTP: the first token alone, then up to 4 an SSE
    event; the text and the usage are those of the whole reply."""
    from kvferry.host import ModelHost
    from kvferry.http_front import HttpFront
    from kvferry.policy import HostPolicy
    from kvferry.server import HostServer

    host = ModelHost(str(tiny_model), progress=False, policy=HostPolicy(stream_interval=4))
    srv = HostServer(host, "127.0.0.1:0", token=TOKEN).start()
    front = HttpFront(srv, "127.0.0.1", 0).start()
    try:
        oai = openai.OpenAI(base_url=f"http://{front.address}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        kw = dict(model=host.lm.name, prompt="Ferries", temperature=0, max_tokens=9, extra_body={"ignore_eos": True})
        whole = oai.completions.create(**kw)
        events = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        texts = [e.choices[0].text for e in events if e.choices and e.choices[0].finish_reason is None]
        assert "".join(texts) + "".join(e.choices[0].text or "" for e in events
                                        if e.choices and e.choices[0].finish_reason) == whole.choices[0].text
        assert len(texts) <= 4  # 9 tokens: 1, then 4 and 4 (and the tail); one event a token would be 9
        assert events[-1].usage.completion_tokens == whole.usage.completion_tokens == 9
    finally:
        front.stop()
        srv.stop(0)
        host.close()
