"""``python -m kvferry``: the same as the ``kvferry`` command."""

import sys

from .cli import main

sys.exit(main())
