"""``kvferry bench shape``: a random-weight model of a real model's dimensions,
built here, for timing without a download.

It takes the default model's tokenizer (SmolLM2's vocabulary) so every bench and
guest runs on it unchanged; its text is noise, its speed and memory are the
real shape's. Weights are N(0, 0.02) in bfloat16, norms one, written as an MLX
model directory into the model store.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Llama-3.2-1B's published dimensions (1.24 B parameters with its 128k vocabulary;
# ~1.07 B with SmolLM2's 49,152 tokens, embeddings tied).
SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072},
    # A model so small (2 layers, width 64) that a host's own per-token work shows next
    # to its forward pass, as on a fast GPU: profile the scheduler on a CPU with it.
    "host-proxy": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                   "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                   "max_position_embeddings": 8192},
    # The same width at SmolLM2's 30 layers: the host's per-layer work a step (the
    # graph, the caches) shows as it does on a GPU serving SmolLM2.
    "host-proxy-deep": {"hidden_size": 64, "num_hidden_layers": 30, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                        "max_position_embeddings": 8192},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json")


def build(shape: str, name: str | None = None, seed: int = 0, force: bool = False) -> dict:
    """Write the model into the store (once: an existing one is reused)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    from ..errors import ConfigError
    from ..models import resolve, store

    if shape not in SHAPES:
        raise ConfigError(f"unknown shape '{shape}' (choose from {', '.join(SHAPES)})")
    out = store() / (name or f"{shape}-random")
    base = resolve(None, progress=False)
    cfg = json.loads((base / "config.json").read_text())
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg["vocab_size"],
           "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
           "torch_dtype": "bfloat16", **SHAPES[shape]}
    if not force and (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == cfg:
        return {"path": str(out), "built": False, **_count(out)}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.update(tree_map(lambda a: (mx.random.normal(a.shape) * 0.02).astype(mx.bfloat16) if a.ndim > 1
                          else mx.ones(a.shape, mx.bfloat16), model.parameters()))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    for f in TOKENIZER_FILES:
        if (base / f).exists():
            shutil.copy(base / f, tmp / f)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"path": str(out), "built": True, **_count(out)}


def _count(out: Path) -> dict:
    from safetensors import safe_open

    n = 0
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        for k in f.keys():
            n += int(__import__("math").prod(f.get_slice(k).get_shape()))
    return {"name": out.name, "parameters": n}
