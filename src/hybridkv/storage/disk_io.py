"""Positioned writes that finish: :func:`pwrite_all` and :func:`pwritev_all` resume after a
short write and raise :class:`OSError` when the file takes nothing, for
:class:`~hybridkv.storage.disk_slots.DiskSlots`."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

__all__ = ["IOV_MAX", "pwrite_all", "pwritev_all"]

#: Pieces one ``pwritev`` takes at most (the POSIX minimum of ``IOV_MAX``, 1024 on Linux).
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write ``data`` at ``offset`` of ``fd``, all of it."""
    view = memoryview(data)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        offset += n


def pwritev_all(fd: int, pieces: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``pieces`` back to back from ``offset``: one ``pwritev`` when they fit one (at
    most :data:`IOV_MAX` of them), else one per :data:`IOV_MAX`, resumed after a short
    write."""
    if len(pieces) <= IOV_MAX:
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        n = os.pwritev(fd, pieces, offset)
        if n == total:
            return
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        _rest(fd, pieces, offset, n)
        return
    _rest(fd, pieces, offset, 0)


def _rest(fd: int, pieces: Sequence[bytes | memoryview], offset: int, done: int) -> None:
    """Write what is left of ``pieces`` after the first ``done`` bytes of them."""
    views = [memoryview(v).cast("B") for v in pieces]
    views = [v for v in views if v.nbytes]
    at = 0
    n = done
    while True:
        offset += n
        while at < len(views) and n >= views[at].nbytes:
            n -= views[at].nbytes
            at += 1
        if n:
            views[at] = views[at][n:]
        if at >= len(views):
            return
        n = os.pwritev(fd, views[at : at + IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
