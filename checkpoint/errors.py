"""Checkpoint errors: one line naming the frame and the problem."""

from runtime.errors import KvferryError


class CheckpointError(KvferryError):
    """A checkpoint is corrupt, truncated, hostile or does not fit this host."""
