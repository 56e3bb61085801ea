"""The device a host computes on, and what that device implies.

One place answers "CPU or GPU, and which": the loader's dtype policy, seed 003's
placement, health, and every benchmark's ``--json`` read it here.

The dtype policy per device (``--dtype auto``):

- **CPU**: float32 weights and KV. MLX's CPU backend is slow for half and
  quantized matmuls, so imported Q4/Q8 weights are dequantized and the GEMMs run
  on the optimized BLAS (:mod:`kvferry.blas`).
- **GPU** (CUDA or Metal): imported quantized weights stay quantized (memory
  bandwidth is the decode bound there) and everything else, so activations and
  the KV cache, is float16, as llama.cpp's default ``f16`` KV cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from .paths import home

KERNEL_CACHE = "MLX_PTX_CACHE_DIR"


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" | "gpu"
    backend: str  # "cpu" | "cuda" | "metal"
    name: str  # what the device calls itself (e.g. "NVIDIA H200", "AMD EPYC")
    memory_gb: float | None  # the accelerator's memory; None on a CPU
    blas: str = "unset"  # the BLAS MLX's CPU matmuls call (kvferry.blas): "reference" is ~30x slower

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "backend": self.backend, "name": self.name, "memory_gb": self.memory_gb,
                "blas": self.blas}

    def __str__(self) -> str:
        mem = f", {self.memory_gb:.0f} GB" if self.memory_gb else ""
        return f"{self.backend} ({self.name}{mem})"


def keep_kernels() -> str:
    """Where MLX's CUDA backend keeps the kernels it compiles: under $KVFERRY_HOME,
    one folder per MLX version, unless ``MLX_PTX_CACHE_DIR`` says otherwise. MLX's
    own default, /tmp/mlx/VERSION/ptx, is gone after a reboot that clears /tmp, and
    a second user of the machine cannot write into the first one's. A fresh H100
    host compiles for minutes on its first requests (docs/accelerator.md); with the
    kernels kept, only a machine's first start does. Call before MLX compiles anything."""
    if not os.environ.get(KERNEL_CACHE):
        try:
            version = metadata.version("mlx")
        except metadata.PackageNotFoundError:
            version = "unknown"
        os.environ[KERNEL_CACHE] = str(home() / "mlx-kernels" / version)
    return os.environ[KERNEL_CACHE]


def current() -> Device:
    """The device MLX computes on by default in this process."""
    import mlx.core as mx

    from .blas import enable

    blas = enable()["kind"]  # (a no-op when importing mlx.core above already ran it)
    if mx.default_device() != mx.gpu:
        info = _info(mx, mx.cpu)
        return Device("cpu", "cpu", str(info.get("device_name") or info.get("architecture") or "cpu"), None, blas)
    backend = "cuda" if _available(mx, "cuda") else "metal" if _available(mx, "metal") else "gpu"
    info = _info(mx, mx.gpu)
    mem = info.get("memory_size") or info.get("total_memory")
    return Device("gpu", backend, str(info.get("device_name") or backend),
                  round(mem / 2**30, 1) if isinstance(mem, (int, float)) and mem else None, blas)


def _available(mx, backend: str) -> bool:
    mod = getattr(mx, backend, None)
    try:
        return bool(mod is not None and mod.is_available())
    except Exception:
        return False


def _info(mx, dev) -> dict:
    try:
        return dict(mx.device_info(dev)) if hasattr(mx, "device_info") else {}
    except Exception:
        return {}


def weight_policy(dev: Device | None = None) -> str:
    """``--dtype auto`` on this device: "float32" (dequantize, CPU) or
    "quantized" (keep quantized weights, float16 for the rest: GPU)."""
    return "quantized" if (dev or current()).is_gpu else "float32"


GPU_HALF = "float16"  # activations and KV on a GPU under --dtype auto
