"""A packed pass (kvferry.batch_attention.PackedCaches: decode rows and prompt chunks
side by side, the CPU's step with a prompt in it) gives every session what its own
pass would: its logits and its cache's K/V."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvferry.batch_attention import PackedCaches, install, install_packed
from kvferry.prefill_thread import private_copy


class _Session:
    """What a packed pass needs of a session: its caches (filled with a prompt)."""

    def __init__(self, cache):
        self.cache = cache

    @classmethod
    def prompted(cls, model, tokens):
        cache = [KVCache() for _ in model.layers]
        model(mx.array([tokens], dtype=mx.int32), cache=cache)
        mx.eval([c.state for c in cache])
        return cls(cache)

    def copy(self):
        return _Session(private_copy(self.cache))  # the prefill thread's copy: same tokens, new buffers


def _each_as_alone(model, sessions, packed, steps, hidden):
    """Each segment of a packed pass's ``hidden`` (``steps``' tokens, through the ``packed``
    copies of ``sessions``) against that session's own pass: logits and K/V."""
    logits = (model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear)(hidden)[0]
    at = 0
    for s, p, toks in zip(sessions, packed, steps):
        alone = s.copy()
        ref = model(mx.array([toks], dtype=mx.int32), cache=alone.cache)[0]
        mine = logits[at:at + len(toks)]
        at += len(toks)
        assert mx.allclose(mine, ref, atol=2e-3).item(), mx.abs(mine - ref).max().item()
        assert (mine.argmax(-1) == ref.argmax(-1)).all().item()
        for a, b in zip(p.cache, alone.cache):
            assert a.offset == b.offset
            assert mx.allclose(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :], atol=1e-4).item()
            assert mx.allclose(a.values[..., :a.offset, :], b.values[..., :b.offset, :], atol=1e-4).item()


def test_a_packed_pass_gives_each_segment_its_own_pass(smollm):
    model, enc = smollm.model, smollm.tokenizer.encode
    assert install(model) and install_packed(model)
    prompts = ["Rivers run to the sea.", "A ferry crossed the bay at dawn", "Name three colours:",
               "Why is the sky blue?", "Once upon a time"]
    sessions = [_Session.prompted(model, enc(p)) for p in prompts]
    # three decode rows (batched as in a plain decode step), a prompt chunk, and a lone token after it
    steps = [enc(" It")[:1], enc(" slowly")[:1], enc(" red")[:1], enc(" Because the air scatters light"),
             enc(" there")[:1]]
    packed = [s.copy() for s in sessions]
    hidden = model.model(mx.array([[t for toks in steps for t in toks]], dtype=mx.int32),
                         cache=PackedCaches.of([(s, len(toks)) for s, toks in zip(packed, steps)]))
    _each_as_alone(model, sessions, packed, steps, hidden)


def test_resident_decode_rows_in_a_packed_pass_step_as_a_shared_rows_step_does(smollm):
    """Decode rows in the shared buffers (kvferry.resident) beside a prompt chunk: the rows
    go through the shared-rows step (one scatter, one attention a layer), and every
    session gets what its own pass would."""
    from kvferry.resident import ResidentKV, ResidentRows

    model, enc = smollm.model, smollm.tokenizer.encode
    assert install(model) and install_packed(model)
    prompts = ["Rivers run to the sea.", "A ferry crossed the bay at dawn", "Name three colours:",
               "Once upon a time", "Why is the sky blue?"]
    sessions = [_Session.prompted(model, enc(p)) for p in prompts]
    # three resident decode rows, a one-token prompt chunk (a CPU's smallest beside decodes: a
    # segment of its own, not a fourth row) and a longer chunk
    steps = [enc(" It")[:1], enc(" slowly")[:1], enc(" red")[:1], enc(" there")[:1],
             enc(" Because the air scatters light")]
    packed = [s.copy() for s in sessions]
    shared = ResidentRows()
    rows = packed[:3]
    assert shared.take(rows) and all(type(s.cache[0]) is ResidentKV for s in rows)
    caches = PackedCaches.of([(s, len(toks)) for s, toks in zip(packed, steps)], shared.step(rows))
    hidden = model.model(mx.array([[t for toks in steps for t in toks]], dtype=mx.int32), cache=caches)
    shared.advance(rows)
    mx.eval(hidden, shared.k, shared.v)
    _each_as_alone(model, sessions, packed, steps, hidden)  # a resident row's views read its buffer row
