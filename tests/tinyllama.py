"""A tiny random-weight llama, written as a real GGUF at test time.

Weights are made in Hugging Face layout, then Q/K rows are permuted exactly as
llama.cpp's converter does, so importing must undo it. The tokenizer is a
byte-level BPE over the 256 byte symbols plus a few merges and ChatML specials.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvferry.convert import permute_rows
from kvferry.gguf import write_gguf

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    b2u = bytes_to_unicode()
    tokens = list(SPECIALS) + [b2u[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
    for m in merges:
        a, b = m.split(" ")
        tokens.append(a + b)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def hf_weights(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               ffn: int = 128, vocab: int = 280) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, hidden, scale=0.5),
           "model.norm.weight": (1 + w(hidden, scale=0.1))}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": 1 + w(hidden, scale=0.1),
                p + "post_attention_layernorm.weight": 1 + w(hidden, scale=0.1),
                p + "self_attn.q_proj.weight": w(heads * hd, hidden),
                p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                p + "mlp.gate_proj.weight": w(ffn, hidden),
                p + "mlp.up_proj.weight": w(ffn, hidden),
                p + "mlp.down_proj.weight": w(hidden, ffn)}
    return out


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def write_tiny_gguf(path: Path, *, qtype: str = "F32", seed: int = 0, arch: str = "llama",
                    permute: bool = True, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                    raw_types: dict | None = None, weights: dict | None = None,
                    context: int = 512) -> dict[str, np.ndarray]:
    """Write the tiny llama to ``path``; returns its HF-layout float weights."""
    tokens, merges, types = tiny_vocab()
    hf = weights or hf_weights(seed, heads=heads, kv_heads=kv_heads, layers=layers, vocab=len(tokens))
    hidden = hf["model.embed_tokens.weight"].shape[1]
    tensors = {}
    for name, arr in hf.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            g = f"blk.{i}.{_TO_GGUF[rest.rsplit('.', 1)[0]]}.weight"
            if permute and "q_proj" in name:
                arr = permute_rows(arr, heads)
            elif permute and "k_proj" in name:
                arr = permute_rows(arr, kv_heads)
        tensors[g] = (arr, qtype if arr.ndim == 2 else "F32")
    meta = {
        "general.architecture": arch, "general.name": "tiny-llama",
        f"{arch}.block_count": layers, f"{arch}.context_length": context,
        f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": hf["model.layers.0.mlp.up_proj.weight"].shape[0],
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": hidden // heads, f"{arch}.vocab_size": len(tokens),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    write_gguf(path, meta, tensors, raw_types=raw_types)
    return hf
