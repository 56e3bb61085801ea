"""kvferry: LLM conversations as movable actors (Ray hosts, Wasm guests, MLX, gRPC).

The public face is small: ``from kvferry import Client, AsyncClient`` plus the
error classes. Importing it loads grpcio and protobuf only; MLX, wasmtime and
Ray load where a model is hosted (:mod:`kvferry.host`, ``kvferry serve``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from .errors import (AuthError, CheckpointError, ConfigError, GuestError, GuestTrap, HostDownError,  # noqa: F401
                     HostDrainingError, InternalError, KvferryError, MigrationError, ModelMismatchError,
                     ModelNotFoundError, OutOfMemoryError, PromptTooLongError, RemoteError, SessionBusyError,
                     SessionError, SessionExistsError, SessionMovedError, UnknownSessionError)

__version__ = "0.1.0"

# MLX CUDA's cuDNN attention builds a graph for each new shape: ~65 ms on an H200 for
# every prompt chunk (each has a new key length) and for the first decode at each
# 256-token KV size (so in a migrated session's pause), against ~10 ms for a whole
# unfused chunk. Without it, MLX runs prompts unfused and decodes with its vector
# kernel (docs/accelerator.md). Set before MLX loads; an explicit setting wins.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")


class _BLASBeforeMLX:
    """The first import of mlx.core, wherever it happens, loads the optimized BLAS
    first (kvferry.blas). Python loads extensions with RTLD_NOW, so libmlx binds its
    cblas symbols when it loads, and a BLAS loaded after it is never called
    (measured here: a float32 1024^3 matmul took 380 ms instead of 11)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "mlx.core":
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            from .blas import enable

            enable()
        return None  # the usual finders import it


if "mlx.core" not in sys.modules and not any(type(f).__name__ == "_BLASBeforeMLX" for f in sys.meta_path):
    sys.meta_path.insert(0, _BLASBeforeMLX())

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
