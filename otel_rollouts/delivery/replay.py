"""Replay an OTLP/JSON-lines file into any exporter: ``otel-rollouts replay FILE --to ...``.

A run on a machine with no collector writes kept episodes with ``OtlpJsonFileExporter``; later,
the file (and its rotated backups, oldest first) is read back and sent on:

* ``--to trackio``: a Trackio project (``--project``, ``--run``), the same traces as a direct
  export would have logged;
* ``--to otlp``: the stock OTLP exporter configured from ``OTEL_EXPORTER_OTLP_*`` (protocol from
  ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``, default grpc);
* ``--to console``: an indented tree per episode.

Each line becomes SDK ``ReadableSpan`` objects with the ids, parents, names, kinds, times,
attributes, events, links, status, resource and instrumentation scope of the original spans, so
every ``SpanExporter`` accepts them. (Dropped-attribute/event counts are not carried over: the
SDK's ``ReadableSpan`` takes none.)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts._core.codec import spans_from_request
from otel_rollouts._core.content import exception_text
from otel_rollouts.delivery.layers import take_not_stored

__all__ = ["ReplayResult", "main", "replay", "spans_from_file", "spans_from_request"]

logger = logging.getLogger("otel_rollouts")


TARGETS = ("trackio", "otlp", "console")


def spans_from_file(
    path: str | os.PathLike[str], errors: list[str] | None = None, *, with_backups: bool = True
) -> Iterator[list[ReadableSpan]]:
    """The spans of each line of ``path`` (rotated backups first when ``with_backups``).

    With ``errors`` a bad line is described there (``file:line: why``) and skipped; without,
    it raises ``ValueError``.
    """
    for _, _, spans in lines_from_file(path, errors, with_backups=with_backups):
        yield spans


def lines_from_file(
    path: str | os.PathLike[str],
    errors: list[str] | None = None,
    *,
    with_backups: bool = True,
    max_line_bytes: int | None = None,
) -> Iterator[tuple[str, int, list[ReadableSpan]]]:
    """``(file, line number, spans)`` of each line, streamed, each line isolated (see
    ``spans_from_file``)."""
    from otel_rollouts.exporters.otlp_json import MAX_LINE_BYTES, read_lines, rotated_paths

    paths = rotated_paths(path) if with_backups else [path]
    if not paths:
        raise FileNotFoundError(f"no such file: {path}")
    for one in paths:
        for number, request in read_lines(one, errors, max_line_bytes or MAX_LINE_BYTES):
            try:
                spans = spans_from_request(request)
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                message = f"{one}:{number}: not a valid trace: {exc}"
                if errors is None:
                    raise ValueError(message) from exc
                errors.append(message)
                continue
            yield str(one), number, spans


# --- sending -----------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    """What a replay read and sent."""

    lines: int = 0
    spans: int = 0
    traces: int = 0
    failed_batches: int = 0
    errors: list[str] = field(default_factory=list)
    # reason -> trace ids the exporter accepted but did not store (``take_not_stored``)
    not_stored: dict[str, set[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Everything read was stored: no batch failed, no line was unreadable, and the exporter
        stored every trace it accepted."""
        return self.failed_batches == 0 and not self.errors and not self.not_stored


