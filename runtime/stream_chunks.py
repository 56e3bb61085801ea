"""Several tokens a streamed message (``serve --stream-interval``, as vLLM's and SGLang's).

Each streamed message costs a host more than its token: gRPC sends it as a batch of
its own and the RPC thread waits for the send to complete, two hand-offs of the GIL
that the step thread also wants. Under load that is the largest host cost a token
(docs/performance-log.md). So a host may carry up to N tokens a message, one token's
fields as always (``index``, ``token``, ``text``) and the rest in ``more_tokens`` and
``more_texts``. Only a client that says it reads them (``SendRequest.chunk_tokens``)
gets them; the SDK hands its callers one chunk a token again (:func:`expand`).

The first token of a stream goes alone, so the time to first token stays; a chunk
without a token (the end, a move, an error) sends what is held first. Pure: the SDK
imports it.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from .errors import RemoteError
from .proto import kvferry_pb2 as pb

CLIENT_CHUNK_TOKENS = 1024  # what the SDK accepts a message: whatever the host sends


def coalesce(chunks: Iterable[pb.TokenChunk], n: int) -> Iterator[pb.TokenChunk]:
    """``chunks`` (one token each, then chunks without one) as messages of up to ``n`` tokens."""
    if n <= 1:
        yield from chunks
        return
    held: list[pb.TokenChunk] = []
    first = True
    for c in chunks:
        if c.token < 0:
            if held:
                yield _merge(held)
                held = []
            yield c
            continue
        if first:  # the time to first token is not traded for fewer messages
            first = False
            yield c
            continue
        held.append(c)
        if len(held) >= n:
            yield _merge(held)
            held = []
    if held:  # the stream stopped early (its client left, or an error ends it next)
        yield _merge(held)


def _merge(held: list[pb.TokenChunk]) -> pb.TokenChunk:
    if len(held) == 1:
        return held[0]
    head = pb.TokenChunk()
    head.CopyFrom(held[0])  # a new message: a turn's feed keeps its chunks for later followers
    head.more_tokens.extend(c.token for c in held[1:])
    head.more_texts.extend(c.text for c in held[1:])
    return head


def expand(c: pb.TokenChunk) -> Iterator[pb.TokenChunk]:
    """One chunk a token, as a host with ``--stream-interval 1`` sends them."""
    if not c.more_tokens:
        yield c
        return
    if len(c.more_texts) != len(c.more_tokens):
        raise RemoteError(f"a chunk at index {c.index} carries {len(c.more_tokens)} tokens "
                         f"but {len(c.more_texts)} texts")
    yield pb.TokenChunk(index=c.index, token=c.token, text=c.text)
    for k, (tok, text) in enumerate(zip(c.more_tokens, c.more_texts), 1):
        yield pb.TokenChunk(index=c.index + k, token=tok, text=text)
