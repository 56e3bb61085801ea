"""``kvferry models import-gguf``: a llama-architecture GGUF -> an MLX model dir.

The output is what ``mlx_lm.load`` expects: ``config.json`` (HF llama keys plus
an mlx-lm ``quantization`` block), ``model.safetensors`` and tokenizer files.
Quantized GGUF tensors stay quantized (MLX affine, group size 32, 4 or 8 bits
per tensor); the loader picks the fastest dtype for the device at load time.

RoPE: llama.cpp's converter permutes the rows of Q and K so that rotary pairs
are interleaved (``traditional`` RoPE). We undo that permutation per head, so
the directory is a standard HF-layout llama using mlx-lm's default
(non-traditional) RoPE; ``tests/test_convert.py`` proves both layouts agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from .errors import ModelFormatError
from .gguf import GGUFFile, check_tensor_types, read_header

CONVERTER_VERSION = 1
SUPPORTED_ARCHS = ("llama",)

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def hf_name(gguf_name: str) -> str:
    if m := _BLK.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_MAP:
            return f"model.layers.{layer}.{_LAYER_MAP[part]}.{kind}"
    elif m := _TOP.match(gguf_name):
        part, kind = m.groups()
        if part in _TOP_MAP:
            return f"{_TOP_MAP[part]}.{kind}"
    raise ModelFormatError(f"unsupported tensor '{gguf_name}' for the llama architecture")


def permute_rows(w, n_heads: int):
    """llama.cpp's Q/K permutation: rotary halves -> interleaved pairs (per head)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_rows(w, n_heads: int):
    """Inverse of :func:`permute_rows`: interleaved pairs -> rotary halves."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def build_config(g: GGUFFile) -> dict:
    arch = g.architecture
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(f"{g.path.name}: unsupported architecture '{arch}' "
                               f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def need(key: str):
        v = g.get(f"{arch}.{key}")
        if v is None:
            raise ModelFormatError(f"{g.path.name}: metadata '{arch}.{key}' missing")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(g.get(f"{arch}.attention.head_count_kv", heads))
    tokens = g.get("tokenizer.ggml.tokens")
    vocab = int(g.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    head_dim = int(g.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(g.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelFormatError(f"{g.path.name}: partial RoPE ({rope_dim} of {head_dim}) unsupported")
    if "rope_freqs.weight" in g.tensors:
        raise ModelFormatError(f"{g.path.name}: llama3-style rope_freqs scaling is not supported yet")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(g.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(g.get(f"{arch}.context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "bos_token_id": _int_or_none(g.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _int_or_none(g.get("tokenizer.ggml.eos_token_id")),
    }
    scaling = g.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear",
                               "factor": float(g.get(f"{arch}.rope.scaling.factor", 1.0))}
    elif scaling not in (None, "none"):
        raise ModelFormatError(f"{g.path.name}: unsupported RoPE scaling '{scaling}'")
    return cfg


def _int_or_none(v):
    return None if v is None else int(v)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)


def import_gguf(src: str | os.PathLike, out: str | os.PathLike, *, progress: bool = True,
                force: bool = False, quantize: int | None = None) -> Path:
    """Convert ``src`` into an MLX model directory at ``out``; cached by content hash.

    ``quantize`` (4 or 8) re-quantizes every linear and embedding weight to MLX
    affine ``quantize``-bit, group 64 — the format Apple GPUs run fastest."""
    if quantize not in (None, 4, 8):
        raise ModelFormatError(f"--quantize {quantize}: choose 4 or 8")
    src, out = Path(src), Path(out)
    g = read_header(src)
    cfg = build_config(g)
    check_tensor_types(g)
    digest = file_digest(src)
    marker = out / "kvferry.json"
    if not force and marker.exists():
        try:
            info = json.loads(marker.read_text())
            if info.get("source_sha256") == digest and info.get("converter") == CONVERTER_VERSION \
                    and info.get("quantize") == quantize:
                return out  # cached
        except (OSError, ValueError):
            pass

    import mlx.core as mx

    from .gguf_tokenizer import build_tokenizer

    try:
        raw = mx.load(str(src))
    except (RuntimeError, ValueError) as e:
        raise ModelFormatError(f"{src.name}: {str(e).splitlines()[0]}") from None

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    weights: dict[str, mx.array] = {}
    overrides: dict[str, dict] = {}
    bits_seen: dict[int, int] = {}
    with _progress(len(raw), f"import {src.name}", progress) as bar:
        for name, arr in raw.items():
            new = hf_name(name)
            if ".attn_q." in name:
                arr = unpermute_rows(arr, heads)
            elif ".attn_k." in name:
                arr = unpermute_rows(arr, kv_heads)
            if new.endswith(".weight") and f"{name[:-len('.weight')]}.scales" in raw:
                scales = raw[f"{name[:-len('.weight')]}.scales"]
                in_dims = scales.shape[-1] * 32
                bits = arr.shape[-1] * 32 // in_dims
                bits_seen[bits] = bits_seen.get(bits, 0) + 1
                overrides[new[: -len(".weight")]] = {"group_size": 32, "bits": bits}
            weights[new] = arr
            bar.update(1)
    if overrides:
        default_bits = max(bits_seen, key=bits_seen.get)
        q = {"group_size": 32, "bits": default_bits, "mode": "affine"}
        q.update({k: v for k, v in overrides.items() if v["bits"] != default_bits})
        cfg["quantization"] = q
        cfg["quantization_config"] = dict(q)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if quantize:
            weights, cfg = _requantize(weights, cfg, quantize)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        build_tokenizer(g, tmp, cfg["max_position_embeddings"])
        (tmp / "kvferry.json").write_text(json.dumps({
            "source": str(src.resolve()), "source_sha256": digest, "converter": CONVERTER_VERSION,
            "name": out.name, "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "gguf_file_type": _int_or_none(g.get("general.file_type")),
            "tensor_types": sorted({t.type_name for t in g.tensors.values()}),
            "quantize": quantize,
        }, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _requantize(weights: dict, cfg: dict, bits: int) -> tuple[dict, dict]:
    """Dequantize what the GGUF quantized, then quantize every 2-D weight to ``bits``."""
    import mlx.core as mx

    out: dict = {}
    q = cfg.get("quantization") or {}
    for name, arr in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base and f"{base}.scales" in weights:
            b = q.get(base, {}).get("bits", q.get("bits"))
            arr = mx.dequantize(arr, weights[f"{base}.scales"], weights[f"{base}.biases"], 32, b)
        if base and arr.ndim == 2 and arr.shape[-1] % 64 == 0:
            w, s, bi = mx.quantize(arr.astype(mx.float16), group_size=64, bits=bits)
            out[name], out[f"{base}.scales"], out[f"{base}.biases"] = w, s, bi
        else:
            out[name] = arr
    cfg = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
    cfg["quantization"] = cfg["quantization_config"] = {"group_size": 64, "bits": bits, "mode": "affine"}
    return out, cfg
