"""``kvferry bench serve --http``: the HTTP front against gRPC on one host, same run.

TTFT: ``ttft_samples`` one-token turns with the same prompt, through the SDK
(gRPC) and through ``POST /v1/chat/completions`` (streaming), alternated so both
see the same machine; medians. Throughput: ``streams`` concurrent turns of
``tokens`` tokens (EOS ignored) through each, aggregate tokens/s.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

PROMPT = "Tell me a long story about a ferry crossing a strait at dawn."


def _grpc_turn(address: str, token: str, tokens: int) -> tuple[float, int]:
    from ..sdk import Client

    with Client(address, token, timeout=600) as c:
        t0 = time.perf_counter()  # an HTTP request creates its session too: both count the creation
        s = c.create_session(max_tokens=tokens, ignore_eos=True)
        first, n = None, 0
        for ch in s.events(PROMPT):
            if ch.token >= 0:
                n += 1
                first = first or time.perf_counter()
        s.close()
    return (first or time.perf_counter()) - t0, n


def _http_turn(http: str, token: str, tokens: int, model: str) -> tuple[float, int]:
    import requests

    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, n = None, 0
    with requests.post(http + "/chat/completions", json=body, stream=True, timeout=600,
                       headers={"Authorization": f"Bearer {token}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                if d["choices"] and d["choices"][0]["delta"].get("content") is not None:
                    first = first or time.perf_counter()
                if d.get("usage"):  # the tokens, however many an event carried (serve --stream-interval)
                    n = d["usage"]["completion_tokens"]
    return (first or time.perf_counter()) - t0, n


def compare(address: str, http: str, token: str, ttft_samples: int = 20, streams: int = 8,
            tokens: int = 64) -> dict:
    import requests

    model = requests.get(http + "/models", headers={"Authorization": f"Bearer {token}"},
                         timeout=30).json()["data"][0]["id"]
    grpc_turn = lambda n: _grpc_turn(address, token, n)  # noqa: E731
    http_turn = lambda n: _http_turn(http, token, n, model)  # noqa: E731
    grpc_turn(1), http_turn(1)  # warm both paths
    g, h = [], []
    for _ in range(ttft_samples):
        g.append(grpc_turn(1)[0] * 1000)
        h.append(http_turn(1)[0] * 1000)

    def concurrent(turn) -> float:
        out: list = []
        ts = [threading.Thread(target=lambda: out.append(turn(tokens))) for _ in range(streams)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return sum(n for _, n in out) / (time.perf_counter() - t0)
    tps_g = concurrent(grpc_turn)
    tps_h = concurrent(http_turn)
    mg, mh = statistics.median(g), statistics.median(h)
    return {"ttft_samples": ttft_samples, "ttft_ms_grpc_p50": round(mg, 2), "ttft_ms_http_p50": round(mh, 2),
            "ttft_http_minus_grpc_ms": round(mh - mg, 2), "streams": streams, "tokens": tokens,
            "tps_grpc": round(tps_g, 2), "tps_http": round(tps_h, 2),
            "tps_http_over_grpc": round(tps_h / tps_g, 3) if tps_g else None}
