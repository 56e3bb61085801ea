"""Where kvferry keeps its files, and the token a local host and its clients share."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def home() -> Path:
    """``$KVFERRY_HOME``, default ``~/.cache/kvferry``: models, caches, the local token."""
    return Path(os.environ.get("KVFERRY_HOME", Path.home() / ".cache" / "kvferry"))


def default_token() -> str | None:
    """``$KVFERRY_TOKEN``, else the token ``kvferry serve`` wrote for this user."""
    if tok := os.environ.get("KVFERRY_TOKEN"):
        return tok
    p = home() / "token"
    return p.read_text().strip() if p.exists() else None


def ensure_token(token: str | None, no_auth: bool) -> str | None:
    """The token to serve with: given, ``$KVFERRY_TOKEN``, or one generated once and
    kept in ``$KVFERRY_HOME/token`` (mode 0600) so local clients find it."""
    if no_auth:
        return None
    if token or (token := default_token()):
        return token
    p = home() / "token"
    p.parent.mkdir(parents=True, exist_ok=True)
    tok = secrets.token_urlsafe(32)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process wrote it first
        return p.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(tok + "\n")
    return tok
