"""Kept episodes as OTLP/JSON lines: a file a run can write where no collector is reachable.

Each line is one ``ExportTraceServiceRequest`` (the message an OTLP exporter would send) in the
OTLP/JSON encoding, one episode per line. The message is built by the stock OTLP encoder
(``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans``) and rendered with
protobuf's JSON mapping (``google.protobuf.json_format``), with the two changes the OTLP
specification makes to that mapping (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding):

* ``traceId``, ``spanId`` and ``parentSpanId`` (of spans and links) are lowercase **hex**, not
  base64 as protobuf would write ``bytes``; other ``bytes`` values stay base64;
* enums are written as integers (``"kind": 1``), never as names.

Field names are lowerCamelCase and 64-bit integers are JSON strings (``"startTimeUnixNano":
"1795..."``), both as protobuf's mapping writes them and OTLP receivers accept. This is the
format of the OpenTelemetry Collector's file exporter, so ``otel-rollouts replay`` (or any
OTLP/JSON tool) can send the file to Trackio or a collector later.

The file is private (mode 0600: it holds prompts and completions) and opened as the spool opens
its files (``otel_rollouts._core.files.open_private``: a symbolic link is not followed, another
user's file or a hard-linked one is refused, the export returns FAILURE), with ``O_APPEND`` and
written with one ``write`` per line under a lock, so threads of one process append whole lines
and a reader tailing the file sees only complete lines (a line without its newline is still
being written). It rotates by size like ``logging.handlers.RotatingFileHandler``: ``path`` →
``path.1`` → … → ``path.<backups>`` (the oldest is deleted).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts._core.files import open_private

__all__ = [
    "OtlpJsonFileExporter",
    "decode_line",
    "decode_message",
    "encode_message",
    "encode_request",
    "read_lines",
    "read_requests",
    "rotated_paths",
]

logger = logging.getLogger("otel_rollouts")
_M = TypeVar("_M", bound=Message)

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_ID_BYTES = {"traceId": 16, "spanId": 8, "parentSpanId": 8}


# --- the format: proto <-> one JSON line -----------------------------------------------------
# Where OTLP messages hold ids (``bytes`` that OTLP/JSON writes as hex): spans and their links,
# log records, and the exemplars of every kind of metric data point. One table for all three
# signals, so the OTLP/HTTP JSON exporters (``otlp_http_json``) share this encoding.
_METRIC_DATA = ("sum", "gauge", "histogram", "exponentialHistogram", "summary")


def _id_holders(request: dict[str, object]) -> Iterator[dict[str, object]]:
    """Every object of an OTLP request (traces, logs or metrics, as a dict) that may hold ids."""
    for resource_spans in _items(request.get("resourceSpans")):
        for scope_spans in _items(resource_spans.get("scopeSpans")):
            for span in _items(scope_spans.get("spans")):
                yield span
                yield from _items(span.get("links"))
    for resource_logs in _items(request.get("resourceLogs")):
        for scope_logs in _items(resource_logs.get("scopeLogs")):
            yield from _items(scope_logs.get("logRecords"))
    for resource_metrics in _items(request.get("resourceMetrics")):
        for scope_metrics in _items(resource_metrics.get("scopeMetrics")):
            for metric in _items(scope_metrics.get("metrics")):
                for kind in _METRIC_DATA:
                    data = metric.get(kind)
                    if isinstance(data, dict):
                        for point in _items(data.get("dataPoints")):
                            yield from _items(point.get("exemplars"))


def _ids(request: dict[str, object], convert: Callable[[str, Any], Any]) -> dict[str, object]:
    """Apply ``convert(field, value)`` to the id fields of every span, link, log record and
    exemplar, in place.

    Anything not shaped like a request is left alone for ``ParseDict`` to reject clearly.
    """
    for item in _id_holders(request):
        for field in _ID_FIELDS:
            value = item.get(field)
            if value and isinstance(value, str):
                item[field] = convert(field, value)
    return request


def _items(value: object) -> list[dict[str, object]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _b64_to_hex(_field: str, value: str) -> str:
    return base64.b64decode(value).hex()  # the encoder's own output: always valid base64


def _hex_to_b64(field: str, value: str) -> str:
    """Hex ids (OTLP/JSON) back to base64 for ``ParseDict``; base64 ids pass through."""
    if len(value) == 2 * _ID_BYTES[field]:
        try:
            return base64.b64encode(bytes.fromhex(value)).decode("ascii")
        except ValueError:
            pass  # not hex: a (non-conforming) base64 id of that length
    return value


def encode_message(message: Message) -> str:
    """OTLP/JSON for one OTLP request message (``ExportTraceServiceRequest``,
    ``ExportLogsServiceRequest`` or ``ExportMetricsServiceRequest``): protobuf's JSON mapping
    with hex ids and integer enums, compact, on one line."""
    as_dict = json_format.MessageToDict(message, use_integers_for_enums=True)
    return json.dumps(_ids(as_dict, _b64_to_hex), separators=(",", ":"), ensure_ascii=False)


def encode_request(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON line (without the newline) for ``spans``."""
    return encode_message(encode_spans(spans))


def decode_message(text: str | bytes, message: _M, *, ignore_unknown_fields: bool = False) -> _M:
    """Parse OTLP/JSON ``text`` (hex or base64 ids, enum names or numbers) into ``message`` (an
    empty OTLP request of the expected type) and return it. ``ignore_unknown_fields``: what a
    receiver does with fields of a newer OTLP version (the specification asks receivers to).

    Raises ``ValueError`` (naming what is wrong) on text that is not such a request.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    try:
        json_format.ParseDict(_ids(data, _hex_to_b64), message, ignore_unknown_fields=ignore_unknown_fields)
    except json_format.ParseError as exc:  # not a ValueError subclass
        raise ValueError(str(exc)) from exc
    return message


def decode_line(line: str | bytes) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON line (hex or base64 ids, enum names or numbers) into the proto.

    Raises ``ValueError`` (naming what is wrong) on text that is not such a request.
    """
    return decode_message(line, ExportTraceServiceRequest())


