"""Real faults of a disk and of another process, for tests: a small tmpfs (root only), filled to
the last byte; an exclusive SQLite lock held by another process until released."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HOLD_LOCK = textwrap.dedent(
    """
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    sys.stdin.readline()  # held until the test says so
    db.execute("ROLLBACK")
    """
)


def mount_tmpfs(path: Path, options: str) -> bool:
    """Mount a tmpfs with ``options`` (``"size=256k"``, ``"ro,size=1m"``) at ``path``; False when
    not root or the mount fails."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, name: str = "filler") -> Path:
    """Write a file into ``directory`` until its filesystem has no byte left; returns the file
    (remove it to free the space)."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (65536, 512):  # large writes first, then the last few blocks
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return path


class LockHolder:
    """Another process holding an exclusive lock on the SQLite database ``db`` until ``release``."""

    def __init__(self, db: Path) -> None:
        if not db.exists():  # the lock needs the file: make it as Trackio would
            sqlite3.connect(db).close()
        self._proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, "-c", _HOLD_LOCK, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "locked"

    def release(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            proc.stdin.write("\n")
            proc.stdin.close()
            proc.wait(timeout=30)


@contextmanager
def locked(db: Path) -> Iterator[LockHolder]:
    holder = LockHolder(db)
    try:
        yield holder
    finally:
        holder.release()
