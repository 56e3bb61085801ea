"""kvferry runtime: movable LLM conversations on MLX, driven by Wasm guests."""

from . import blas as _blas

# Must run before anything imports mlx: it decides which BLAS libmlx binds to.
_blas.enable()

__version__ = "0.1.0"
