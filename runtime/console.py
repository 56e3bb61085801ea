"""What every command prints through: JSON for ``--json``."""

from __future__ import annotations

import json


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))
