"""Log records that say which episode they belong to, and (optionally) logs over OTLP.

``otr.instrument_logging()`` stamps every ``logging.LogRecord`` made inside an episode with

* ``trace_id`` (32 hex digits) and ``span_id`` (16 hex) of the current span,
* ``rl_step`` and ``rl_episode_id`` of the episode (from the episode itself, or from the W3C
  baggage of a worker task or a server request that carried them),

so a format such as ``"%(levelname)s [%(trace_id)s step=%(rl_step)s] %(message)s"`` joins a
log line to its trace in Jaeger/Phoenix/Trackio. Outside an episode the fields are ``""`` and
``None`` (format strings never fail).

With ``exporter=`` (any OpenTelemetry ``LogExporter``), ``otlp=True`` or
``OTEL_LOGS_EXPORTER=otlp``, records also go out through an SDK ``LoggerProvider`` with the
run's resource (the same as traces and metrics), carrying the trace context and ``rl.step`` /
``rl.episode.id`` attributes, and what the standard OpenTelemetry handler keeps (``extra=``
fields, ``code.*``, a traceback as ``exception.*``), redacted as spans are.

Logs follow their episode (``EpisodeLogProcessor``, before the batch processor): a record made
inside an episode is held with it and exported only if the tail sampler keeps the episode; a
dropped episode leaves no log record behind (counted ``dropped.episode_logs``). Records made in
a worker process inside a task (``otr.submit`` / ``otr.with_context``) travel back with the
task's result and join the episode in the parent, with the run's resource; a worker's records
outside an episode go out through its own exporter, stamped with the run's ``service.name`` and
``rl.run.id``, flushed when the task that logged them ends.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk._logs import LogRecordProcessor

try:  # the standard handler's translation: in the SDK, moving to opentelemetry-instrumentation-logging
    from opentelemetry.sdk._logs import LoggingHandler
except ImportError:  # pragma: no cover - an SDK that no longer ships it
    from opentelemetry.instrumentation.logging.handler import (  # type: ignore[no-redef,import-not-found]
        LoggingHandler,
    )

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import cut, exception_text, reraise_interrupt, text, type_name
from otel_rollouts._core.redaction import Redactor
from otel_rollouts._core.runtime import EpisodeSink, Redacting
from otel_rollouts._core.settings import check_environment
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord

__all__ = [
    "EpisodeLogFilter",
    "EpisodeLogProcessor",
    "LoggingIntegration",
    "instrument_logging",
    "uninstrument_logging",
]


def episode_fields() -> dict[str, Any]:
    """The four fields for the current context (empty/None outside any span or episode)."""
    ctx = otel_context.get_current()
    span = trace.get_current_span(ctx)
    span_ctx = span.get_span_context()
    fields: dict[str, Any] = {
        c.LOG_TRACE_ID: f"{span_ctx.trace_id:032x}" if span_ctx.is_valid else "",
        c.LOG_SPAN_ID: f"{span_ctx.span_id:016x}" if span_ctx.is_valid else "",
        c.LOG_RL_STEP: None,
        c.LOG_RL_EPISODE_ID: None,
    }
    step = episode_id = None
    if isinstance(span, SpanRecord) and span.episode.root is not None:
        attrs = span.episode.root.attributes
        step, episode_id = attrs.get(c.RL_STEP), attrs.get(c.RL_EPISODE_ID)
    if step is None:
        step = baggage.get_baggage(c.RL_STEP, ctx)
        if isinstance(step, str) and step.lstrip("-").isdigit():
            step = int(step)
    if episode_id is None:
        episode_id = baggage.get_baggage(c.RL_EPISODE_ID, ctx)
    fields[c.LOG_RL_STEP] = step
    fields[c.LOG_RL_EPISODE_ID] = episode_id
    return fields


def _stamp(record: logging.LogRecord) -> None:
    try:
        fields = episode_fields()
    except Exception:  # noqa: BLE001 - logging must never fail because of us
        return
    for key, value in fields.items():
        if not hasattr(record, key) or getattr(record, key) in ("", None):
            setattr(record, key, value)


class EpisodeLogFilter(logging.Filter):
    """A ``logging.Filter`` that stamps the fields on each record it sees (never rejects)."""

    def filter(self, record: logging.LogRecord) -> bool:
        _stamp(record)
        return True


# log records held with their episode: a record's size is its text plus this much (ids, times,
# severity, scope): what ``Pipeline.join_logs`` counts against its byte bound
_RECORD_OVERHEAD = 96
_STAMPED = (c.LOG_TRACE_ID, c.LOG_SPAN_ID, c.LOG_RL_STEP, c.LOG_RL_EPISODE_ID)
# what an attribute value may be as it leaves (OpenTelemetry's AnyValue); anything else is text
_PLAIN = (str, bool, int, float, bytes)
_EMITTING: ContextVar[bool] = ContextVar("otel_rollouts_log_emitting", default=False)


def record_size(body: Any, attributes: Any) -> int:
    """Approximate bytes of a log record: its body and attributes as text, plus a fixed part."""
    size = _RECORD_OVERHEAD
    if isinstance(body, (str, bytes)):
        size += len(body)
    elif body is not None:
        size += 16
    for key, value in (attributes or {}).items():
        size += len(key) + (len(value) if isinstance(value, (str, bytes)) else 16)
    return size


def _count(name: str, n: int = 1) -> None:
    rt = _runtime.active()
    if rt is not None and rt.counters is not None:
        rt.counters.add(name, n)


def _problem(what: str, exc: BaseException) -> None:
    """A failure in the log path: counted and logged once per run, never raised."""
    _count("errors.logs")
    try:
        from otel_rollouts._core.guard import report

        report(f"{what}: {exception_text(exc)}")
    except Exception:  # noqa: BLE001
        pass


class _OtlpHandler(LoggingHandler):
    """Records out through an SDK ``LoggerProvider``, in the caller's trace context.

    The record is translated by the SDK's own ``LoggingHandler`` (so it keeps what the standard
    handler keeps: ``extra=`` fields as attributes, ``code.*`` attributes, a traceback as
    ``exception.type`` / ``exception.message`` / ``exception.stacktrace``), then stamped with
    ``rl.step`` / ``rl.episode.id`` and made fit to leave as spans are: the configured run's
    redactor (the default patterns before ``configure()``) on the body, the logger's name and
    the attributes, text cut to the run's attribute limit, and the content rule: with content
    capture off the body is the message's template without its arguments, and an exception
    keeps only its type (``EXCEPTION_LABEL_KEYS``, as span exception events do).
    """

    def __init__(self, provider: Any, level: int = logging.NOTSET) -> None:
        # not LoggingHandler.__init__: it only stores the provider and warns that the class
        # moves to opentelemetry-instrumentation-logging; its translation is what is used here
        logging.Handler.__init__(self, level)
        self._logger_provider = provider
        self._log_code_attributes = True  # the instrumentation package's handler: code.* as the SDK's
        self.provider = provider
        self.fallback = Redactor()

    def _rules(self) -> tuple[Redacting | None, bool, int]:
        """The redactor, whether content is captured, and the text limit of the run active in
        this context (bound to it, else installed)."""
        rt = _runtime.active()
        if rt is None or not rt.enabled:
            return self.fallback, True, _runtime.Runtime.max_attribute_chars
        return rt.redactor, rt.capture_content, rt.max_attribute_chars

    def emit(self, record: logging.LogRecord) -> None:
        if _EMITTING.get():  # a warning logged while this handler emits: never re-entered
            return
        token = _EMITTING.set(True)
        try:
            _stamp(record)
            try:
                translated = self._translate(record)
            except BaseException as exc:  # noqa: BLE001 - an argument's __str__ raised: formatted
                reraise_interrupt(exc)  # once, here, only when it fails (never on the common path)
                record = _flagged(record)
                translated = self._translate(record)
            name = self.shape(record, translated)
            self.provider.get_logger(name).emit(translated)
        except BaseException as exc:  # noqa: BLE001 - logging never fails because of us, even when
            reraise_interrupt(exc)  # a value's __str__ raises SystemExit (Ctrl-C still stops)
            _problem("log record", exc)
        finally:
            _EMITTING.reset(token)

    def shape(self, record: logging.LogRecord, translated: Any) -> str:
        """Apply the run's rules to the SDK's translation of ``record`` (in place); return the
        logger name as it leaves."""
        redactor, capture, limit = self._rules()
        attributes: dict[str, Any] = {}
        for key, value in dict(translated.attributes or {}).items():
            if key in _STAMPED:
                continue  # our stamps on the LogRecord: they leave as the trace context and rl.*
            if not capture and key in (c.EXCEPTION_MESSAGE, c.EXCEPTION_STACKTRACE):
                continue
            attributes[key] = _plain(value, capture)
        step = getattr(record, c.LOG_RL_STEP, None)
        episode_id = getattr(record, c.LOG_RL_EPISODE_ID, None)
        if step is not None:
            attributes[c.RL_STEP] = step
        if episode_id is not None:
            attributes[c.RL_EPISODE_ID] = str(episode_id)
        # content off: the message's template without its arguments (the values may be
        # content); an f-string message is its own template and cannot be told apart
        if capture:
            body = translated.body
        else:
            body = record.msg if isinstance(record.msg, str) else type_name(record.msg)
        if not isinstance(body, _PLAIN) and body is not None:
            body = str(body) if capture else type_name(body)
        name = record.name
        bounded = getattr(redactor, "bounded", None)

        def out(value: str) -> str:
            if bounded is not None:
                value = bounded(value, limit)
            elif redactor is not None:
                value = redactor(value)
            return cut(value, limit)[0]

        if isinstance(body, str):
            body = out(body)
        attributes = {k: out(v) if isinstance(v, str) else v for k, v in attributes.items()}
        if redactor is not None:
            name = redactor.name(name)
            attributes = redactor.mapping(attributes)
        translated.body = body
        translated.attributes = attributes
        return name

    def flush(self) -> None:
        try:
            self.provider.force_flush()
        except Exception:  # noqa: BLE001
            pass


def _plain(value: Any, capture: bool) -> Any:
    """An attribute value OpenTelemetry takes: text for an object it would drop (its type's
    name with content capture off: its ``str`` may be content)."""
    if value is None or isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
        return list(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, capture) for k, v in value.items()}
    return text(value) if capture else type_name(value)


def _flagged(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` whose message could not be formatted (an argument's ``__str__``
    raised anything, SystemExit included): its template, and which arguments failed, instead of
    losing the record. A copy: the caller's other handlers see the record as it was."""
    flagged = copy.copy(record)
    args = record.args if isinstance(record.args, tuple) else (record.args,)
    shown = ", ".join(text(a) for a in args)
    flagged.msg, flagged.args = f"{text(record.msg)} [arguments not formatted: {shown}]", None
    return flagged


