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
``rl.episode.id`` attributes. Logs are not tail-sampled: a dropped episode's log records are
exported all the same (they name a trace that will not exist).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import type_name
from otel_rollouts._core.env import uses_http
from otel_rollouts._core.redaction import Redactor
from otel_rollouts._core.runtime import Redacting
from otel_rollouts._core.settings import check_environment
from otel_rollouts._core.spans import SpanRecord

__all__ = ["EpisodeLogFilter", "LoggingIntegration", "instrument_logging", "uninstrument_logging"]


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


_SEVERITY = ((logging.CRITICAL, 21, "FATAL"), (logging.ERROR, 17, "ERROR"),
             (logging.WARNING, 13, "WARN"), (logging.INFO, 9, "INFO"), (logging.DEBUG, 5, "DEBUG"))


class _OtlpHandler(logging.Handler):
    """Records out through an SDK ``LoggerProvider``, in the caller's trace context.

    Redacted as spans are (the configured run's redactor; the default patterns before
    ``configure()``): the body, the logger's name and the attributes.
    """

    def __init__(self, provider: Any, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.provider = provider
        self.fallback = Redactor()

    def _rules(self) -> tuple[Redacting | None, bool]:
        """The redactor and whether content is captured, of the configured run."""
        rt = _runtime.installed()
        if rt is None or not rt.enabled:
            return self.fallback, True
        return rt.redactor, rt.capture_content

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from opentelemetry._logs import SeverityNumber

            number, text = 1, record.levelname
            for level, n, name in _SEVERITY:
                if record.levelno >= level:
                    number, text = n, name
                    break
            _stamp(record)
            attributes: dict[str, Any] = {}
            step = getattr(record, c.LOG_RL_STEP, None)
            episode_id = getattr(record, c.LOG_RL_EPISODE_ID, None)
            if step is not None:
                attributes[c.RL_STEP] = step
            if episode_id is not None:
                attributes[c.RL_EPISODE_ID] = str(episode_id)
            redactor, capture = self._rules()
            # content off: the message's template without its arguments (the values may be
            # content); an f-string message is its own template and cannot be told apart
            if capture:
                body = record.getMessage()
            else:
                body = record.msg if isinstance(record.msg, str) else type_name(record.msg)
            name = record.name
            if redactor is not None:
                body, name = redactor(body), redactor.name(name)
                attributes = redactor.mapping(attributes)
            self.provider.get_logger(name).emit(
                timestamp=int(record.created * 1e9),
                context=otel_context.get_current(),
                severity_number=SeverityNumber(number),
                severity_text=text,
                body=body,
                attributes=attributes,
            )
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def flush(self) -> None:
        try:
            self.provider.force_flush()
        except Exception:  # noqa: BLE001
            pass


class LoggingIntegration:
    """What ``instrument_logging`` installed; ``uninstall()`` removes it."""

    def __init__(self, logger: logging.Logger | None, filter_: EpisodeLogFilter | None,
                 factory: Any, previous_factory: Any, handler: _OtlpHandler | None) -> None:
        self.logger = logger
        self.filter = filter_
        self.factory = factory
        self.previous_factory = previous_factory
        self.handler = handler

    @property
    def logger_provider(self) -> Any:
        """The SDK ``LoggerProvider`` exporting the records, or None."""
        return self.handler.provider if self.handler is not None else None

    def flush(self, timeout_millis: int = 10_000) -> bool:
        if self.handler is None:
            return True
        return bool(self.handler.provider.force_flush(timeout_millis))

    def uninstall(self) -> None:
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
        if exporter is not None or otlp:
            handler = _OtlpHandler(_logger_provider(exporter), level)
            (target or logging.getLogger()).addHandler(handler)
        integration = LoggingIntegration(target, filter_, factory, previous, handler)
        slot.logging_integration = integration
        return integration


def uninstrument_logging() -> None:
    """Remove what ``instrument_logging`` installed (flushing and closing its exporter)."""
    with _runtime.slot().logging_lock:
        _uninstall_active()


def _logger_provider(exporter: Any) -> Any:
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
        exporter = _otlp_log_exporter()
    provider = LoggerProvider(resource=resource, shutdown_on_exit=True)
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    return provider


def _otlp_log_exporter() -> Any:
    if uses_http(c.ENV_OTLP_LOGS_PROTOCOL):
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as Http

        return Http()
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as Grpc

    return Grpc()
