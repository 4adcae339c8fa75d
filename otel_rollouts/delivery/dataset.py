"""``otel-rollouts dataset``: a run's kept episodes as a dataset, from wherever they landed.

Sources, any number, read in the order given:

* an OTLP/JSON-lines file written by ``OtlpJsonFileExporter`` (with its rotated backups, oldest
  first);
* a spool directory (``spool_dir=``): batches an exporter had not delivered yet;
* a Trackio project (``--trackio PROJECT``, under ``TRACKIO_DIR``), every run or one.

Rows are shaped by ``otel_rollouts.exporters.dataset`` (formats ``messages``, ``pairs``, ``flat``)
and written to ``<out>/<format>.parquet`` and ``<out>/hf`` (``datasets.load_from_disk``). Memory is
bounded whatever the input: spans are read a line (a batch, a page of traces) at a time, and an
episode's spans are held only until its step is ``window_steps`` behind the newest step read, or
until ``max_held_bytes`` is reached (oldest first): a late span read after its episode was written
is counted, not lost silently. Bad input (a damaged line, a spool file that does not decode, a
trace that is not an episode of ours, a database that is not Trackio's) is skipped with a count
and a one-line reason per kind.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts import conventions as c
from otel_rollouts._core.content import exception_text
from otel_rollouts.delivery.replay import lines_from_file
from otel_rollouts.delivery.spool import SpoolFileError, read_batch
from otel_rollouts.exporters._tree import by_trace, root_of
from otel_rollouts.exporters.dataset import (
    FORMAT_MESSAGES,
    FORMATS,
    REMEMBERED,
    Episode,
    Filters,
    RowWriter,
    Shaper,
    Tally,
    episode_from_spans,
    episode_from_trackio,
)

__all__ = ["DatasetResult", "add_arguments", "build_dataset", "run"]

SKIP_DAMAGED_LINE = "a damaged line of an OTLP/JSON file"
SKIP_DAMAGED_BATCH = "a spool file that is not an OTLP batch"
SKIP_DAMAGED_TRACE = "a Trackio trace that could not be read"
SKIP_LATE_SPANS = "spans read after their episode was written (beyond the window)"

_SPOOL_MAX_BYTES = 1 << 30
_TRACKIO_PAGE = 64


@dataclass
class DatasetResult:
    """What ``build_dataset`` read and wrote."""

    tally: Tally
    parquet: Path | None = None
    hf: Path | None = None
    failed_sources: list[str] = field(default_factory=list)  # "source: why", unreadable as a whole

    @property
    def rows(self) -> int:
        return self.tally.rows


class _Window:
    """Spans of episodes being assembled, by trace, oldest first; an episode is complete when its
    step is ``window_steps`` behind the newest step read, or when memory needs the room."""

    def __init__(self, window_steps: int, max_held_bytes: int) -> None:
        self.window_steps = window_steps
        self.max_held_bytes = max_held_bytes
        self._traces: OrderedDict[int, list[Any]] = OrderedDict()  # id -> [spans, bytes, step, where]
        self._held = 0
        self._newest: dict[Any, int] = {}  # run id -> the newest step read of it
        self._done: OrderedDict[int, None] = OrderedDict()

    def add(self, spans: Sequence[ReadableSpan], where: str, tally: Tally) -> list[tuple[list[ReadableSpan], str]]:
        for trace_id, group in by_trace(spans).items():
            if trace_id in self._done:
                tally.skip(SKIP_LATE_SPANS, f"{where} (trace {trace_id:032x})", len(group))
                continue
            entry = self._traces.get(trace_id)
            if entry is None:
                entry = self._traces[trace_id] = [[], 0, None, where]
            entry[0].extend(group)
            size = sum(_size(s) for s in group)
            entry[1] += size
            self._held += size
            root = root_of(group)
            if root is not None:
                attrs = root.attributes or {}
                step = attrs.get(c.RL_STEP)
                if isinstance(step, int) and not isinstance(step, bool):
                    run = attrs.get(c.RL_RUN_ID)
                    entry[2] = (run, step)
                    if step > self._newest.get(run, step - 1):
                        self._newest[run] = step
        out = []
        while self._held > self.max_held_bytes and self._traces:
            out.append(self._pop(next(iter(self._traces))))
        # complete: its step is window_steps behind the newest of its own run (a file written
        # by two runs holds two step counts)
        done = [t for t, e in self._traces.items()
                if e[2] is not None and e[2][1] < self._newest[e[2][0]] - self.window_steps]
        out.extend(self._pop(t) for t in done)
        return out

    def _pop(self, trace_id: int) -> tuple[list[ReadableSpan], str]:
        spans, size, _, where = self._traces.pop(trace_id)
        self._held -= size
        self._done[trace_id] = None
        if len(self._done) > REMEMBERED:
            self._done.popitem(last=False)
        return spans, where

    def finish(self) -> list[tuple[list[ReadableSpan], str]]:
        return [self._pop(t) for t in list(self._traces)]


def _size(span: ReadableSpan) -> int:
    """About what a span holds in memory (its texts dominate)."""
    total = 256
    for value in (span.attributes or {}).values():
        total += len(value) if isinstance(value, str) else 16
    return total


def _spool_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".otlp" and not p.name.startswith("."))


def _read_spans(source: Path, tally: Tally) -> Iterator[tuple[Sequence[ReadableSpan], str]]:
    """(spans, where) of each line of an OTLP/JSON file, or each batch of a spool directory."""
    if source.is_dir():
        for path in _spool_files(source):
            try:
                yield read_batch(path, _SPOOL_MAX_BYTES), str(path)
            except (SpoolFileError, OSError) as exc:
                tally.skip(SKIP_DAMAGED_BATCH, f"{path}: {exception_text(exc)}")
        return
    errors: list[str] = []
    for name, number, spans in lines_from_file(source, errors):
        for error in errors:
            tally.skip(SKIP_DAMAGED_LINE, error)
        errors.clear()
        yield spans, f"{name}:{number}"
    for error in errors:
        tally.skip(SKIP_DAMAGED_LINE, error)


def _trackio_traces(project: str, run: str | None, tally: Tally,
                    total: Callable[[int], None] | None = None) -> Iterator[tuple[dict[str, Any], str]]:
    """Every stored trace of a Trackio project (one run, or each run), a step at a time (a page
    of ``_TRACKIO_PAGE`` within a large step: Trackio indexes traces by run and step, so each
    query reads its own rows, and the whole read stays linear in the project's size); a page
    that does not read is read trace by trace, and a bad trace skipped. ``total`` is told how
    many traces a run holds before they are read (the progress bar's end)."""
    from trackio.sqlite_storage import SQLiteStorage

    db_path = SQLiteStorage.get_project_db_path(project)
    if not db_path.exists():
        raise FileNotFoundError(f"no Trackio project {project!r} (no {db_path.name} in TRACKIO_DIR)")
    runs = [run] if run is not None else SQLiteStorage.get_runs(project)
    for name in runs:
        counts = SQLiteStorage.get_trace_steps(project, name)
        if total is not None:
            total(int(counts.get("total") or 0))
        for entry in counts.get("steps") or ():
            step, count = entry.get("step"), int(entry.get("count") or 0)
            for offset in range(0, count, _TRACKIO_PAGE):
                for trace in _trackio_page(SQLiteStorage, project, name, step, offset, tally):
                    yield trace, f"trackio:{project}/{name} step {step}"


def _trackio_page(storage: Any, project: str, run: str, step: Any, offset: int,
                  tally: Tally) -> list[dict[str, Any]]:
    try:
        return list(storage.get_traces(project, run, sort="step_asc", limit=_TRACKIO_PAGE,
                                       offset=offset, step=step))
    except Exception:  # noqa: BLE001 - one bad row fails its page: read one at a time
        page = []
        for i in range(offset, offset + _TRACKIO_PAGE):
            try:
                one = storage.get_traces(project, run, sort="step_asc", limit=1, offset=i, step=step)
            except Exception as exc:  # noqa: BLE001
                tally.read += 1
                tally.skip(SKIP_DAMAGED_TRACE, f"trackio:{project}/{run} step {step} #{i}: "
                           f"{exception_text(exc)}")
                continue
            if not one:
                break
            page.extend(one)
        return page


class _OutputError(Exception):
    """An ``OSError`` of writing the dataset, carried past the handlers of the sources' own
    errors (a full disk is not a source that could not be read)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def build_dataset(
    sources: Sequence[str | os.PathLike[str]] = (),
    out: str | os.PathLike[str] = "dataset",
    *,
    format: str = FORMAT_MESSAGES,
    trackio_project: str | None = None,
    trackio_run: str | None = None,
    filters: Filters | None = None,
    trace_ui_url: str | None = None,
    hf: bool = True,
    window_steps: int = 2,
    max_held_bytes: int = 256 << 20,
    rows_per_group: int = 512,
    progress: bool | None = None,
) -> DatasetResult:
    """Kept episodes from OTLP/JSON files, spool directories and a Trackio project as rows of
    ``format`` in ``<out>/<format>.parquet`` (and ``<out>/hf`` unless ``hf=False``).

    A source that cannot be read at all (missing, not a regular file: a named pipe is refused,
    never waited on) is named in ``failed_sources`` (the others are still read); what was
    skipped inside a source is in ``tally`` (``tally.lines()``). The outputs are written under
    temporary names and renamed when both are complete (``RowWriter``): a failure to write them
    (``OSError``: a full disk...) raises with nothing left behind. Memory holds
    the episodes of the last ``window_steps`` steps (at most ``max_held_bytes``) and one row
    group (``rows_per_group`` rows, at most ~8 MiB of text). ``progress`` None shows a bar on a
    terminal only."""
    from tqdm import tqdm

    missing_dependencies(hf)
    url = (trace_ui_url or os.environ.get(c.ENV_TRACE_UI_URL) or "").rstrip("/") or None
    tally = Tally()
    shaper = Shaper(format, filters, trace_url=url, window_steps=window_steps, tally=tally)
    writer = RowWriter(out, format, hf=hf, rows_per_group=rows_per_group)
    result = DatasetResult(tally)
    bar = tqdm(unit=" episodes", desc="otel-rollouts dataset", disable=None if progress is None else not progress,
               file=sys.stderr)

    def take(episode: Episode | str, where: str) -> None:
        rows = shaper.add(episode, where)
        tally.rows += len(rows)
        try:
            writer.write(rows)
        except OSError as exc:  # the output's, not the source's: past the sources' handlers
            raise _OutputError(exc) from exc
        bar.update(1)

    try:
        for source in sources:
            path = Path(source)
            if not path.exists():
                result.failed_sources.append(f"{path}: no such file or directory")
                continue
            window = _Window(window_steps, max_held_bytes)
            try:
                for spans, where in _read_spans(path, tally):
                    for group, first in window.add(spans, where, tally):
                        take(episode_from_spans(group), first)
            except OSError as exc:
                result.failed_sources.append(f"{path}: {exception_text(exc)}")
            for group, first in window.finish():
                take(episode_from_spans(group), first)
        if trackio_project is not None:
            try:
                def more(n: int) -> None:
                    bar.total = (bar.total or 0) + n
                    bar.refresh()

                for trace, where in _trackio_traces(trackio_project, trackio_run, tally, more):
                    take(episode_from_trackio(trace), where)
            except _OutputError:
                raise
            except Exception as exc:  # noqa: BLE001 - not a Trackio database, or none: one line
                result.failed_sources.append(f"trackio:{trackio_project}: {exception_text(exc)}")
        last = shaper.finish()
        tally.rows += len(last)
        writer.write(last)
        writer.close()
    except _OutputError as exc:
        writer.abort()
        raise exc.error from None
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    result.parquet, result.hf = writer.path, writer.hf_path
    return result


def missing_dependencies(hf: bool = True) -> None:
    """Raise ``ImportError`` naming the extra to install when pyarrow (or ``datasets``) is missing."""
    import importlib.util

    missing = [name for name in ("pyarrow", *(("datasets",) if hf else ()))
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"the dataset feature needs {' and '.join(missing)}: "
                          "pip install 'otel-rollouts[dataset]'")


# --- the command --------------------------------------------------------------------------------
def _steps(text: str) -> tuple[int | None, int | None]:
    """``A:B`` (inclusive; either end may be left out) or ``N``."""
    try:
        if ":" not in text:
            return int(text), int(text)
        first, last = text.split(":", 1)
        low, high = (int(first) if first.strip() else None, int(last) if last.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step or a range A:B, got {text!r}") from None
    if low is not None and high is not None and low > high:
        raise argparse.ArgumentTypeError(f"an empty range: {low} is after {high}")
    return low, high


def _window(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError("expected a number, got nan")
    return value


def _names(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``dataset`` arguments."""
    parser.add_argument("sources", nargs="*", metavar="SOURCE",
                        help="OTLP/JSON-lines files (OtlpJsonFileExporter; rotated backups are read "
                        "too) and spool directories")
    parser.add_argument("--trackio", metavar="PROJECT", help="also read this Trackio project (under "
                        "$TRACKIO_DIR)")
    parser.add_argument("--trackio-run", metavar="RUN", help="only this run of the Trackio project")
    parser.add_argument("--format", choices=FORMATS, default=FORMAT_MESSAGES,
                        help="messages: chat rows (SFT); pairs: best vs worst of each kept group "
                        "(preference/reward models); flat: scalar columns (analysis) "
                        "(default: %(default)s)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="writes DIR/<format>.parquet and DIR/hf (datasets.load_from_disk)")
    parser.add_argument("--no-hf", action="store_true", help="only the Parquet file")
    parser.add_argument("--steps", type=_steps, metavar="A:B", help="only steps A to B (inclusive; "
                        "A: or :B leave an end open)")
    parser.add_argument("--split", type=_names, metavar="NAMES", help="only these splits (comma-separated)")
    parser.add_argument("--status", type=_names, metavar="NAMES",
                        help="only these statuses: ok, error, truncated, filtered (comma-separated)")
    parser.add_argument("--reason", type=_names, metavar="NAMES",
                        help="only episodes kept for these sampling reasons (comma-separated)")
    parser.add_argument("--reward-min", type=_number, metavar="X", help="only rewards >= X")
    parser.add_argument("--reward-max", type=_number, metavar="X", help="only rewards <= X")
    parser.add_argument("--trace-ui-url", metavar="URL",
                        help="fill the link column: a Jaeger base URL, or a template with {trace_id} "
                        f"(default: ${c.ENV_TRACE_UI_URL}, else no link)")
    parser.add_argument("--window-steps", type=_window, default=2, metavar="N",
                        help="an episode's spans are complete once N newer steps were read "
                        "(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace, report: Callable[[str], None] | None = None) -> int:
    """Execute a parsed ``dataset`` command: 0 written; 1 a source could not be read (the rest
    was still written); 2 nothing to read; 3 the dataset could not be written (a full disk, a
    directory that cannot be written): nothing new is left under ``--out``, and a dataset
    already there is as it was."""
    prog = "otel-rollouts dataset"
    say = report or (lambda line: print(line, file=sys.stderr))
    if not args.sources and args.trackio is None:
        say(f"{prog}: error: give a SOURCE file or directory, or --trackio PROJECT")
        return 2
    try:
        missing_dependencies(not args.no_hf)
    except ImportError as exc:
        say(f"{prog}: error: {exc}")
        return 2
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        say(f"{prog}: error: argument --out: {args.out} exists and is not a directory")
        return 2
    filters = Filters(steps=args.steps, splits=args.split, statuses=args.status, reasons=args.reason,
                      reward_min=args.reward_min, reward_max=args.reward_max)
    try:
        result = build_dataset(
            args.sources, args.out, format=args.format, trackio_project=args.trackio,
            trackio_run=args.trackio_run, filters=filters, trace_ui_url=args.trace_ui_url,
            hf=not args.no_hf, window_steps=args.window_steps, progress=False if args.no_progress else None,
        )
    except OSError as exc:  # (the sources' own errors are in failed_sources: this is the output)
        say(f"{prog}: error: could not write the dataset to {args.out}: {exception_text(exc)}; "
            "nothing was written")
        return 3
    tally = result.tally
    for failure in result.failed_sources:
        say(f"{prog}: could not read {failure}")
    for line in tally.lines():
        say(f"{prog}: {line}")
    written = f"{result.parquet}" + (f" and {result.hf}" if result.hf is not None else "")
    say(f"wrote {tally.rows} {args.format} rows from {tally.read} episodes read "
        f"({tally.filtered} filtered out) to {written}")
    if result.failed_sources:
        return 2 if tally.read == 0 else 1
    return 0
