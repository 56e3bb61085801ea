import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from kvferry import blas  # noqa: E402

blas.enable()  # the optimized BLAS before anything imports MLX


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    from tinyllama import write_tiny_gguf

    p = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_gguf(p)
    return p


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf, tmp_path_factory) -> Path:
    from kvferry.convert import import_gguf

    return import_gguf(tiny_gguf, tmp_path_factory.mktemp("models") / "tiny-llama", progress=False)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    from kvferry.models import resolve

    return resolve(None, progress=False)


@pytest.fixture(scope="session")
def smollm(smollm_dir):
    from kvferry.models import load

    return load(smollm_dir)