# --- worker tasks: their records travel back with the result ------------------------------
MAX_TASK_LOG_BYTES = 1 << 20


class TaskLogs:
    """The log records of one worker task's episode, kept to travel back with its result
    (bounded: ``MAX_TASK_LOG_BYTES``; what does not fit is counted, then dropped)."""

    __slots__ = ("trace_id", "records", "size", "lost", "lock")

    def __init__(self, trace_id: int) -> None:
        self.trace_id = trace_id
        self.records: list[Any] = []
        self.size = 0
        self.lost = 0
        self.lock = threading.Lock()  # the task's own threads may log too

    def add(self, log_record: Any, size: int) -> None:
        with self.lock:
            if self.size + size > MAX_TASK_LOG_BYTES:
                self.lost += 1
                return
            self.size += size
            self.records.append(log_record)

    def encoded(self) -> tuple[bytes, int]:
        """The records as OTLP protobuf, and how many were lost (never raises)."""
        with self.lock:
            records, lost = list(self.records), self.lost
        if not records:
            return b"", lost
        try:
            return encode_records(records), lost
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the task
            from otel_rollouts._core.guard import report

            report(f"worker log records: {exception_text(exc)}")
            return b"", lost + len(records)


# the log records of the worker task running in this context (None: not in a task's episode)
TASK_LOGS: ContextVar[TaskLogs | None] = ContextVar("otel_rollouts_task_logs", default=None)


