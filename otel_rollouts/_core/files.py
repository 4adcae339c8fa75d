"""Opening a file that will hold recorded content (prompts, completions): privately, safely.

Every file the library writes holds what a run's episodes said; one opened carelessly sends it
to whoever planted the path: a symbolic link to a file they read, or a world-writable file of
theirs. ``open_private`` opens the way the spool does (``otel_rollouts.delivery.spool``): the
last component is never followed (``O_NOFOLLOW``), the file must be a regular file of this
user with a single link, and it is left with mode 0600 (a file of ours that existed with a
wider mode is narrowed). Anything else is refused with ``UnsafeFileError`` (an ``OSError``, so
a writer's usual error path counts it), and nothing is written.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["FILE_MODE", "UnsafeFileError", "open_private"]

FILE_MODE = 0o600


class UnsafeFileError(OSError):
    """A path that must not receive recorded content (the message says why)."""


def open_private(path: str | os.PathLike[str], flags: int, mode: int = FILE_MODE) -> int:
    """A file descriptor for ``path`` opened with ``flags`` (``O_WRONLY|O_APPEND|O_CREAT``...)
    plus ``O_NOFOLLOW`` and ``O_CLOEXEC``; ``UnsafeFileError`` when the path is a symbolic link,
    not a regular file, another user's, or hard-linked elsewhere; other ``OSError`` as raised."""
    flags |= os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise UnsafeFileError(errno.ELOOP, "refused: a symbolic link", str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        why = None
        if not stat.S_ISREG(info.st_mode):
            why = "refused: not a regular file"
        elif info.st_uid != os.getuid():
            why = "refused: the file belongs to another user"
        elif info.st_nlink != 1:
            why = "refused: the file has other hard links"
        if why is not None:
            raise UnsafeFileError(errno.EPERM, why, str(path))
        if stat.S_IMODE(info.st_mode) & ~mode:
            os.fchmod(fd, mode)  # ours, with a wider mode: narrowed before anything is written
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
