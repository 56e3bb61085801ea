"""kvferry's exceptions. Every message is one line that names the problem.

The CLI prints ``kvferry: <message>`` and exits non-zero for these; anything
else is a bug and keeps its traceback.
"""


class KvferryError(Exception):
    """Base class for errors caused by input or environment, not by a bug."""


class ModelFormatError(KvferryError):
    """A model file (GGUF, config, weights) is malformed or unsupported."""


class ModelNotFoundError(KvferryError):
    """A model name or path does not resolve to an installed model."""


class ConfigError(KvferryError):
    """An option value is unknown, out of range or contradicts another."""


class ModelMismatchError(KvferryError):
    """A session or checkpoint belongs to another model than the host serves."""