def capture_log(log_record: Any, size: int) -> bool:
    """Keep a log record made inside a worker task's episode to travel back with its result
    (True), or leave it to the caller (False: not in a task, or another trace's record)."""
    task = TASK_LOGS.get()
    if task is None or log_record.log_record.trace_id != task.trace_id:
        return False
    task.add(log_record, size)
    return True



class EpisodeLogProcessor(LogRecordProcessor):
    """Log records follow their episode: placed before the batch processor (``downstream``).

    A record made inside an episode this process holds is handed to the tail sampler
    (``Pipeline.join_logs``): held with the episode while it is undecided, passed to
    ``downstream`` if it is kept, dropped and counted if it is dropped. A record made inside a
    worker task (``otr.submit`` / ``otr.with_context`` in another process) is captured and
    travels back with the task's result, to join its episode in the parent. Anything else
    (outside every episode) passes straight to ``downstream``. ``on_emit`` only hands over or
    queues: nothing is exported on the caller's thread.
    """

    def __init__(self, downstream: LogRecordProcessor, resource: Any = None) -> None:
        self.downstream = downstream
        self.resource = resource  # the run's: records adopted from workers are stamped with it
        self.forwarded = 0  # records passed on (a worker flushes after a task that sent some)
        self._resource: Any = None  # the run's identity, once a worker task brought it
        self._merged: dict[int, Any] = {}

    # --- where a record goes ---------------------------------------------------------------
    def on_emit(self, log_record: Any) -> None:  # noqa: D401 - the SDK's hook
        try:
            if capture_log(log_record, _size_of(log_record)):
                return
            trace_id = log_record.log_record.trace_id or 0
            if trace_id and self._join(trace_id, [_detached(log_record)], _size_of(log_record),
                                       _current_episode(trace_id)):
                return
        except BaseException as exc:  # noqa: BLE001 - never the caller's problem
            reraise_interrupt(exc)
            _problem("log record", exc)
        self.forward([log_record])

    # the SDK before 1.35 called ``emit(log_data)``
    emit = on_emit

    def _join(self, trace_id: int, records: list[Any], size: int, record: Any = None) -> bool:
        rt = _runtime.active()
        pipeline = getattr(rt, "pipeline", None) if rt is not None and rt.enabled else None
        join = getattr(pipeline, "join_logs", None)
        if join is None:
            return False
        return bool(join(trace_id, records, self.forward, size, record))

    def adopt(self, trace_id: int, records: Sequence[Any], record: Any = None) -> None:
        """Records made for episode ``trace_id`` in another process (already re-stamped with
        this run's resource): they join the episode, or pass on when it is not known here."""
        if not records:
            return
        size = sum(_size_of(r) for r in records)
        try:
            if trace_id and self._join(trace_id, list(records), size, record):
                return
        except Exception as exc:  # noqa: BLE001
            _problem("worker log records", exc)
        self.forward(records)

    def forward(self, records: Sequence[Any]) -> None:
        """Pass ``records`` to the downstream processor (its ``on_emit`` only queues)."""
        for log_record in records:
            try:
                if self._resource is not None and log_record.resource is not None:
                    log_record.resource = self._run_resource(log_record.resource)
                self.forwarded += 1
                self.downstream.on_emit(log_record)
            except Exception as exc:  # noqa: BLE001
                _problem("log record", exc)

    # --- a worker learns the run it works for --------------------------------------------
    def use_run(self, identity: Mapping[str, Any] | None) -> None:
        """Stamp records sent from this process with the run's identity (``service.name``,
        ``rl.run.id``): a worker process logs as part of the run it works for."""
        if not identity:
            return
        from opentelemetry.sdk.resources import Resource

        current = self._resource
        if current is not None and dict(current.attributes) == dict(identity):
            return
        self._merged = {}
        self._resource = Resource(dict(identity))

    def _run_resource(self, resource: Any) -> Any:
        key = id(resource)
        merged = self._merged.get(key)
        if merged is None:
            if len(self._merged) > 64:
                self._merged.clear()
            merged = self._merged[key] = resource.merge(self._resource)
        return merged

    def evaluations(self, record: EpisodeRecord) -> None:
        """A kept episode's evaluations (reward, each component, advantage, status) as
        log-based ``gen_ai.evaluation.result`` events, the carrier the GenAI conventions name now
        that span events are deprecated: parented to the span evaluated (the episode's root),
        with the run's resource. The same events are on the root as span events."""
        root = record.root
        if root is None:
            return
        from opentelemetry._logs import LogRecord
        from opentelemetry.sdk._logs import ReadWriteLogRecord
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        from otel_rollouts._core.messages import episode_evaluations
        from otel_rollouts.delivery.views import evaluation_events

        at = root.end_ns or root.start_ns
        scope = InstrumentationScope(c.SCOPE_NAME)
        evaluated = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            record.trace_id, root.span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))),
            otel_context.Context())
        records = [
            ReadWriteLogRecord(LogRecord(timestamp=at, observed_timestamp=at, context=evaluated,
                                         event_name=name, attributes=attrs),
                               resource=self.resource, instrumentation_scope=scope)
            for name, attrs in evaluation_events(episode_evaluations(root.attributes))
        ]
        if records:
            self.forward(records)

    def shutdown(self) -> None:
        self.downstream.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.downstream.force_flush(timeout_millis))


