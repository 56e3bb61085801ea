"""Each decode row's greedy token and its logit, computed on the device with the step.

A greedy guest asks for one thing a token: ``kv_logits_topk(1)``. Answered from the
row's logits on the host, it made MLX CUDA copy the step's whole float32 logits out
of device memory at the first read (196 KB a row of SmolLM2's vocabulary, 12.6 MB a
step at 64 rows): 0.11-0.15 ms of host time a read on an H200, and a bare pipelined
decode of the 1B shape lost 0.25 ms a token to it on one machine, nothing measurable
on another (docs/performance-log.md, "Host reads of the logits"). So on an
accelerator the scheduler computes each row's (argmax, max) beside the logits, in
the step's own graph, and the host reads 8 bytes a row, once a step; a speculated
step is built on the same argmax. On a CPU numpy reads the logits in place, faster
than MLX's argmax over the batch, so there only a speculating step makes one. A
guest that reads the logits themselves (``kv_logits``, or top-k for k > 1) still
gets them, evaluated as before.
"""

from __future__ import annotations

from typing import Any


class StepTop1:
    """One step's rows' greedy (token, float32 bits of its logit): build it from the
    step's float32 logits rows, evaluate :attr:`pairs` with the step, then
    :meth:`row` from any thread (the first call reads all rows at once)."""

    __slots__ = ("pairs", "_host")

    def __init__(self, logits: list) -> None:
        import mlx.core as mx

        batch = getattr(logits, "batch", None)  # a step's rows as one array (kvferry.step_forward.RowLogits)
        if batch is None:
            batch = logits[0][None] if len(logits) == 1 else mx.stack(logits)
        # argmax and numpy's argmax both take the first of equal maxima
        self.pairs = mx.stack([mx.argmax(batch, axis=-1).astype(mx.int32),
                               mx.max(batch, axis=-1).view(mx.int32)], axis=1)
        self._host: list | None = None

    @property
    def ids(self) -> Any:
        """The rows' greedy tokens, a device array (for the speculated next step)."""
        return self.pairs[:, 0]

    def row(self, i: int) -> tuple[int, int]:
        if self._host is None:  # (two threads racing here both read the same values)
            self._host = self.pairs.tolist()
        token, bits = self._host[i]
        return token, bits