def replay(
    path: str | os.PathLike[str],
    exporter: SpanExporter,
    *,
    batch_lines: int = 64,
    with_backups: bool = True,
    shutdown: bool = True,
    max_line_bytes: int | None = None,
) -> ReplayResult:
    """Send every trace of an OTLP/JSON-lines file (and its backups) to ``exporter``.

    Lines are sent in batches of ``batch_lines``; rotated backups (``path.N``) go first unless
    ``with_backups=False``. The file is streamed line by line and each line is isolated: a line
    that does not parse, holds an invalid id, is longer than ``max_line_bytes`` (default 256 MiB)
    or makes the exporter raise is skipped and listed in the result's ``errors`` as
    ``file:line: why``; the others go through. Nothing raises past that report except an
    unreadable file (``OSError``) and ``KeyboardInterrupt``. The exporter is flushed, and shut down unless ``shutdown=False``.
    """
    result = ReplayResult()
    trace_ids: set[int] = set()
    batch: list[tuple[str, int, list[ReadableSpan]]] = []

    def export(spans: list[ReadableSpan]) -> tuple[bool, BaseException | None]:
        try:
            ok = exporter.export(spans) is SpanExportResult.SUCCESS
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a hostile exporter: report, keep going
            return False, exc
        if ok:  # taken: was all of it stored?
            for reason, ids in take_not_stored(exporter, spans).items():
                result.not_stored.setdefault(reason, set()).update(ids)
        return ok, None

    def send() -> None:
        nonlocal batch
        lines, batch = batch, []
        if not lines:
            return
        ok, exc = export([span for _, _, spans in lines for span in spans])
        if ok:
            return
        if exc is None or len(lines) == 1:
            result.failed_batches += 1
            if exc is not None:
                where = f"{lines[0][0]}:{lines[0][1]}"
                result.errors.append(f"{where}: {type(exporter).__name__} raised {exception_text(exc)}")
            return
        # the exporter raised on the batch: one line may be to blame; send them one by one so
        # the others go through and the bad ones are named
        for one in lines:
            ok, exc = export(one[2])
            if not ok:
                result.failed_batches += 1
                if exc is not None:
                    result.errors.append(f"{one[0]}:{one[1]}: {type(exporter).__name__} raised {exception_text(exc)}")

    try:
        try:
            for line in lines_from_file(
                path, result.errors, with_backups=with_backups, max_line_bytes=max_line_bytes
            ):
                result.lines += 1
                result.spans += len(line[2])
                trace_ids.update(s.context.trace_id for s in line[2])
                batch.append(line)
                if len(batch) >= batch_lines:
                    send()
            send()
        except OSError:
            raise  # the file itself: the caller reports it
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - never past our own error report
            result.errors.append(f"{path}: replay stopped: {exception_text(exc)}")
    finally:
        for call in (exporter.force_flush, exporter.shutdown if shutdown else None):
            if call is None:
                continue
            try:
                call()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001
                result.errors.append(f"{type(exporter).__name__}.{call.__name__} raised {exception_text(exc)}")
    result.traces = len(trace_ids)
    return result


def make_exporter(to: str, project: str | None = None, run: str | None = None) -> SpanExporter:
    """The exporter for ``--to`` (``trackio``, ``otlp`` or ``console``)."""
    if to == "trackio":
        from otel_rollouts import conventions as c
        from otel_rollouts.exporters import TrackioExporter

        return TrackioExporter(
            project or os.environ.get(c.ENV_TRACKIO_PROJECT) or "otel-rollouts", run=run
        )
    if to == "otlp":
        from otel_rollouts.delivery.defaults import otlp_exporter_from_env

        return otlp_exporter_from_env()
    if to == "console":
        from otel_rollouts.exporters import ConsoleExporter

        return ConsoleExporter()
    raise ValueError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")


