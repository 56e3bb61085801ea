"""kvferry checkpoints: versioned, compressed, streamable conversation snapshots.

Format and codecs land with the checkpoint issue; see docs/ once it does.
"""
