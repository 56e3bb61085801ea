"""A stand-in for libcudart, for tests of the copy-engine paths on a CPU."""

import ctypes


class FakeCudaRuntime:
    """Stands in for libcudart (kvferry.checkpoint.unified._Runtime): records each
    prefetch as (where, bytes) and answers ``err``, each page-locking's bytes, and
    each copy's bytes (made for real over host pointers, or failed with ``copy_err``)."""

    def __init__(self):
        self.moves, self.err, self.copies, self.copy_err, self.pinned = [], 0, [], 0, []

    def prefetch(self, ptr, nbytes, where):
        self.moves.append((where, nbytes))
        return self.err

    def sync(self):
        return 0

    def register(self, ptr, nbytes):
        self.pinned.append(nbytes)
        return 0

    def copy_2d(self, dst, dpitch, src, spitch, width, height):  # host memory here: copied for real
        self.copies.append(width * height)
        if self.copy_err:
            return self.copy_err
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return 0
