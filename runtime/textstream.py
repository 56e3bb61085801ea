"""A reply's text as it streams: detokenized token by token, holding back whatever
could still turn out to be the start of a stop string, so a client never sees text
that the stop would have cut."""

from __future__ import annotations


class TextStream:
    """Streaming detokenization that holds back a possible stop-string prefix."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.det = tokenizer.detokenizer
        self.det.reset()
        self.stops = stops
        self.emitted = 0

    def _full(self) -> str:
        return self.det.text

    def add(self, token: int) -> str:
        self.det.add_token(token)
        text = self._full()
        safe = len(text)
        for s in self.stops:  # hold back a stop string and any suffix that could start one
            if (at := text.find(s, max(0, self.emitted - len(s)))) >= 0:
                safe = min(safe, at)
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        out = text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return out

    def finish(self, stopped_by_string: bool) -> str:
        self.det.finalize()
        text = self._full()
        if stopped_by_string:
            cut = min((text.find(s) for s in self.stops if s in text), default=len(text))
            text = text[:cut]
        out = text[self.emitted:] if len(text) > self.emitted else ""
        self.emitted = len(text)
        self.final_text = text
        return out
