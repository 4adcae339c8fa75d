"""A bounded on-disk spool of export batches that an exporter could not deliver (yet).

Each batch is one file holding an OTLP ``ExportTraceServiceRequest`` in its protobuf encoding
(the collector's own wire format: nothing custom, replayable by any OTLP tool). Files are
created ``0600`` in a ``0700`` directory, written to a temporary name and renamed, so a crash
never leaves a half batch behind. The spool has a byte cap: when a new batch does not fit, the
*oldest* batches are deleted first and the episodes they held are counted as dropped.

A spool directory that already holds batches (a previous process died with the collector down)
is picked up: those batches are delivered first.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan

_SUFFIX = ".otlp"


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """The OTLP protobuf encoding of ``spans`` (one ``ExportTraceServiceRequest``)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans).SerializeToString()


def decode(data: bytes) -> list[ReadableSpan]:
    """SDK spans (same ids, attributes, resource, scope) from an encoded request."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from otel_rollouts.replay import spans_from_request

    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return spans_from_request(request)


class Spool:
    """Oldest-first files of encoded batches under ``directory``, at most ``max_bytes`` in all.

    Thread-safe. ``push`` returns how many episodes were dropped to make room (oldest first);
    a single batch larger than the whole cap is refused (its episodes are returned as dropped).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._files: deque[tuple[Path, int, int]] = deque()  # (path, bytes, episodes)
        self._bytes = 0
        self._seq = 0
        for path in sorted(self.directory.glob(f"*{_SUFFIX}")):
            try:
                size = path.stat().st_size
                seq, episodes = (int(x) for x in path.stem.split("-", 1))
            except (OSError, ValueError):
                continue
            self._files.append((path, size, episodes))
            self._bytes += size
            self._seq = max(self._seq, seq)
        for stale in self.directory.glob("*.tmp"):
            stale.unlink(missing_ok=True)

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

    def push(self, data: bytes, episodes: int) -> int:
        """Store one encoded batch; return the number of episodes dropped to make room."""
        size = len(data)
        if size > self.max_bytes:
            return episodes
        dropped = 0
        with self._lock:
            while self._files and self._bytes + size > self.max_bytes:
                path, old_size, old_episodes = self._files.popleft()
                path.unlink(missing_ok=True)
                self._bytes -= old_size
                dropped += old_episodes
            self._seq += 1
            path = self.directory / f"{self._seq:012d}-{episodes}{_SUFFIX}"
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, path)
            self._files.append((path, size, episodes))
            self._bytes += size
        return dropped

    def peek(self, index: int = 0) -> tuple[Path, bytes, int] | None:
        """The ``index``-th oldest batch (path, data, episodes), left in place; None if none."""
        with self._lock:
            while len(self._files) > index:
                path, size, episodes = self._files[index]
                try:
                    return path, path.read_bytes(), episodes
                except OSError:  # removed behind our back: forget it
                    del self._files[index]
                    self._bytes -= size
            return None

    def peek_many(self, count: int, max_bytes: int) -> list[tuple[Path, bytes, int]]:
        """Up to ``count`` oldest batches (at least one, if any) totalling about ``max_bytes``."""
        out: list[tuple[Path, bytes, int]] = []
        total = 0
        with self._lock:
            for path, size, episodes in list(self._files)[:count]:
                if out and total + size > max_bytes:
                    break
                try:
                    out.append((path, path.read_bytes(), episodes))
                except OSError:
                    continue
                total += size
        return out

    def remove(self, path: Path) -> None:
        """Forget a delivered batch (a no-op if it was already dropped to make room)."""
        with self._lock:
            for i, (p, size, _) in enumerate(self._files):
                if p == path:
                    del self._files[i]
                    self._bytes -= size
                    break
        path.unlink(missing_ok=True)
