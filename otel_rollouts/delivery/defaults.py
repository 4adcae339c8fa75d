"""The exporters a run gets when it names none: local Trackio, plus OTLP when the standard
environment asks for it."""

from __future__ import annotations

import os

from opentelemetry.sdk.trace.export import SpanExporter

from otel_rollouts import conventions as c
from otel_rollouts._core.env import uses_http
from otel_rollouts._core.redaction import Redactor
from otel_rollouts.delivery.phoenix import PhoenixAnnotations

__all__ = ["default_exporters", "otlp_exporter_from_env"]


def default_exporters(project: str | None = None, redactor: Redactor | None = None) -> list[SpanExporter]:
    """Local Trackio (nothing to start), plus OTLP when an OTLP endpoint is set in the env."""
    from otel_rollouts.exporters import TrackioExporter

    exporters: list[SpanExporter] = [
        TrackioExporter(project or os.environ.get(c.ENV_TRACKIO_PROJECT) or "otel-rollouts",
                        redact=redactor if redactor is not None else False)
    ]
    if os.environ.get(c.ENV_OTLP_TRACES_ENDPOINT) or os.environ.get(c.ENV_OTLP_ENDPOINT):
        exporters.append(otlp_exporter_from_env())
    return exporters


def otlp_exporter_from_env() -> SpanExporter:
    """The stock OTLP span exporter for ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` (default grpc),
    posting each episode's evaluations to Phoenix as span annotations when its endpoint is a
    Phoenix (``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS``, see ``delivery.phoenix``)."""
    exporter_class: type[SpanExporter]
    if uses_http(c.ENV_OTLP_TRACES_PROTOCOL):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        exporter_class = Http
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        exporter_class = Grpc
    timeout = None
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        timeout = 5.0  # its own retries must give up soon: our spool retries for as long as it takes
    exporter = exporter_class(timeout=timeout)  # type: ignore[call-arg]
    PhoenixAnnotations.attach(exporter)
    return exporter
