"""WebAssembly guests (C sources, built ``.wasm``) and the guest ABI (ABI.md)."""

from pathlib import Path

GUESTS_DIR = Path(__file__).parent
