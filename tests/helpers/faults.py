"""Faults in one process: ``os.fdopen`` whose files fail their writes as a full disk fails them, and a
stand-in for a function that raises."""

import errno
import os

_FDOPEN = os.fdopen  # the real one, whatever a test has patched since


class FullDisk:
    """``file``, whose writes fail with ENOSPC naming no file, as the OS's do; the rest is the file's."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.file, name)


class FullAtClose:
    """``file``, whose close (the flush of its last buffered writes) fails with ENOSPC after closing
    it, as a full disk's does; its writes and the rest are the file's."""

    def __init__(self, file):
        self.file = file

    def close(self):
        self.file.close()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


def full_disk_fdopen(fails=lambda fd, opened: True):
    """An ``os.fdopen`` (for ``monkeypatch.setattr(lm.io.os, "fdopen", ...)``) whose file is a
    :class:`FullDisk` where ``fails(fd, opened)`` (``opened``: the files opened so far, this one
    included, counted from 1)."""
    opened = 0

    def fdopen(fd, *args, **kwargs):
        nonlocal opened
        file = _FDOPEN(fd, *args, **kwargs)
        opened += 1
        return FullDisk(file) if fails(fd, opened) else file

    return fdopen


def raising(error: BaseException):
    """A stand-in for any function (any arguments) that raises ``error``."""

    def fails(*args, **kwargs):
        raise error

    return fails


class Exited(Exception):
    """Raised by :func:`exit_now` where ``os._exit(status)`` would end the test run: ``args == (status,)``."""


def exit_now(status: int):
    """A stand-in for ``os._exit`` (``monkeypatch.setattr(os, "_exit", exit_now)``): raises :class:`Exited`."""
    raise Exited(status)