def _size_of(log_record: Any) -> int:
    inner = log_record.log_record
    return record_size(inner.body, inner.attributes)


def _detached(log_record: Any) -> Any:
    """``log_record`` for holding: its API record copied without the caller's context (which
    may hold large values), other processors' view left as it was."""
    inner = copy.copy(log_record.log_record)
    try:
        inner.context = None
    except Exception:  # noqa: BLE001 - an SDK whose record has no settable context
        pass
    held = copy.copy(log_record)
    held.log_record = inner
    return held


def _current_episode(trace_id: int) -> EpisodeRecord | None:
    """The episode record of the current span when it is ``trace_id``'s (a faster join)."""
    span = trace.get_current_span()
    if isinstance(span, SpanRecord) and span.episode.trace_id == trace_id:
        return span.episode
    return None


# --- log records across processes (OTLP protobuf, as worker spans travel) ------------------------
def encode_records(records: Sequence[Any]) -> bytes:
    """The OTLP protobuf encoding of SDK log records (one ``ExportLogsServiceRequest``)."""
    from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

    return bytes(encode_logs(records).SerializeToString())


def decode_records(data: bytes, resource: Any) -> list[Any]:
    """SDK log records from ``encode_records``'s bytes, stamped with ``resource`` (records made
    in a worker belong to the run that adopts them)."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    from otel_rollouts._core.codec import logs_from_request

    request = ExportLogsServiceRequest()
    request.ParseFromString(data)
    return [record for _, record, _ in logs_from_request(request, resource)]


class LoggingIntegration:
    """What ``instrument_logging`` installed; ``uninstall()`` removes it."""

    def __init__(self, logger: logging.Logger | None, filter_: EpisodeLogFilter | None,
                 factory: Any, previous_factory: Any, handler: _OtlpHandler | None,
                 processor: EpisodeLogProcessor | None = None) -> None:
        self.logger = logger
        self.filter = filter_
        self.factory = factory
        self.previous_factory = previous_factory
        self.handler = handler
        self.processor = processor
        self._watched: EpisodeSink | None = None  # the pipeline told to hand over kept episodes

    def watch(self, runtime: Any) -> None:
        """Have the sampling pipeline of ``runtime`` (the installed run, when there is one)
        hand each kept episode to the processor, whose evaluations go out as log records."""
        pipeline = runtime.pipeline if runtime is not None else None
        if pipeline is None or self.processor is None:
            return
        pipeline.on_kept(self.processor.evaluations)
        self._watched = pipeline

    @property
    def logger_provider(self) -> Any:
        """The SDK ``LoggerProvider`` exporting the records, or None."""
        return self.handler.provider if self.handler is not None else None

    def flush(self, timeout_millis: int = 10_000) -> bool:
        if self.handler is None:
            return True
        return bool(self.handler.provider.force_flush(timeout_millis))

    def uninstall(self) -> None:
        if self._watched is not None:
            self._watched.on_kept(None)
            self._watched = None
        if self.factory is not None and logging.getLogRecordFactory() is self.factory:
            logging.setLogRecordFactory(self.previous_factory)
        target = self.logger or logging.getLogger()
        if self.filter is not None:
            target.removeFilter(self.filter)
        if self.handler is not None:
            target.removeHandler(self.handler)
            try:
                self.handler.provider.shutdown()
            except Exception:  # noqa: BLE001
                pass


def _uninstall_active() -> None:
    """Remove the process's current integration, if any (the slot's lock held)."""
    slot = _runtime.slot()
    active = slot.logging_integration
    slot.logging_integration = None
    if isinstance(active, LoggingIntegration):
        active.uninstall()


def instrument_logging(
    logger: logging.Logger | str | None = None,
    *,
    exporter: Any = None,
    otlp: bool | None = None,
    level: int = logging.NOTSET,
) -> LoggingIntegration:
    """Stamp log records with the episode's ids; optionally export them (see module doc).

    ``logger=None`` stamps records of every logger (a ``LogRecord`` factory) and exports from
    the root logger; a logger (or its name) gets a filter and the exporting handler instead
    (a logger's filters see only records logged on that very logger). Call after
    ``configure()`` so exported records carry the run's resource. Calling again replaces the
    previous integration.
    """
    slot = _runtime.slot()
    with slot.logging_lock:
        _uninstall_active()
        target = logging.getLogger(logger) if isinstance(logger, str) else logger
        filter_ = factory = previous = None
        if target is None:
            previous = logging.getLogRecordFactory()

            def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
                record = previous(*args, **kwargs)
                _stamp(record)
                return record

            logging.setLogRecordFactory(factory)
        else:
            filter_ = EpisodeLogFilter()
            target.addFilter(filter_)
        handler = None
        if otlp is None:
            check_environment()
            wanted = os.environ.get(c.ENV_LOGS_EXPORTER, "").lower().split(",")
            otlp = "otlp" in [w.strip() for w in wanted]
        processor = None
        if exporter is not None or otlp:
            provider, processor = _logger_provider(exporter)
            handler = _OtlpHandler(provider, level)
            (target or logging.getLogger()).addHandler(handler)
        integration = LoggingIntegration(target, filter_, factory, previous, handler, processor)
        slot.logging_integration = integration
        if processor is not None:  # each kept episode's evaluations go out as log-based events
            integration.watch(_runtime.installed())
        return integration


def uninstrument_logging() -> None:
    """Remove what ``instrument_logging`` installed (flushing and closing its exporter)."""
    with _runtime.slot().logging_lock:
        _uninstall_active()


def active_processor() -> EpisodeLogProcessor | None:
    """The episode-aware processor of this process's logging integration (None: no records are
    exported from this process)."""
    active = _runtime.slot().logging_integration
    return active.processor if isinstance(active, LoggingIntegration) else None


def _logger_provider(exporter: Any) -> tuple[Any, EpisodeLogProcessor]:
    """An SDK ``LoggerProvider`` with the run's resource: records go through the episode-aware
    processor, then a batch processor (export on its own thread)."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    # the SDK reads OTEL_BLRP_* and OTEL_EXPORTER_OTLP_* here and raises on an invalid value:
    # validated first (one warning naming the variable, the default used; see settings)
    check_environment()
    rt = _runtime.installed()
    if rt is not None and rt.provider is not None:
        resource = rt.provider.resource
    else:
        from otel_rollouts.correlate.resource import run_resource

        resource = run_resource()
    if exporter is None:
        from otel_rollouts.delivery.defaults import otlp_log_exporter

        exporter = otlp_log_exporter()  # per OTEL_EXPORTER_OTLP_(LOGS_)PROTOCOL, http/json included
    provider = LoggerProvider(resource=resource, shutdown_on_exit=True)
    processor = EpisodeLogProcessor(BatchLogRecordProcessor(exporter), resource)
    provider.add_log_record_processor(processor)
    return provider, processor
