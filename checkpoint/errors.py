"""Checkpoint errors (defined with every other kvferry error in :mod:`kvferry.errors`)."""

from ..errors import CheckpointError, CheckpointModelError, OutOfMemoryError

__all__ = ["CheckpointError", "CheckpointModelError", "OutOfMemoryError"]
