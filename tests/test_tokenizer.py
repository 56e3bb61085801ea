"""The tokenizer rebuilt from GGUF metadata agrees with an independent BPE."""

import regex
import pytest

from kvferry.gguf import read_header
from kvferry.models import bundled_gguf
from tinyllama import bytes_to_unicode

GPT2_RE = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
SAMPLES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "café naïve résumé Ærøskøbing Straße",
    "emoji: 😀🚀👩‍💻 and 🇹🇷",
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n",
    "  leading spaces\ttabs\n\nnewlines   ",
    "日本語のテキスト、中文，한국어",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "x = {'a': [1, 2.5e-3], \"b\": None}  # comment",
]


class ReferenceBPE:
    """Textbook byte-level BPE (GPT-2 algorithm) straight from the GGUF arrays."""

    def __init__(self, gguf_path):
        g = read_header(gguf_path)
        self.tokens = g.get("tokenizer.ggml.tokens")
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(g.get("tokenizer.ggml.merges"))}
        types = g.get("tokenizer.ggml.token_type")
        self.specials = sorted((t for t, ty in zip(self.tokens, types) if int(ty) == 3),
                               key=len, reverse=True)
        self.b2u = bytes_to_unicode()

    def bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        pattern = "(" + "|".join(regex.escape(s) for s in self.specials) + ")"
        for chunk in regex.split(pattern, text):
            if not chunk:
                continue
            if chunk in self.vocab and chunk in self.specials:
                ids.append(self.vocab[chunk])
                continue
            for piece in regex.split(r"(\p{N})", chunk):  # smollm: digits one by one
                for word in GPT2_RE.findall(piece):
                    mapped = "".join(self.b2u[b] for b in word.encode("utf-8"))
                    ids += [self.vocab[t] for t in self.bpe(mapped)]
        return ids


@pytest.fixture(scope="module")
def reference():
    return ReferenceBPE(bundled_gguf())


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_match_gguf_vocabulary(smollm, reference, text):
    ours = smollm.tokenizer.encode(text, add_special_tokens=False)
    assert ours == reference.encode(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip(smollm, text):
    tok = smollm.tokenizer
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_ids(smollm):
    tok = smollm.tokenizer
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == [1, 2, 0]
    assert 2 in tok.eos_token_ids
    assert len(tok.get_vocab()) == 49152


def test_chat_template_from_gguf(smollm):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text
