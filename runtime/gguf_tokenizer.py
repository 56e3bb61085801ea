"""Hugging Face tokenizer files from a GGUF's tokenizer metadata.

GGUF's ``gpt2`` tokenizer model is byte-level BPE: ``tokenizer.ggml.tokens``
(the vocabulary, already in GPT-2's byte-to-unicode alphabet),
``tokenizer.ggml.merges`` (ranked), ``token_type`` (control tokens become
special added tokens) and ``tokenizer.ggml.pre`` naming the pre-tokenizer
regex llama.cpp uses. We rebuild the same pipeline with ``tokenizers`` and
save it with ``transformers`` so ``mlx_lm.load`` reads it unchanged.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelFormatError
from .gguf import GGUFFile

# llama.cpp's pre-tokenizer names -> tokenizers pre-tokenizer config.
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt-2", "gpt2", "starcoder", "refact"):
        return byte_level if pre not in ("starcoder", "refact") else pt.Sequence(
            [pt.Digits(individual_digits=True), byte_level])
    if pre == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        regex = _LLAMA3_RE
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        regex = _QWEN2_RE
    else:
        return None
    return pt.Sequence([pt.Split(Regex(regex), behavior="isolated", invert=False),
                        pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(g: GGUFFile, out_dir: Path, max_context: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    name = g.path.name
    kind = g.get("tokenizer.ggml.model")
    if kind is None:
        raise ModelFormatError(f"{name}: no tokenizer metadata (tokenizer.ggml.model missing)")
    if kind != "gpt2":
        raise ModelFormatError(f"{name}: unsupported tokenizer model '{kind}' "
                               "(supported: gpt2 byte-level BPE)")
    pre = str(g.get("tokenizer.ggml.pre", "default"))
    pre_tok = _pre_tokenizer(pre)
    if pre_tok is None:
        raise ModelFormatError(f"{name}: unsupported tokenizer pre-tokenizer '{pre}' "
                               "(supported: default, gpt-2, smollm, llama-bpe, qwen2, starcoder)")
    tokens = g.get("tokenizer.ggml.tokens")
    merges = g.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ModelFormatError(f"{name}: tokenizer tokens/merges missing or malformed")
    types = g.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise ModelFormatError(f"{name}: token_type has {len(types)} entries for {len(tokens)} tokens")

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelFormatError(f"{name}: malformed merge {m!r}")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(tokens[i], special=(types[i] == CONTROL), normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)

    def tid(key: str) -> str | None:
        v = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(v)] if v is not None and 0 <= int(v) < len(tokens) else None

    kwargs = {k: tid(k) for k in ("bos", "eos", "unk", "pad")}
    kwargs = {f"{k}_token": v for k, v in kwargs.items() if v is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_context or 8192,
                                   clean_up_tokenization_spaces=False, **kwargs)
    fast.add_bos_token = bool(g.get("tokenizer.ggml.add_bos_token", False))
    if (tpl := g.get("tokenizer.chat_template")) is not None:
        fast.chat_template = str(tpl)
    fast.save_pretrained(str(out_dir))
