"""Episode context in thread pools, process pools and multiprocessing workers.

Threads share the process's pipeline, so a task only needs the context: spans it makes join
the episode directly. A worker *process* cannot hand its spans to the parent's tail sampler,
and the sampler decides only later (when rewards are in). So a task run in another process
records its spans locally, under the parent's span (same trace id, parent span id from the
W3C ``traceparent`` of the carrier), and returns them with its result as a ``WorkerResult``
(an OTLP protobuf ``ExportTraceServiceRequest``: picklable, language-neutral). The parent
adopts them into the episode, which keeps or drops them with everything else. Nothing is
exported from the worker; no round trip is needed.

What a worker task records: spans made through otel_rollouts (``@otr.traced`` functions and
their nesting). Spans of other OpenTelemetry instrumentation in the worker (an httpx client
span) get the right parent in the context but are exported, or not, by the worker's own SDK
setup; they are not carried back. Log records in the worker are stamped with the episode's
step and id (``instrument_logging`` in the worker's initializer; a forked worker inherits the
parent's). With the worker's records exported (``instrument_logging(otlp=True)`` or
``exporter=``), those made inside a task of an episode travel back with the task's result (at
most ``MAX_TASK_LOG_BYTES`` a task, the rest counted ``dropped.worker_logs``) and join the
episode in the parent, kept or dropped with it, with the run's resource: the worker exports none
of them, and none is lost when the pool shuts down right after the task. Records made in a task
outside an episode go out through the worker's own exporter, stamped with the run's
``service.name`` and ``rl.run.id`` (carried by the task), and are flushed before the task
returns.

    # ThreadPoolExecutor or ProcessPoolExecutor: a future of the plain value
    future = otr.submit(executor, score, completion)
    # multiprocessing.Pool (or any API that returns what the task returned)
    results = [otr.adopt(r) for r in pool.map(otr.with_context(score), completions)]

A worker task raising an exception carries its spans on the exception; ``adopt_exception``
(called by ``submit``) adopts them. Spans are adopted only while the episode is undecided (or
kept: then they go out as late spans); adopt before the episode's step closes.

Fork safety: a forked child must neither export nor forget the parent's buffered episodes.
At fork the child drops its copy of the runtime (those undecided episodes and the export queue
belong to the parent, which still has them) and rebuilds its own pipeline and export threads
lazily, on first use, from the same ``configure()`` arguments.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.codec import decode, encode, with_resource
from otel_rollouts._core.content import exception_text
from otel_rollouts._core.settings import ContentSettings, env_flag
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts.correlate.logs import TASK_LOGS, TaskLogs
from otel_rollouts.correlate.propagation import extract_context, inject_headers

__all__ = [
    "WorkerResult",
    "adopt",
    "adopt_exception",
    "context_carrier",
    "submit",
    "with_context",
]

_EXC_ATTR = "_otel_rollouts_worker_spans"
_EXC_LOGS_ATTR = "_otel_rollouts_worker_logs"  # (records, lost) of a failed task, beside its spans
# the log records one worker task may carry back to its episode (bytes, approximate)
# a worker flushes the records it sent itself during a task (outside an episode) this long at most
_TASK_FLUSH_MILLIS = 5_000

logger = logging.getLogger("otel_rollouts")


def context_carrier() -> dict[str, str]:
    """The current trace context as a plain ``dict[str, str]`` (W3C headers): picklable,
    JSON-safe, fit for any task payload (multiprocessing, Ray, a queue message)."""
    return dict(inject_headers({}))


class WorkerResult:
    """A worker task's return value plus the spans and log records it made (OTLP protobuf
    bytes), and how many of its log records did not fit ``MAX_TASK_LOG_BYTES``."""

    __slots__ = ("value", "spans", "trace_id", "logs", "lost_logs")

    def __init__(self, value: Any, spans: bytes, trace_id: int, logs: bytes = b"",
                 lost_logs: int = 0) -> None:
        self.value = value
        self.spans = spans
        self.trace_id = trace_id
        self.logs = logs
        self.lost_logs = lost_logs

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.value, self.spans, self.trace_id, self.logs, self.lost_logs)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.value, self.spans, self.trace_id = state[:3]
        self.logs, self.lost_logs = (state[3], state[4]) if len(state) >= 5 else (b"", 0)

    def __repr__(self) -> str:
        return (f"WorkerResult(value={self.value!r}, spans={len(self.spans)} bytes,"
                f" logs={len(self.logs)} bytes)")


class ContextTask:
    """``fn`` bound to a trace context; picklable when ``fn`` is (a module-level function).

    Called in the process that made it (a thread pool), it runs ``fn`` in the captured context
    and returns ``fn``'s value. Called in another process, it records ``fn``'s spans under the
    carried context and returns a ``WorkerResult``.
    """

    def __init__(self, fn: Callable[..., Any], carrier: Mapping[str, str] | None = None) -> None:
        self.fn = fn
        self.carrier = dict(carrier) if carrier is not None else context_carrier()
        self.pid = os.getpid()
        # the live context (with the episode's own span record): same process only
        self.context = otel_context.get_current() if carrier is None else None
        self.run = run_identity()

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "carrier": self.carrier, "pid": self.pid, "run": self.run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fn, self.carrier, self.pid = state["fn"], state["carrier"], state["pid"]
        self.run = state.get("run") or {}
        self.context = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if os.getpid() == self.pid and self.context is not None:
            token = otel_context.attach(self.context)
            try:
                return self.fn(*args, **kwargs)
            finally:
                otel_context.detach(token)
        if os.getpid() == self.pid:
            # only a carrier, but this process holds the episode: record, then adopt here
            try:
                result = _run_captured(self.fn, self.carrier, args, kwargs)
            except BaseException as exc:
                adopt_exception(exc)
                raise
            return adopt(result)
        return _run_captured(self.fn, self.carrier, args, kwargs, self.run)


def with_context(fn: Callable[..., Any], carrier: Mapping[str, str] | None = None) -> ContextTask:
    """Wrap ``fn`` so that it runs in the current episode context (or ``carrier``'s) wherever
    it is called: a thread, a ``ProcessPoolExecutor`` or ``multiprocessing.Pool`` worker.

    Call it inside the episode (the context is captured now). In another process the wrapped
    call returns a ``WorkerResult``: pass it to ``adopt`` to get the value and hand its spans
    to the episode (``submit`` does this for executors).
    """
    return ContextTask(fn, carrier)


# --- the worker side ---------------------------------------------------------------------------
class _Sink:
    """Stands in for the pipeline of the parent's episode inside a worker: holds nothing back."""

    def part_ended(self, record: EpisodeRecord) -> None:
        return None

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        return None


_SINK = _Sink()


class _Capture:
    """One task's spans, recorded under the carried context (same trace, parent span id from the
    carrier's ``traceparent``): entered around the task's call, sync or async."""

    __slots__ = ("context", "record", "trace_id", "token", "logs", "logs_token")

    def __init__(self, carrier: Mapping[str, str]) -> None:
        remote = extract_context(carrier)
        parent = trace.get_current_span(remote).get_span_context()
        self.record: EpisodeRecord | None = None
        self.trace_id = 0
        self.token: object | None = None
        self.context: otel_context.Context | None = None
        self.logs: TaskLogs | None = None
        self.logs_token: object | None = None
        if not parent.is_valid:
            return
        # an unconfigured worker records this task's spans all the same (they go back to the
        # parent): the record below is all they need, nothing is installed in this process, so
        # concurrent tasks (a threaded actor) never see each other's setup come and go
        installed = _runtime.installed()
        active = installed if installed is not None and installed.enabled else None
        step = _int(baggage.get_baggage(c.RL_STEP, remote))
        max_spans = active.max_spans_per_episode if active is not None else _runtime.Runtime.max_spans_per_episode
        record = EpisodeRecord(parent.trace_id, step or 0, "", _SINK, max_spans)
        record.capture_content = active.capture_content if active is not None else _capture_content()
        # the parent's span, as seen from here: children point at it; it is never exported. It
        # carries the episode's step and id (from baggage) for logs and onward propagation.
        anchor = SpanRecord(record, "remote parent", parent.span_id, None, c.KIND_SPAN)
        if step is not None:
            anchor.attributes[c.RL_STEP] = step
        episode_id = baggage.get_baggage(c.RL_EPISODE_ID, remote)
        if episode_id is not None:
            anchor.attributes[c.RL_EPISODE_ID] = str(episode_id)
        record.root = anchor
        self.record, self.trace_id = record, parent.trace_id
        self.context = trace.set_span_in_context(anchor, remote)
        self.logs = TaskLogs(parent.trace_id)

    def __enter__(self) -> _Capture:
        if self.context is not None:
            self.token = otel_context.attach(self.context)
        if self.logs is not None:
            self.logs_token = TASK_LOGS.set(self.logs)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.logs_token is not None:
            try:
                TASK_LOGS.reset(self.logs_token)  # type: ignore[arg-type]
            except ValueError:  # exited in another context (an async task moved): let it be
                TASK_LOGS.set(None)
            self.logs_token = None
        if self.token is not None:
            otel_context.detach(self.token)  # type: ignore[arg-type]
            self.token = None
        if exc is not None and self.record is not None:
            try:
                setattr(exc, _EXC_ATTR, (_encode(self.record), self.trace_id))
                if self.logs is not None:
                    setattr(exc, _EXC_LOGS_ATTR, self.logs.encoded())
            except Exception:  # noqa: BLE001 - an exception type that refuses attributes
                pass

    def result(self, value: Any) -> WorkerResult:
        spans = _encode(self.record) if self.record is not None else b""
        logs, lost = self.logs.encoded() if self.logs is not None else (b"", 0)
        return WorkerResult(value, spans, self.trace_id, logs, lost)


def run_identity() -> dict[str, Any]:
    """The run's ``service.name`` and ``rl.run.id`` (from the configured run, else from the
    logging integration's resource): what a worker process stamps on the records it sends."""
    rt = _runtime.active()
    resource = rt.provider.resource if rt is not None and rt.enabled and rt.provider is not None else None
    if resource is None:
        from otel_rollouts.correlate.logs import active_processor

        processor = active_processor()
        resource = processor.resource if processor is not None else None
    if resource is None:
        return {}
    attributes = resource.attributes
    return {key: attributes[key] for key in (c.SERVICE_NAME, c.RL_RUN_ID) if key in attributes}


def _note_unconfigured() -> None:
    """Before a worker task's first call in a process with no ``configure()``: say, once, what
    is and is not recorded here. The generic "not configured, nothing is recorded" would be
    false: the task's spans *are* recorded, under the caller's episode, and travel back with the
    call. What such a process records on its own (its own episodes, calls made outside an
    episode) is not, which is still worth a warning."""
    slot = _runtime.slot()
    if slot.warned_unconfigured or slot.installed is not None or slot.revive is not None:
        return
    if not slot.claim_unconfigured_note():  # the generic warning would contradict this one
        return
    logger.warning(
        "otel_rollouts: not configured in this worker process (pid %d): the spans of calls made from"
        " an episode are recorded here and travel back with the call to that episode; episodes started"
        " here and calls made outside an episode are not recorded (call otel_rollouts.configure() in"
        " this process to record them)", os.getpid(),
    )


def _run_captured(fn: Callable[..., Any], carrier: Mapping[str, str], args: tuple[Any, ...],
                  kwargs: dict[str, Any], run: Mapping[str, Any] | None = None) -> WorkerResult:
    _note_unconfigured()
    processor, sent = _task_logging(run)
    try:
        with _Capture(carrier) as capture:
            value = fn(*args, **kwargs)
    finally:
        _flush_task_logs(processor, sent)
    return capture.result(value)


async def _run_captured_async(fn: Callable[..., Any], carrier: Mapping[str, str],
                              args: tuple[Any, ...], kwargs: dict[str, Any]) -> WorkerResult:
    """``_run_captured`` for a coroutine function (an async actor's method)."""
    _note_unconfigured()
    with _Capture(carrier) as capture:
        value = await fn(*args, **kwargs)
    return capture.result(value)


def _task_logging(run: Mapping[str, Any] | None) -> tuple[Any, int]:
    """Before a worker task: the records this process sends itself carry the run's identity.
    Returns the process's log processor (None: no records exported here) and its count of
    records sent so far."""
    try:
        from otel_rollouts.correlate.logs import active_processor

        processor = active_processor()
        if processor is None:
            return None, 0
        processor.use_run(run)
        return processor, processor.forwarded
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the task
        from otel_rollouts._core.guard import report

        report(f"worker logging: {exception_text(exc)}")
        return None, 0


def _flush_task_logs(processor: Any, sent: int) -> None:
    """After a worker task that sent log records itself (outside an episode): flush them now,
    so a pool shut down right after the task loses none (a pool's worker exits without its
    exit hooks). On the worker's thread, never the training loop's."""
    if processor is None or processor.forwarded == sent:
        return
    try:
        processor.force_flush(_TASK_FLUSH_MILLIS)
    except Exception as exc:  # noqa: BLE001
        from otel_rollouts._core.guard import report

        report(f"worker logging: {exception_text(exc)}")


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _capture_content() -> bool:
    return env_flag(c.ENV_CAPTURE_CONTENT) is not False


def _encode(record: EpisodeRecord) -> bytes:
    """The worker's finished spans (SDK form, OTLP protobuf); open ones are ended now.

    Never raises: a failure loses these spans (logged once), never the task's result."""
    try:
        return _encode_spans(record)
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the task
        from otel_rollouts._core.guard import report

        report(f"worker spans: {exception_text(exc)}")
        return b""


def _encode_spans(record: EpisodeRecord) -> bytes:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otel_rollouts.delivery.materialize import Materializer

    if not record.spans:
        return b""
    # content rules of this process's configuration if it has one, else the defaults (secrets
    # redacted, long text cut); the parent redacts adopted spans again with its own patterns
    rt = _runtime.installed()
    configured = getattr(getattr(rt, "delivery", None), "materializer", None)
    if configured is not None:
        redact, limit, capture = configured.redact, configured.max_attribute_chars, configured.capture_content
    else:
        from otel_rollouts._core.redaction import make_redactor

        limit = rt.max_attribute_chars if rt is not None else ContentSettings().max_attribute_chars
        redact, capture = make_redactor(True), _capture_content()
    materializer = Materializer(Resource({}), InstrumentationScope(c.SCOPE_NAME),
                                max_attribute_chars=limit, redact=redact, capture_content=capture)
    spans = []
    for span in record.spans:
        if span.end_ns is None:
            span.end_ns = span.start_ns
        spans.append(materializer.span(record.trace_id, span))
    return encode(spans)


# --- the parent side ---------------------------------------------------------------------------
def _decode(data: bytes) -> list[ReadableSpan]:
    """The worker's spans, re-stamped with this run's resource: they are part of its trace."""
    spans = decode(data)
    rt = _runtime.installed()
    if rt is not None and rt.provider is not None:
        return with_resource(spans, rt.provider.resource)
    return spans


def _hand_over_logs(data: bytes, lost: int, trace_id: int, record: EpisodeRecord | None = None) -> None:
    """A worker task's log records join their episode here (kept or dropped with it), with the
    run's resource; never raises."""
    if not data and not lost:
        return
    rt = _runtime.installed()
    counters = rt.counters if rt is not None else None
    try:
        from otel_rollouts.correlate.logs import active_processor, decode_records

        processor = active_processor()
        if lost and counters is not None:
            counters.add("dropped.worker_logs", lost)
        if not data:
            return
        if processor is None:  # this process exports no log records: nowhere for them to go
            if counters is not None:
                counters.add("dropped.worker_logs")
            return
        processor.adopt(trace_id, decode_records(data, processor.resource), record)
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the caller
        if counters is not None:
            counters.add("errors.worker_logs")
        from otel_rollouts._core.guard import report

        report(f"worker log records: {exception_text(exc)}")


def _hand_over(data: bytes, trace_id: int, record: EpisodeRecord | None = None) -> None:
    if not data:
        return
    rt = _runtime.installed()
    if rt is None or not rt.enabled or rt.pipeline is None:
        return
    try:
        rt.pipeline.adopt(_decode(data), record)
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the caller
        if rt.counters is not None:
            rt.counters.add("errors.worker_spans")
        from otel_rollouts._core.guard import report

        report(f"worker spans: {exception_text(exc)}")


def adopt(result: Any, record: EpisodeRecord | None = None) -> Any:
    """The value of a worker task; its spans join their episode (kept or dropped with it).

    Anything that is not a ``WorkerResult`` is returned unchanged, so the same code serves
    thread and process pools.
    """
    if not isinstance(result, WorkerResult):
        return result
    _hand_over(result.spans, result.trace_id, record)
    _hand_over_logs(result.logs, result.lost_logs, result.trace_id, record)
    return result.value


def adopt_exception(exc: BaseException, record: EpisodeRecord | None = None) -> BaseException:
    """Adopt the spans a failed worker task attached to its exception; returns ``exc``."""
    carried = getattr(exc, _EXC_ATTR, None)
    if carried is not None:
        logs = getattr(exc, _EXC_LOGS_ATTR, None)
        for name in (_EXC_ATTR, _EXC_LOGS_ATTR):
            try:
                delattr(exc, name)
            except Exception:  # noqa: BLE001
                pass
        _hand_over(carried[0], carried[1], record)
        if logs is not None:
            _hand_over_logs(logs[0], logs[1], carried[1], record)
    return exc


def submit(executor: concurrent.futures.Executor, fn: Callable[..., Any], /, *args: Any,
           **kwargs: Any) -> concurrent.futures.Future[Any]:
    """``executor.submit(fn, *args, **kwargs)`` in the current episode context.

    Works with ``ThreadPoolExecutor`` and ``ProcessPoolExecutor``: the returned future holds
    ``fn``'s value (or exception); a process worker's spans are adopted into the episode
    before the future completes.
    """
    task = with_context(fn)
    span = trace.get_current_span(task.context)
    record = span.episode if isinstance(span, SpanRecord) else None
    inner = executor.submit(task, *args, **kwargs)
    outer: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(future: concurrent.futures.Future[Any]) -> None:
        if future.cancelled():
            outer.cancel()
            outer.set_running_or_notify_cancel()
            return
        exc = future.exception()
        if exc is not None:
            outer.set_exception(adopt_exception(exc, record))
        else:
            outer.set_result(adopt(future.result(), record))

    inner.add_done_callback(done)
    return outer
