"""GGUF container: a validating header reader and a small writer.

The tensor *data* is read by ``mlx.core.load`` (native, fast, and it returns
Q4_0/Q4_1/Q8_0 as MLX packed weights + scales + biases). This module reads the
header in Python first so that a truncated, hostile or unsupported file fails
with one line naming the problem, before any native code touches it.

The writer exists so tests can build real GGUF files (tiny random llamas, every
supported tensor type, deliberately broken files) without a model hub.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
}
TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}
SUPPORTED_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")

# metadata value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_SCALAR = {
    _U8: "<B", _I8: "<b", _U16: "<H", _I16: "<h", _U32: "<I", _I32: "<i",
    _F32: "<f", _BOOL: "<?", _U64: "<Q", _I64: "<q", _F64: "<d",
}
_NP_ARRAY = {
    _U8: np.uint8, _I8: np.int8, _U16: np.uint16, _I16: np.int16, _U32: np.uint32,
    _I32: np.int32, _F32: np.float32, _BOOL: np.bool_, _U64: np.uint64,
    _I64: np.int64, _F64: np.float64,
}
_MAX_COUNT = 1 << 24  # no real model has 16M tensors or metadata keys


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), as MLX returns it
    type_id: int
    offset: int  # absolute offset of the data in the file

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, (f"type#{self.type_id}", 0, 0))[0]

    @property
    def nbytes(self) -> int:
        _, block, size = GGML_TYPES[self.type_id]
        n = int(np.prod(self.shape)) if self.shape else 1
        return (n // block) * size


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Reader:
    def __init__(self, f: BinaryIO, size: int, path: Path):
        self.f, self.size, self.path = f, size, path

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path.name}: {what}")

    def read(self, n: int, what: str) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.fail(f"truncated file: {what} extends past the end of the file "
                            f"(file has {self.size} bytes)")
        return self.f.read(n)

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.read(n, what)
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype], f"metadata '{key}'")
        if vtype == _STR:
            return self.string(f"metadata '{key}'")
        if vtype == _ARR:
            etype = self.scalar("<I", f"metadata '{key}'")
            count = self.scalar("<Q", f"metadata '{key}'")
            if count > self.size:
                raise self.fail(f"metadata '{key}' declares {count} elements, more than the file holds")
            if etype in _NP_ARRAY:
                dt = np.dtype(_NP_ARRAY[etype]).newbyteorder("<")
                raw = self.read(count * dt.itemsize, f"metadata '{key}'")
                return np.frombuffer(raw, dtype=dt).copy()
            if etype == _STR:
                return [self.string(f"metadata '{key}'") for _ in range(count)]
            raise self.fail(f"metadata '{key}' has an array of unsupported type {etype}")
        raise self.fail(f"metadata '{key}' has unknown value type {vtype}")


def read_header(path: str | os.PathLike) -> GGUFFile:
    """Read and validate a GGUF header (metadata and tensor table), not the data."""
    p = Path(path)
    if not p.is_file():
        raise ModelFormatError(f"{p}: no such file")
    size = p.stat().st_size
    with open(p, "rb") as f:
        r = _Reader(f, size, p)
        if size < 24 or f.read(4) != GGUF_MAGIC:
            raise ModelFormatError(f"{p.name}: not a GGUF file (bad magic)")
        version = r.scalar("<I", "version")
        if version not in (2, 3):
            raise r.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = r.scalar("<Q", "tensor count")
        n_kv = r.scalar("<Q", "metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            raise r.fail(f"header declares an absurd size ({n_tensors} tensors, {n_kv} keys)")
        g = GGUFFile(p, version)
        for _ in range(n_kv):
            key = r.string("metadata key")
            vtype = r.scalar("<I", f"metadata '{key}'")
            g.metadata[key] = r.value(vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = r.string("tensor name")
            ndim = r.scalar("<I", f"tensor '{name}'")
            if ndim > 8:
                raise r.fail(f"tensor '{name}' has {ndim} dimensions")
            dims = [r.scalar("<Q", f"tensor '{name}'") for _ in range(ndim)]
            tid = r.scalar("<I", f"tensor '{name}'")
            off = r.scalar("<Q", f"tensor '{name}'")
            infos.append((name, tuple(reversed(dims)), tid, off))
        align = int(g.metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        data_start = -(-f.tell() // align) * align
    for name, shape, tid, off in infos:
        t = TensorInfo(name, shape, tid, data_start + off)
        if tid in GGML_TYPES:
            block = GGML_TYPES[tid][1]
            if shape and shape[-1] % block and t.type_name in SUPPORTED_TYPES:
                raise ModelFormatError(f"{p.name}: tensor '{name}' row length {shape[-1]} "
                                       f"is not a multiple of the {t.type_name} block size {block}")
            if not (shape and shape[-1] % block) and t.offset + t.nbytes > size:
                raise ModelFormatError(
                    f"{p.name}: truncated file: tensor '{name}' data extends past the end of "
                    f"the file (needs {t.offset + t.nbytes} bytes, file has {size})")
        g.tensors[name] = t
    return g


def check_tensor_types(g: GGUFFile, supported: tuple[str, ...] = SUPPORTED_TYPES) -> None:
    for t in g.tensors.values():
        if t.type_name not in supported:
            raise ModelFormatError(
                f"{g.path.name}: unsupported tensor type {t.type_name} in '{t.name}' "
                f"(supported: {', '.join(supported)})")


# ----------------------------------------------------------------------------- writer

def _quantize_blocks(a: np.ndarray, type_name: str) -> bytes:
    """Encode float32 rows into ggml blocks (reference quantizers, as llama.cpp's)."""
    x = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, 32)
    if type_name == "Q8_0":
        amax = np.abs(x).max(axis=1, keepdims=True)
        d = amax / 127.0
        q = np.round(np.where(d > 0, x / np.where(d > 0, d, 1), 0)).astype(np.int8)
        out = np.zeros(len(x), dtype=[("d", "<f2"), ("q", "i1", 32)])
        out["d"], out["q"] = d[:, 0], q
    elif type_name == "Q4_0":
        idx = np.abs(x).argmax(axis=1)
        mx_ = x[np.arange(len(x)), idx][:, None]
        d = mx_ / -8.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
        q = np.clip(np.floor(x * inv + 8.5), 0, 15).astype(np.uint8)
        out = np.zeros(len(x), dtype=[("d", "<f2"), ("q", "u1", 16)])
        out["d"], out["q"] = d[:, 0], q[:, :16] | (q[:, 16:] << 4)
    elif type_name == "Q4_1":
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        d = (hi - lo) / 15.0
        inv = np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0)
        q = np.clip(np.floor((x - lo) * inv + 0.5), 0, 15).astype(np.uint8)
        out = np.zeros(len(x), dtype=[("d", "<f2"), ("m", "<f2"), ("q", "u1", 16)])
        out["d"], out["m"], out["q"] = d[:, 0], lo[:, 0], q[:, :16] | (q[:, 16:] << 4)
    else:
        raise ValueError(f"cannot encode {type_name}")
    return out.tobytes()


