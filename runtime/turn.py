"""A reply in progress: the events it streams, its stats, and the loop that runs it.

A turn is one guest-driven reply. :func:`run_reply` asks the host's step
scheduler for the guest's next token, step after step, and holds the host's hard
limits (max tokens, context) whatever the guest does; :class:`TurnState` is what a
checkpoint taken mid-reply carries of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import SessionError
from .textstream import TextStream

STOP_CODES = {-1: "stop", -2: "stop", -3: "length"}


@dataclass
class TokenEvent:
    token: int
    text: str  # new text to show (may be empty while a stop string is possible)
    index: int
    finish_reason: str | None = None  # set on the turn's last event: stop | length


@dataclass
class TurnStats:
    prompt_tokens: int = 0  # tokens prefilled this turn (the new ones)
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    finish_reason: str | None = None
    text: str = ""
    tokens: list[int] = field(default_factory=list)


@dataclass
class TurnState:
    """A turn in progress: what a checkpoint taken mid-generation must carry."""
    n_prompt: int
    record: bool
    tokens: list[int]
    texts: list[str]  # the text streamed with each token
    stream: "TextStream"
    max_tokens: int = 0  # this turn's limit (0: the session's)


def run_reply(session: Any, turn: TurnState, replay_from: int | None) -> Iterator[TokenEvent]:
    """Generate ``turn``'s reply on ``session`` until the guest stops or a limit does;
    the last event carries the finish reason (and ``session.last`` the turn's stats)."""
    metrics = session.host.metrics
    t_last = 0.0
    stats = TurnStats(prompt_tokens=turn.n_prompt)
    t0 = time.perf_counter()
    t_first = None
    finish = None
    stopped_by_string = False
    n_new = 0
    while True:
        i = len(turn.tokens)
        if session.at_length(turn, i):
            finish = "length"  # the host's hard limit, whatever the guest does
            break
        t_step = time.perf_counter()
        # a decode step runs the guest on the host's step thread where it can (kvferry.batching)
        tok = session.host.steps.guest_step(session, turn.tokens[-1] if n_new else None)
        session.last_used = time.monotonic()
        if n_new:  # the first step of a turn includes its prefill
            dt = time.perf_counter() - t_step
            session.step_seconds = 0.8 * session.step_seconds + 0.2 * dt if session.step_seconds else dt
        if tok < 0:
            if tok not in STOP_CODES:
                raise SessionError(f"guest '{session.guest.name}' returned unknown code {tok}")
            finish = STOP_CODES[tok]
            stopped_by_string = tok == -2
            break
        if tok >= session.vocab_size:
            session.guest.dead = f"emitted token id {tok}"
            raise SessionError(f"guest '{session.guest.name}' emitted token id {tok}, outside "
                               f"the vocabulary (0..{session.vocab_size - 1})")
        now = time.perf_counter()
        metrics.generated_tokens.inc()
        if t_first is not None:
            metrics.tpot.observe(now - t_last)
        elif replay_from is None:
            metrics.ttft.observe(now - t0)
        t_last = now
        if t_first is None:
            t_first = now
            stats.prompt_tps = turn.n_prompt / max(now - t0, 1e-9) if replay_from is None else 0.0
        text = turn.stream.add(tok)
        turn.tokens.append(tok)
        turn.texts.append(text)
        n_new += 1
        yield TokenEvent(tok, text, i)
    t_end = time.perf_counter()
    tail = turn.stream.finish(stopped_by_string)
    stats.finish_reason = finish
    metrics.turns.labels(finish or "stop").inc()
    stats.tokens = list(turn.tokens)
    stats.generation_tokens = len(turn.tokens)
    if t_first is not None and n_new > 1:
        stats.generation_tps = (n_new - 1) / max(t_end - t_first, 1e-9)
    stats.text = turn.stream.final_text
    session.last = stats
    session.turn = None
    if turn.record:
        session.messages.append({"role": "assistant", "content": stats.text})
    yield TokenEvent(-1, tail, len(turn.tokens), finish)