# --- command line --------------------------------------------------------------------------------
_ENV_OTLP_TRACES_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``replay`` arguments (shared by ``otel-rollouts replay`` and ``main``)."""
    from otel_rollouts import conventions as c

    parser.add_argument("file", help="OTLP/JSON-lines file written by OtlpJsonFileExporter")
    parser.add_argument("--to", choices=TARGETS, required=True, help="where to send the traces")
    parser.add_argument(
        "--project",
        help=f"Trackio project (--to trackio; default: ${c.ENV_TRACKIO_PROJECT}, else otel-rollouts)",
    )
    parser.add_argument("--run", help="Trackio run name (--to trackio; default: generated)")
    parser.add_argument(
        "--no-backups", action="store_true", help="read FILE only, not its rotated FILE.N backups"
    )
    parser.add_argument(
        "--timeout", type=_positive_seconds, default=None, metavar="SECONDS",
        help=f"--to otlp: give up on a batch after SECONDS, retries included (default: "
        f"${_ENV_OTLP_TRACES_TIMEOUT} or $OTEL_EXPORTER_OTLP_TIMEOUT, else 5)",
    )
    return parser


class _Counting(SpanExporter):
    """Wraps the target exporter to count what it accepted and what it refused, for the summary.

    A failed ``force_flush``/``shutdown`` (Trackio writes at flush) turns what was accepted into
    "not confirmed", reported as failed. Traces the exporter accepted but did not store (its
    ``take_not_stored()``) are failed, never delivered.
    """

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self.batches = self.failed_batches = 0
        self.sent_spans = self.failed_spans = 0
        self.sent_traces: set[int] = set()
        self.failed_traces: set[int] = set()
        self.flush_error: str | None = None
        self.not_stored: dict[str, set[int]] = {}  # reason -> trace ids, for the summary

    def _count(self, ok: bool, spans: Sequence[ReadableSpan]) -> None:
        self.batches += 1
        ids = {s.context.trace_id for s in spans}
        if ok:
            self.sent_spans += len(spans)
            self.sent_traces |= ids
        else:
            self.failed_batches += 1
            self.failed_spans += len(spans)
            self.failed_traces |= ids

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            outcome = self.exporter.export(spans)
        except Exception:
            self._count(False, spans)
            raise  # replay() logs it and counts the batch
        self._count(outcome is SpanExportResult.SUCCESS, spans)
        if outcome is SpanExportResult.SUCCESS:
            lost: set[int] = set()
            for reason, ids in take_not_stored(self.exporter, spans).items():
                self.not_stored.setdefault(reason, set()).update(ids)
                lost |= ids
            if lost:  # their spans were not delivered either
                moved = sum(1 for s in spans if s.context.trace_id in lost)
                self.sent_spans -= moved
                self.failed_spans += moved
        return outcome

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            ok = self.exporter.force_flush(timeout_millis)
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            ok, self.flush_error = False, f"flush failed: {exc}"
        if ok is False and self.flush_error is None:
            self.flush_error = "flush failed"
        return ok is not False

    def shutdown(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception as exc:  # noqa: BLE001 - reported in the summary
            self.flush_error = self.flush_error or f"shutdown failed: {exc}"

    def totals(self) -> tuple[int, int, int, int]:
        """(delivered traces, delivered spans, failed traces, failed spans); a trace the target
        accepted but did not store is failed (its spans are not counted again)."""
        if self.flush_error:
            failed = self.sent_traces | self.failed_traces
            return 0, 0, len(failed), self.sent_spans + self.failed_spans
        lost: set[int] = set().union(*self.not_stored.values()) if self.not_stored else set()
        unknown = sum(1 for ids in self.not_stored.values() if not ids)
        delivered = self.sent_traces - self.failed_traces - lost
        failed_traces = len(self.failed_traces | (lost & self.sent_traces)) + unknown
        return len(delivered), self.sent_spans, failed_traces, self.failed_spans


def _input_problem(path: str) -> str | None:
    """Why ``path`` cannot be replayed (missing, a directory, unreadable), or None."""
    if os.path.isdir(path):
        return f"{path} is a directory, not an OTLP/JSON-lines file"
    if not os.path.exists(path):
        return f"no such file: {path}"
    if not os.access(path, os.R_OK):
        return f"cannot read {path}: permission denied"
    return None


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``replay`` command; the exit status: 0 everything read was delivered,
    1 something failed to send (or lines were unreadable), 2 bad input (nothing to read)."""
    prog = "otel-rollouts replay"
    problem = _input_problem(args.file)
    if problem:
        print(f"{prog}: error: argument file: {problem}", file=sys.stderr)
        return 2
    saved = os.environ.get(_ENV_OTLP_TRACES_TIMEOUT)
    if args.to == "otlp" and getattr(args, "timeout", None) is not None:
        os.environ[_ENV_OTLP_TRACES_TIMEOUT] = str(args.timeout)  # read by the OTLP exporter
    try:
        exporter = make_exporter(args.to, args.project, args.run)
    finally:
        if saved is None:
            os.environ.pop(_ENV_OTLP_TRACES_TIMEOUT, None)
        else:
            os.environ[_ENV_OTLP_TRACES_TIMEOUT] = saved
    counting = _Counting(exporter)
    try:
        result = replay(args.file, counting, with_backups=not args.no_backups)
    except OSError as exc:  # unreadable although it exists (os.access says yes to root)
        print(f"{prog}: error: argument file: cannot read {exc.filename or args.file}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    for error in result.errors:
        print(f"{prog}: {error}", file=sys.stderr)
    delivered, delivered_spans, failed, failed_spans = counting.totals()
    unreadable = f"; {len(result.errors)} unreadable lines skipped" if result.errors else ""
    if failed == 0 and failed_spans == 0:
        print(f"replayed {result.traces} traces ({result.spans} spans) from {args.file} to "
              f"{args.to}: {delivered} traces delivered, 0 failed{unreadable}", file=sys.stderr)
    else:
        reasons = [f"{len(ids) or 1} not stored: {reason}" for reason, ids in sorted(counting.not_stored.items())]
        refused = [f"{counting.failed_batches} of {counting.batches} batches refused by {args.to}"
                   ] if counting.failed_batches or not reasons else []
        why = counting.flush_error or "; ".join(refused + reasons)
        print(f"{prog}: delivery failed: {delivered} traces ({delivered_spans} spans) delivered, "
              f"{failed} traces ({failed_spans} spans) failed, of {result.traces} traces read "
              f"from {args.file} ({why}){unreadable}", file=sys.stderr)
    if result.spans == 0 and result.errors:
        return 2
    return 0 if failed == 0 and failed_spans == 0 and not result.errors else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m otel_rollouts.delivery.replay FILE --to trackio|otlp|console``."""
    parser = add_arguments(
        argparse.ArgumentParser(prog="otel-rollouts replay", description=__doc__.split("\n")[0])
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
