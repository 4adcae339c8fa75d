"""Server side: the episode identity that arrives as W3C baggage, copied onto the server's spans.

Inside an episode every request carries ``rl.run.id``, ``rl.step``, ``rl.episode.id`` and
``rl.group.id`` in its ``baggage`` header (whatever propagator sends it: ours or a stock
instrumentation's). An inference server, reward model or environment service that calls

    otr.copy_baggage_to_spans()           # once, after its TracerProvider is set up

gets those keys as attributes on each of its spans started under the request's context (the
server span its framework instrumentation makes and every child of it), so its telemetry can be
searched by episode in Jaeger/Tempo/Phoenix even when the episode's own trace was dropped.

The copy is done by the OpenTelemetry contrib ``BaggageSpanProcessor`` (package
``opentelemetry-processor-baggage``, imported only here, when asked for), restricted to the
rl.* keys: other baggage entries (which may hold anything a client put there) are not copied.
Baggage values are strings, so ``rl.step`` is a string attribute on the server's spans.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from opentelemetry import trace

from otel_rollouts import conventions as c

__all__ = ["copy_baggage_to_logs", "copy_baggage_to_spans"]

logger = logging.getLogger("otel_rollouts")


def _predicate(keys: Iterable[str] | None) -> object:
    """A key predicate accepting exactly ``keys`` (default: the episode identity keys)."""
    allowed = frozenset(c.BAGGAGE_KEYS if keys is None else (str(k) for k in keys))
    return allowed.__contains__


def _processor_module() -> object | None:
    """``opentelemetry.processor.baggage``, or None (logged) when the package is not installed."""
    try:
        import opentelemetry.processor.baggage as module
    except ImportError:
        logger.warning(
            "otel_rollouts: copying baggage needs the package opentelemetry-processor-baggage; "
            "nothing is copied"
        )
        return None
    return module


def copy_baggage_to_spans(tracer_provider: object = None, keys: Iterable[str] | None = None) -> object | None:
    """Add a span processor to ``tracer_provider`` (default: the global one) that copies the
    rl.* entries (or ``keys``) of each span's parent-context baggage onto the span at start.

    Returns the processor, or None when nothing was added: the provider is not an SDK
    ``TracerProvider`` (no ``add_span_processor``), or the contrib package is missing. Never
    raises: a server keeps serving without the attributes.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    return _add(provider, "add_span_processor", "BaggageSpanProcessor", keys, "copy_baggage_to_spans",
                "an SDK TracerProvider")


def copy_baggage_to_logs(logger_provider: object, keys: Iterable[str] | None = None) -> object | None:
    """The log counterpart: add a log-record processor to ``logger_provider`` (an SDK
    ``LoggerProvider``) that copies the rl.* baggage (or ``keys``) of the context current when a
    record is emitted onto the record's attributes: a server's log lines written while serving an
    episode's request then carry its identity too.

    Add it before the exporting processor (processors run in the order they were added). Returns
    the processor or None (not an SDK provider, package missing); never raises.
    """
    return _add(logger_provider, "add_log_record_processor", "BaggageLogProcessor", keys,
                "copy_baggage_to_logs", "an SDK LoggerProvider")


def _add(provider: object, adder: str, processor_class: str, keys: Iterable[str] | None, what: str,
         needs: str) -> object | None:
    """Add the contrib baggage processor ``processor_class`` to ``provider``; None if it cannot."""
    try:
        add = getattr(provider, adder, None)
        if add is None:
            logger.warning("otel_rollouts: %s needs %s; got %r", what, needs, type(provider).__name__)
            return None
        module = _processor_module()
        if module is None:
            return None
        processor = getattr(module, processor_class)(_predicate(keys))
        add(processor)
        return processor
    except Exception as exc:  # noqa: BLE001 - a server's telemetry setup never stops the server
        logger.warning("otel_rollouts: %s failed: %s", what, exc)
        return None
