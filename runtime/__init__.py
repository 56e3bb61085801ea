"""kvferry: LLM conversations as movable actors (Ray hosts, Wasm guests, MLX, gRPC).

The public face is small: ``from kvferry import Client, AsyncClient`` plus the
error classes. Importing it loads grpcio and protobuf only; MLX, wasmtime and
Ray load where a model is hosted (:mod:`kvferry.host`, ``kvferry serve``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .errors import (AuthError, CheckpointError, ConfigError, GuestError, GuestTrap, HostDownError,  # noqa: F401
                     HostDrainingError, KvferryError, MigrationError, ModelMismatchError, ModelNotFoundError,
                     OutOfMemoryError, PromptTooLongError, RemoteError, SessionBusyError, SessionError,
                     SessionExistsError, SessionMovedError, UnknownSessionError)

__version__ = "0.1.0"

# MLX CUDA's cuDNN attention builds a graph for each new shape: ~65 ms on an H200 for
# every prompt chunk (each has a new key length) and for the first decode at each
# 256-token KV size (so in a migrated session's pause), against ~10 ms for a whole
# unfused chunk. Without it, MLX runs prompts unfused and decodes with its vector
# kernel (docs/accelerator.md). Set before MLX loads; an explicit setting wins.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

_SDK = ("Client", "AsyncClient", "RemoteSession", "AsyncRemoteSession", "Migration")
if TYPE_CHECKING:
    from .sdk import AsyncClient, AsyncRemoteSession, Client, Migration, RemoteSession  # noqa: F401


def __getattr__(name: str) -> Any:
    # The SDK loads on first use, so `import kvferry.checkpoint` (or a Ray worker) pays nothing for gRPC.
    if name in _SDK:
        from . import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'kvferry' has no attribute {name!r}")


__all__ = [*_SDK, "__version__", "KvferryError", "RemoteError", "AuthError", "HostDownError",
           "UnknownSessionError", "ModelMismatchError", "SessionError", "SessionBusyError", "PromptTooLongError",
           "ConfigError", "GuestError", "GuestTrap", "CheckpointError", "OutOfMemoryError", "MigrationError",
           "ModelNotFoundError", "HostDrainingError", "SessionExistsError", "SessionMovedError"]
