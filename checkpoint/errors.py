"""Checkpoint errors: one line naming the frame and the problem."""

from runtime.errors import KvferryError


class CheckpointError(KvferryError):
    """A checkpoint is corrupt, truncated, hostile or does not fit this host."""


class OutOfMemoryError(CheckpointError):
    """The session's KV does not fit the memory this host may use."""
