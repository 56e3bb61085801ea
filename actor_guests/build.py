"""Build the guests to wasm32 with the ziglang toolchain: ``make guests``.

Builds are reproducible: same sources + same ziglang -> same bytes (a test
rebuilds and compares against the committed .wasm files).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (max linear memory bytes, shadow-stack bytes)
GUESTS = {
    "gemm": (32 << 20, 64 << 10),
    "chat": (4 << 20, 64 << 10),
    "digits": (4 << 20, 64 << 10),
}


def command(src: Path, out: Path, max_memory: int, stack: int) -> list[str]:
    return [sys.executable, "-m", "ziglang", "cc", "--target=wasm32-freestanding", "-nostdlib",
            "-O2", "-Wl,--no-entry", f"-Wl,--max-memory={max_memory}",
            f"-Wl,-z,stack-size={stack}", "-Wl,--strip-debug", f"-I{src.parent}", src.name,
            "-o", str(out)]


def build(name: str, out_dir: Path = HERE, src_dir: Path = HERE) -> Path:
    max_memory, stack = GUESTS[name]
    out = Path(out_dir).resolve() / f"{name}.wasm"
    # relative source path + fixed cwd: nothing machine-specific in the output
    subprocess.run(command(Path(src_dir) / f"{name}.c", out, max_memory, stack),
                   cwd=src_dir, check=True)
    return out


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else HERE
    for name in GUESTS:
        print(f"built {build(name, out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