def _encode(a: np.ndarray, type_name: str) -> bytes:
    if type_name == "F32":
        return np.ascontiguousarray(a, dtype="<f4").tobytes()
    if type_name == "F16":
        return np.ascontiguousarray(a, dtype="<f2").tobytes()
    return _quantize_blocks(a, type_name)


def _pack_value(v: Any) -> bytes:
    def s(x: str) -> bytes:
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    if isinstance(v, bool):
        return struct.pack("<I?", _BOOL, v)
    if isinstance(v, int):
        return struct.pack("<Ii", _I32, v) if -2**31 <= v < 2**31 else struct.pack("<Iq", _I64, v)
    if isinstance(v, float):
        return struct.pack("<If", _F32, v)
    if isinstance(v, str):
        return struct.pack("<I", _STR) + s(v)
    if isinstance(v, np.ndarray):
        code = {np.dtype(t): c for c, t in _NP_ARRAY.items()}[v.dtype]
        return struct.pack("<IIQ", _ARR, code, v.size) + v.astype(v.dtype.newbyteorder("<")).tobytes()
    if isinstance(v, (list, tuple)):
        if all(isinstance(e, str) for e in v):
            return struct.pack("<IIQ", _ARR, _STR, len(v)) + b"".join(s(e) for e in v)
        return _pack_value(np.asarray(v, dtype=np.float32 if any(isinstance(e, float) for e in v) else np.int32))
    raise TypeError(f"cannot store {type(v).__name__} in GGUF metadata")


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any],
               tensors: dict[str, tuple[np.ndarray, str]], *, raw_types: dict[str, int] | None = None) -> None:
    """Write a GGUF v3 file. ``tensors`` maps name -> (float array, type name).

    ``raw_types`` forces a tensor's declared type id (tests use it to write files
    with types kvferry does not support)."""
    raw_types = raw_types or {}
    blobs, infos = [], b""
    offset = 0
    for name, (arr, tname) in tensors.items():
        data = _encode(arr, tname) if tname in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0") else bytes(arr)
        tid = raw_types.get(name, TYPE_IDS.get(tname, 0))
        nb = name.encode()
        dims = list(reversed(arr.shape))
        infos += struct.pack("<Q", len(nb)) + nb + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", tid, offset)
        pad = (-len(data)) % DEFAULT_ALIGNMENT
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    kv = b"".join(struct.pack("<Q", len(k.encode())) + k.encode() + _pack_value(v)
                  for k, v in metadata.items())
    head = GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(metadata)) + kv + infos
    head += b"\0" * ((-len(head)) % DEFAULT_ALIGNMENT)
    with open(path, "wb") as f:
        f.write(head)
        for b in blobs:
            f.write(b)
