"""A bounded on-disk spool of export batches that an exporter could not deliver (yet).

Each batch is one file holding an OTLP ``ExportTraceServiceRequest`` in its protobuf encoding
(the collector's own wire format: nothing custom, replayable by any OTLP tool). Files are
created ``0600`` in a ``0700`` directory, written to a temporary name and renamed, so a crash
never leaves a half batch behind. The spool has a byte cap: when a new batch does not fit, the
*oldest* batches are deleted first and the episodes they held are counted as dropped.

A spool directory that already holds batches (a previous process died with the collector down)
is picked up: those batches are delivered first.

The directory is untrusted input: a file that is not a regular file (a symlink, a FIFO), is
larger than the cap, does not decode, or is named like no batch of ours is moved to
``quarantine/`` (at most ``_QUARANTINE_KEEP`` files are kept there), reported through
``on_quarantine`` and never blocks the batches behind it. Files are read outside the lock,
opened without following links and without blocking, so a FIFO cannot hang ``stats()`` or
``shutdown()``.

One process per directory: an advisory lock (``.lock``, ``flock``) is held while the spool is
open. A second process given the same directory spools into a sub-directory of its own
(``pid-<pid>``), which the next process that holds the main lock adopts once its owner is gone.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import stat
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts._core.codec import decode

_SUFFIX = ".otlp"
_NAME = re.compile(r"^(\d{12})-(\d{1,9})\.otlp$")
_LOCK = ".lock"
_QUARANTINE = "quarantine"
_QUARANTINE_KEEP = 64
_OWN_PREFIX = "pid-"

Quarantine = Callable[[str, int, str, "tuple[int, ...] | None"], None]
# (file name, episodes it held, reason, trace ids when this process wrote it)
Dropped = list[tuple[int, "tuple[int, ...] | None"]]  # (episodes, their trace ids if known) per batch


class SpoolClosed(OSError):
    """A batch pushed after ``close()``: the exit has closed its accounts, nothing more is written."""


class SpoolFileError(Exception):
    """A spool file that cannot be a batch of ours (the message is the reason)."""


def _lock(directory: Path) -> int | None:
    """An exclusive advisory lock on ``directory`` (its fd), or None when another process holds it."""
    import fcntl

    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _private_dir(directory: Path) -> None:
    # every directory created here is private, the parents too (mkdir's parents=True would
    # give them the umask's mode); one that existed keeps its own
    missing, parent = [], directory.parent
    while not parent.exists() and parent.parent != parent:
        missing.append(parent)
        parent = parent.parent
    for parent in reversed(missing):
        parent.mkdir(mode=0o700, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if directory.is_symlink() or not directory.is_dir():
        raise OSError(f"spool directory {directory} is not a directory of its own")
    if directory.stat().st_uid != os.getuid():
        raise OSError(f"spool directory {directory} belongs to another user")
    os.chmod(directory, 0o700)


def read_batch(path: Path, max_bytes: int) -> list[ReadableSpan]:
    """The spans of one spool file; ``SpoolFileError`` when it is not a batch we could have written."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            raise SpoolFileError("a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SpoolFileError("not a regular file")
        if info.st_size > max_bytes:
            raise SpoolFileError(f"{info.st_size} bytes, more than the spool's cap of {max_bytes}")
        chunks = []
        left = info.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise SpoolFileError("grew past the spool's cap while being read")
    try:
        spans = decode(data)
    except Exception as exc:  # noqa: BLE001 - any decode failure means "not a batch"
        raise SpoolFileError(f"does not decode as an OTLP request ({type(exc).__name__})") from None
    if not spans:
        raise SpoolFileError("holds no span")
    return spans


