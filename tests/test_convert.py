"""GGUF import: every supported tensor type, RoPE layout, caching, bad files."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.llama import Model, ModelArgs

from kvferry.convert import import_gguf, permute_rows, unpermute_rows
from kvferry.errors import ModelFormatError
from kvferry.models import load
from tinyllama import write_tiny_gguf

TOKENS = mx.array([[5, 80, 121, 40, 77, 200, 9, 33, 140, 101, 64, 3]])


def reference_model(weights: dict, traditional: bool) -> Model:
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    args = ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=2,
                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0,
                     rope_traditional=traditional, tie_word_embeddings=True)
    m = Model(args)
    m.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return m


def test_permutation_roundtrip():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    p = permute_rows(w, 4)
    assert not np.array_equal(p, w)
    assert np.array_equal(unpermute_rows(p, 4), w)


def test_rope_layout_is_undone(tmp_path):
    """Imported (un-permuted, standard RoPE) == HF reference == permuted + traditional RoPE."""
    hf = write_tiny_gguf(tmp_path / "t.gguf", qtype="F32")
    lm = load(import_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False))
    ours = lm.model(TOKENS)
    ref = reference_model(hf, traditional=False)(TOKENS)
    assert mx.allclose(ours, ref, atol=1e-4).item()

    gguf_layout = {k: (permute_rows(v, 4) if "q_proj" in k else permute_rows(v, 2) if "k_proj" in k else v)
                   for k, v in hf.items()}
    trad = reference_model(gguf_layout, traditional=True)(TOKENS)
    assert mx.allclose(trad, ref, atol=1e-4).item()
    # And the layout matters: GGUF rows with standard RoPE give other logits.
    wrong = reference_model(gguf_layout, traditional=False)(TOKENS)
    assert not mx.allclose(wrong, ref, atol=1e-2).item()


@pytest.mark.parametrize("qtype,bits,tol", [("F32", None, 1e-6), ("F16", None, 2e-3),
                                            ("Q8_0", 8, 0.01), ("Q4_0", 4, 0.08), ("Q4_1", 4, 0.08)])
def test_tensor_types(tmp_path, qtype, bits, tol):
    hf = write_tiny_gguf(tmp_path / "t.gguf", qtype=qtype)
    out = import_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("quantization", {}).get("bits") == bits
    lm = load(out, dtype="float32")
    q = np.array(lm.model.model.layers[1].self_attn.q_proj.weight)
    ref = hf["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == ref.shape
    err = np.abs(q - ref).max()
    assert err <= tol * max(1.0, np.abs(ref).max() * 10), (qtype, err)
    # quantized weights also load as-is (the GPU path) and agree with the float path
    native = load(out, dtype="native")
    a, b = lm.model(TOKENS), native.model(TOKENS)
    assert mx.allclose(a, b.astype(mx.float32), atol=0.05, rtol=0.05).item()


def test_import_is_cached(tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "m", progress=False)
    st = (out / "model.safetensors").stat().st_mtime_ns
    import_gguf(tiny_gguf, tmp_path / "m", progress=False)
    assert (out / "model.safetensors").stat().st_mtime_ns == st
    import_gguf(tiny_gguf, tmp_path / "m", progress=False, force=True)
    assert (out / "model.safetensors").stat().st_mtime_ns != st


def test_truncated(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for cut in (10, 200, len(data) // 2, len(data) - 7):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="truncated|not a GGUF"):
            import_gguf(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", arch="qwen3moe")
    with pytest.raises(ModelFormatError, match="unsupported architecture 'qwen3moe'"):
        import_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)


def test_unsupported_tensor_type(tmp_path):
    # declare a tensor as Q6_K, a k-quant kvferry does not import
    write_tiny_gguf(tmp_path / "t.gguf", raw_types={"blk.0.ffn_down.weight": 14})
    with pytest.raises(ModelFormatError, match="unsupported tensor type Q6_K in 'blk.0.ffn_down.weight'"):
        import_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        import_gguf(p, tmp_path / "m", progress=False)


def test_cli_bad_gguf_is_one_line(tiny_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:5000])
    r = subprocess.run([sys.executable, "-m", "kvferry", "models", "import-gguf", str(bad),
                        "--out", str(tmp_path / "m")], capture_output=True, text=True)
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvferry: bad.gguf: truncated"), r.stderr


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_at_import(tmp_path, bits):
    hf = write_tiny_gguf(tmp_path / "t.gguf", qtype="F16")
    out = import_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False, quantize=bits)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    native = load(out, dtype="native")
    import mlx.nn as nn
    assert isinstance(native.model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert native.model.model.layers[0].mlp.up_proj.bits == bits
    f32 = load(out, dtype="float32")
    q = np.array(f32.model.model.layers[1].self_attn.q_proj.weight)
    assert np.abs(q - hf["model.layers.1.self_attn.q_proj.weight"]).max() < (0.05 if bits == 4 else 0.005)
