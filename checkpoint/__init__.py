"""kvferry checkpoints: versioned, compressed, streamable conversation snapshots
(format in ``frames``, KV codecs in ``codecs``, save/restore in ``snapshot``;
user docs in docs/checkpoint.md)."""