class Spool:
    """Oldest-first files of encoded batches under ``directory``, at most ``max_bytes`` in all.

    Thread-safe. ``push`` returns how many episodes were dropped to make room (oldest first);
    a single batch larger than the whole cap is refused (its episodes are returned as dropped).
    ``peek``/``peek_many`` return decoded spans; files that are not batches are quarantined.
    """

    def __init__(
        self, directory: str | os.PathLike[str], max_bytes: int, on_quarantine: Quarantine | None = None
    ) -> None:
        self.requested = Path(directory)
        self.max_bytes = int(max_bytes)
        self.on_quarantine = on_quarantine
        self._lock = threading.Lock()
        self._files: deque[tuple[Path, int, int]] = deque()  # (path, bytes, episodes)
        self._traces: dict[Path, tuple[int, ...]] = {}  # trace ids of the batches this process wrote
        self._bytes = 0
        self._seq = 0
        self._closed = False  # close(): later pushes are refused (SpoolClosed)
        self.dropped_at_open = 0  # episodes of adopted batches that did not fit under the cap
        _private_dir(self.requested)
        self.directory = self.requested
        lock_fd = _lock(self.requested)
        self.shared = lock_fd is None  # another process holds the directory
        if lock_fd is None:
            self.directory = self.requested / f"{_OWN_PREFIX}{os.getpid()}"
            _private_dir(self.directory)
            lock_fd = _lock(self.directory)
            if lock_fd is None:
                raise OSError(f"spool directory {self.directory} is locked by another process")
        self._lock_fd = lock_fd
        for seq, path, size, episodes in self._scan(self.directory):
            self._files.append((path, size, episodes))
            self._bytes += size
            self._seq = max(self._seq, seq)
        if not self.shared:
            self._adopt_orphans()

    # --- opening ---------------------------------------------------------------------------
    def _scan(self, directory: Path) -> list[tuple[int, Path, int, int]]:
        """``(seq, path, bytes, episodes)`` of the batches in ``directory``, oldest first; what is
        not a batch is quarantined (into this spool's own ``quarantine/``)."""
        found: list[tuple[int, Path, int, int]] = []
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            name = entry.name
            if name in (_LOCK, _QUARANTINE) or name.startswith(_OWN_PREFIX):
                continue
            path = directory / name
            if name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write a crash interrupted (we hold the lock)
                continue
            match = _NAME.match(name)
            if match is None:
                if name.endswith(_SUFFIX):
                    self._quarantine(path, 0, "not named like a batch of this library")
                continue
            episodes = int(match.group(2))
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                self._quarantine(path, episodes, "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file")
                continue
            found.append((int(match.group(1)), path, info.st_size, episodes))
        return found

    def _adopt_orphans(self) -> None:
        """Take over the batches of ``pid-*`` sub-directories whose process is gone."""
        for sub in sorted(self.directory.glob(f"{_OWN_PREFIX}*")):
            if sub.is_symlink() or not sub.is_dir():
                continue
            try:
                fd = _lock(sub)
            except OSError:
                continue
            if fd is None:
                continue  # its process still runs
            try:
                for _, path, size, episodes in self._scan(sub):
                    self._seq += 1
                    target = self.directory / f"{self._seq:012d}-{episodes}{_SUFFIX}"
                    os.replace(path, target)
                    self._files.append((target, size, episodes))
                    self._bytes += size
                (sub / _LOCK).unlink(missing_ok=True)
                try:
                    sub.rmdir()
                except OSError:
                    pass
            finally:
                os.close(fd)
        self.dropped_at_open += sum(n for n, _ in self._trim())

    def _trim(self) -> Dropped:
        """Drop the oldest batches until the cap holds; (episodes, trace ids) of each."""
        dropped: Dropped = []
        while self._files and self._bytes > self.max_bytes:
            path, size, episodes = self._files.popleft()
            path.unlink(missing_ok=True)
            self._bytes -= size
            dropped.append((episodes, self._traces.pop(path, None)))
        return dropped

    def _quarantine(self, path: Path, episodes: int, reason: str,
                    traces: tuple[int, ...] | None = None) -> None:
        """Move a file that is not a batch aside (or delete it) and report it."""
        place = self.directory / _QUARANTINE
        try:
            _private_dir(place)
            os.replace(path, place / f"{path.name}")
            kept = sorted(place.iterdir(), key=lambda p: p.lstat().st_mtime)
            for old in kept[: max(len(kept) - _QUARANTINE_KEEP, 0)]:
                old.unlink(missing_ok=True)
        except OSError:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        if self.on_quarantine is not None:
            self.on_quarantine(path.name, episodes, reason, traces)

    def close(self) -> None:
        """Release the directory lock (the files stay for the next process); pushes are refused
        from now on, so what is here is what the exit counted as left for the next process."""
        with self._lock:
            self._closed = True
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    # --- state -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._files)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def episodes(self) -> int:
        """Episodes currently held on disk."""
        with self._lock:
            return sum(e for _, _, e in self._files)

    def is_own(self, path: Path) -> bool:
        """Whether this process wrote the batch at ``path`` (else a previous run left it)."""
        with self._lock:
            return path in self._traces

    def trace_ids(self) -> set[int]:
        """Trace ids of the batches this process wrote that are still here."""
        with self._lock:
            return {t for traces in self._traces.values() for t in traces}

    # --- writing ---------------------------------------------------------------------------
    def push(self, data: builtins.bytes, episodes: int, traces: tuple[int, ...] | None = None) -> Dropped:
        """Store one encoded batch (holding ``traces``); return the batches dropped to make room
        (this one, if it is larger than the whole cap)."""
        size = len(data)
        if size > self.max_bytes:
            return [(episodes, traces)]
        with self._lock:
            if self._closed:
                raise SpoolClosed(f"spool {self.directory} is closed")
            self._bytes += size
            dropped = self._trim()
            self._bytes -= size
            self._seq += 1
            path = self.directory / f"{self._seq:012d}-{episodes}{_SUFFIX}"
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
            self._files.append((path, size, episodes))
            if traces is not None:
                self._traces[path] = traces
            self._bytes += size
        return dropped

    # --- reading (outside the lock) ----------------------------------------------------------
    def _entry(self, index: int) -> tuple[Path, int, int] | None:
        with self._lock:
            return self._files[index] if len(self._files) > index else None

    def _forget(self, path: Path) -> tuple[bool, tuple[int, ...] | None]:
        """Take ``path`` off the list: (whether it was listed, the trace ids it held if known)."""
        with self._lock:
            for i, (p, size, _) in enumerate(self._files):
                if p == path:
                    del self._files[i]
                    self._bytes -= size
                    return True, self._traces.pop(path, None)
        return False, None

    def _load(self, entry: tuple[Path, int, int]) -> list[ReadableSpan] | None:
        """Spans of one entry; None (and the entry forgotten, quarantined when bad) otherwise."""
        path, _, episodes = entry
        try:
            return read_batch(path, self.max_bytes)
        except (SpoolFileError, OSError) as exc:
            # an OSError: dropped to make room meanwhile (no longer listed: counted then), or
            # removed or made unreadable behind our back: what it held is lost, and said so
            listed, traces = self._forget(path)
            if listed:
                why = str(exc) if isinstance(exc, SpoolFileError) else f"unreadable: {exc}"
                self._quarantine(path, episodes, why, traces)
        return None

    def peek(self, index: int = 0) -> tuple[Path, list[ReadableSpan], int] | None:
        """The ``index``-th oldest batch (path, spans, episodes), left in place; None if none."""
        while True:
            entry = self._entry(index)
            if entry is None:
                return None
            spans = self._load(entry)
            if spans is not None:
                return entry[0], spans, entry[2]

    def peek_many(self, count: int, max_bytes: int) -> list[tuple[Path, list[ReadableSpan], int]]:
        """Up to ``count`` oldest batches (at least one, if any) totalling about ``max_bytes``."""
        with self._lock:
            entries = list(self._files)[:count]
        out: list[tuple[Path, list[ReadableSpan], int]] = []
        total = 0
        for entry in entries:
            if out and total + entry[1] > max_bytes:
                break
            spans = self._load(entry)
            if spans is not None:
                out.append((entry[0], spans, entry[2]))
                total += entry[1]
        return out

    def remove(self, path: Path) -> None:
        """Forget a delivered batch (a no-op if it was already dropped to make room)."""
        self._forget(path)
        path.unlink(missing_ok=True)
