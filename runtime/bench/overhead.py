"""``kvferry bench overhead``: the full guest-driven session vs bare mlx-lm.

Same model, same prompt, same process, interleaved rounds; greedy, EOS ignored
so both sides generate exactly ``tokens`` tokens. Bare = mlx-lm's
``generate_step`` (the loop behind ``mlx_lm.generate``). Runtime = a Session:
the chat guest calls kv_prefill/kv_decode/kv_logits_topk through the ABI and
samples; the host streams each token through the text detokenizer.
"""

from __future__ import annotations

import statistics
import time

QUESTION = "Write a long, detailed story about a lighthouse keeper and a storm."


def run(model: str | None = None, tokens: int = 256, rounds: int = 3, speculate: bool | None = None) -> dict:
    """``speculate``: the step scheduler's greedy speculation (None: the device's default)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from ..host import ModelHost
    from ..session import SamplingParams

    from ..policy import HostPolicy

    host = ModelHost(model, progress=False, policy=HostPolicy(speculate=speculate))
    lm = host.lm
    prompt = list(lm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                  add_generation_prompt=True))
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def bare(n: int) -> tuple[list[int], float, float]:
        t0 = time.perf_counter()
        out, t_first = [], None
        for tok, _ in generate_step(mx.array(prompt), lm.model, max_tokens=n, prefill_step_size=512):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(tok))
        t_end = time.perf_counter()
        return out, len(prompt) / (t_first - t0), (len(out) - 1) / (t_end - t_first)

    def runtime(n: int) -> tuple[list[int], float, float]:
        s = host.create_session(sampling=SamplingParams(**{**sampling.__dict__, "max_tokens": n}))
        toks = [ev.token for ev in s.complete(prompt) if ev.token >= 0]
        st = s.last
        host.close_session(s.id)
        return toks, st.prompt_tps, st.generation_tps

    bare(8), runtime(8)  # warm-up (kernel JIT, caches)
    res = {"bare": [], "runtime": []}
    toks = {}
    for r in range(rounds):
        order = ("runtime", "bare") if r % 2 == 0 else ("bare", "runtime")
        for side in order:
            t, p, d = (runtime if side == "runtime" else bare)(tokens)
            res[side].append((p, d))
            toks[side] = t
    med = {side: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v))
           for side, v in res.items()}
    # each round's two sides ran back to back: their ratio cancels a machine that drifts
    # between rounds (the H200 host's bare decode spread 284-517 tok/s in one run)
    paired = [rt[1] / b[1] for rt, b in zip(res["runtime"], res["bare"])]
    st = host.steps.stats
    spec = {"on": host.steps.speculate, "speculated": st["speculated"], "hits": st["speculation_hits"]}
    host.close()
    from ..device import current

    return {
        "model": lm.name,
        "device": current().as_dict(), "dtype": lm.dtype, "weights": lm.weights,
        "speculation": spec,
        "prompt_tokens": len(prompt),
        "generated_tokens": tokens,
        "rounds": rounds,
        "decode_tps_runtime": round(med["runtime"][1], 3),
        "decode_tps_bare": round(med["bare"][1], 3),
        "ratio": round(med["runtime"][1] / med["bare"][1], 4),
        "ratio_paired": round(statistics.median(paired), 4),  # median of the per-round ratios
        "prefill_tps_runtime": round(med["runtime"][0], 2),
        "prefill_tps_bare": round(med["bare"][0], 2),
        "prefill_ratio": round(med["runtime"][0] / med["bare"][0], 4),
        "tokens_equal": toks["runtime"] == toks["bare"],
        "per_round": {side: [{"prefill_tps": round(p, 2), "decode_tps": round(d, 3)} for p, d in v]
                      for side, v in res.items()},
        "ratio_per_round": [round(x, 4) for x in paired],
    }
