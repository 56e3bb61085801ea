"""How many prompt tokens a step takes beside its decode rows: chunked prefill's budget.

The budget is steered from measured step times toward a step of ~1.3x a plain
decode step, so the decoders' TPOT p99 stays within 2x its p50 while a long
prompt goes in (on a CPU a prompt token costs about what a decode row does). At
1.5x the steps beside a prompt spread to 2.2-2.6x on a 2-core CPU's noise, and
the p99 with them (docs/performance-log.md); the price is a long prompt that goes in
more slowly while others decode.

Where even the smallest chunk costs more than that, shrinking buys nothing. On an
H200 a prompt pass of 4 tokens costs what one of 128 does (~11 ms beside a 12 ms
decode step of SmolLM2: it is launch-bound), so a budget steered to 1.5x (then the
target) sat at 4 tokens and a 2k prompt crawled in at 4 tokens a step. There the
target becomes that floor plus a quarter of a decode step, and the chunk grows
until its tokens start to cost: the prompt goes in at a few such steps, as with
vLLM's fixed ``max_num_batched_tokens``.

The smallest chunk is per device. On a GPU it is ``FLOOR`` tokens, which cost what one
does. On a CPU a prompt token is not cheap: SmolLM2's ~3.4 ms a token at a short
context grows with the prompt's length (its attention), so that beside 4 decode rows
of 79 ms, 4 tokens at 2k tokens in cost 1.86x. At a floor of 4 that read as a fixed
cost past ``FIXED``, the target rose to ~2.1x, and the decoders' p99 went over 2x
(docs/performance-log.md); there the floor is one token (1.39x at 2k).
"""

from __future__ import annotations

FLOOR = 4  # prompt tokens a step beside decodes at least on a GPU (the floor's cost is measured there)
CPU_FLOOR = 1  # on a CPU, where each token costs (see the module docstring)
CEILING = 4096
TARGET = 1.3  # a step with prompt tokens over a plain decode step
BAND = 0.1  # no change while within TARGET +- BAND
FIXED = 1.75  # a floor above this: the smallest chunk's cost is mostly fixed (a CPU's is ~1.1-1.5)
HEADROOM = 0.25  # over the floor's ratio, where the floor is above FIXED


class PromptBudget:
    """Prompt tokens for the next step beside decodes (``tokens``), from each step's
    time (:meth:`observe`). Not thread-safe: the step thread alone uses it."""

    def __init__(self, tokens: int = 16, floor: int = FLOOR) -> None:
        self.tokens = tokens
        self.floor = floor  # the smallest chunk beside decodes
        self.decode_s = 0.0  # EMA of a plain decode step's time
        self.fixed_s = 0.0  # EMA of what a step with the floor's prompt tokens costs over a plain one

    @property
    def target(self) -> float:
        """The step time to steer to, over a plain decode step's."""
        if not self.decode_s:
            return TARGET
        floor = 1 + self.fixed_s / self.decode_s  # what the smallest chunk costs now
        return TARGET if floor <= FIXED else floor + HEADROOM

    def observe(self, rows: int, prompt_tokens: int, dt: float) -> None:
        """A step of ``rows`` decode rows and ``prompt_tokens`` prompt tokens took ``dt`` s."""
        if not rows:
            return  # a prompt-only step says nothing about the decoders' latency
        if not prompt_tokens:
            self.decode_s = 0.8 * self.decode_s + 0.2 * dt if self.decode_s else dt
            return
        if not self.decode_s:
            return
        if prompt_tokens <= self.floor:
            extra = max(0.0, dt - self.decode_s)
            self.fixed_s = 0.7 * self.fixed_s + 0.3 * extra if self.fixed_s else extra
        target = self.target
        ratio = dt / self.decode_s
        if ratio > target + BAND:
            self.tokens = max(self.floor, int(self.tokens * 0.7))
        elif ratio < target - BAND:
            fast = target > TARGET and ratio < target - 3 * BAND  # far below a floor-raised target
            self.tokens = min(CEILING, self.tokens * 2 if fast else int(self.tokens * 1.25) + 1)