def rotated_paths(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` and its rotated backups that exist, oldest first (the order they were written)."""
    path = Path(path)
    backups = []
    for candidate in path.parent.glob(path.name + ".*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            backups.append((int(suffix), candidate))
    ordered = [p for _, p in sorted(backups, reverse=True)]
    if path.exists():
        ordered.append(path)
    return ordered


MAX_LINE_BYTES = 256 * 1024 * 1024  # a longer line is skipped (and reported), never held whole

_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class NotARegularFileError(OSError):
    """A path to read as an OTLP/JSON file that is not a regular file: a named pipe (reading
    it would wait for a writer forever), a device (``/dev/zero`` never ends), a socket."""


def open_regular(path: str | os.PathLike[str]) -> Any:
    """``open(path, "rb")`` for a regular file only (``NotARegularFileError`` naming what it is
    otherwise). Opened without blocking and checked on the open descriptor: a named pipe is
    refused at once, not waited on, and a file swapped for one after a check is still caught."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
            raise NotARegularFileError(f"{os.fspath(path)}: {kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_lines(
    path: str | os.PathLike[str], errors: list[str] | None = None, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, ExportTraceServiceRequest]]:
    """``(line number, request)`` for every line of one OTLP/JSON-lines file, streamed.

    Each line is isolated: one that does not parse (bad JSON, nesting too deep, not a trace
    request) or is longer than ``max_line_bytes`` (skipped without being held in memory) is
    described in ``errors`` (``"file:line: why"``), or raises ``ValueError`` when ``errors`` is
    None. A last line without its newline is a write in progress and is not read. A path that
    is not a regular file (a named pipe, a device) raises ``NotARegularFileError``.
    """

    def problem(number: int, why: str) -> None:
        message = f"{path}:{number}: {why}"
        if errors is None:
            raise ValueError(message)
        errors.append(message)

    with open_regular(path) as handle:
        number = 0
        while True:
            raw = handle.readline(max_line_bytes + 1)
            if not raw:
                return
            number += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                skipped = len(raw)
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line in chunks
                    raw = handle.readline(1 << 20)
                    skipped += len(raw)
                problem(number, f"line of {skipped} bytes is longer than the limit ({max_line_bytes}); skipped")
                continue
            if not raw.endswith(b"\n"):
                if raw.strip():
                    problem(number, "incomplete last line (still being written?)")
                return
            if not raw.strip():
                continue
            try:
                request = decode_line(raw)
            except (ValueError, RecursionError, MemoryError) as exc:
                problem(number, f"not an OTLP/JSON trace request: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            yield number, request


def read_requests(
    path: str | os.PathLike[str], errors: list[str] | None = None
) -> Iterator[ExportTraceServiceRequest]:
    """Every request in one OTLP/JSON-lines file, in order (see ``read_lines``)."""
    for _, request in read_lines(path, errors):
        yield request


# --- the exporter ----------------------------------------------------------------------------
class OtlpJsonFileExporter(SpanExporter):
    """Writes kept spans as OTLP/JSON lines to ``path``, one episode (trace) per line.

    ``max_bytes`` (default 100 MiB; 0 turns rotation off) caps a file: a line that would pass it
    goes to a fresh file after rotation, keeping ``backups`` old files. A single line larger than
    ``max_bytes`` is still written whole (alone in its file). Write errors return ``FAILURE``
    (the pipeline counts it) and are logged once per kind; they never raise.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = 100 * 1024 * 1024,
        backups: int = 5,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups!r}")
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.backups = int(backups)
        self.lines_written = 0
        self.spans_written = 0
        self.rotations = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._closed = False
        self._logged: set[str] = set()

    # -- file handling (under the lock) --
    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # as the spool opens its files: no symbolic link followed, a regular file of this
            # user only, mode 0600 (a planted link or another user's 0666 file gets nothing)
            self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self._size = os.fstat(self._fd).st_size
        return self._fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _rotate(self) -> None:
        self._close_fd()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for index in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
            if self.path.exists():
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self.rotations += 1

    def _write_line(self, data: bytes) -> None:
        fd = self._open()
        if self.max_bytes and self._size > 0 and self._size + len(data) > self.max_bytes:
            self._rotate()
            fd = self._open()
        view = memoryview(data)
        while view:  # a regular file takes it in one write; loop only if the kernel splits it
            written = os.write(fd, view)
            view = view[written:]
        self._size += len(data)

    # -- SpanExporter --
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        by_trace: dict[int, list[ReadableSpan]] = {}
        for span in spans:
            by_trace.setdefault(span.context.trace_id, []).append(span)
        try:
            lines = [(encode_request(group) + "\n").encode("utf-8") for group in by_trace.values()]
        except Exception as exc:  # noqa: BLE001 - a span the encoder refuses must not crash export
            self._log_once("encode", f"otel_rollouts: OtlpJsonFileExporter could not encode spans: {exc}")
            return SpanExportResult.FAILURE
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            try:
                for line, group in zip(lines, by_trace.values(), strict=True):
                    self._write_line(line)
                    self.lines_written += 1
                    self.spans_written += len(group)
            except OSError as exc:
                self._close_fd()  # reopen next time (the file may have been removed)
                self._log_once(
                    type(exc).__name__,
                    f"otel_rollouts: OtlpJsonFileExporter cannot write {self.path}: {exc}",
                )
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Lines are written straight to the file (no user-space buffer): nothing to flush."""
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._close_fd()

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message)
