"""Exporters for kept episodes. Each is a standard OpenTelemetry ``SpanExporter``.

* ``TrackioExporter`` — one ``trackio.Trace`` per episode (the embedded, local-first default);
* ``ConsoleExporter`` — an indented tree per episode on a terminal;
* ``OtlpJsonFileExporter`` — OTLP/JSON lines, replayable later (``otel-rollouts replay``).

OTLP to a collector uses the stock ``opentelemetry-exporter-otlp`` exporters.
"""

from otel_rollouts.exporters.console import ConsoleExporter
from otel_rollouts.exporters.otlp_json import OtlpJsonFileExporter
from otel_rollouts.exporters.trackio import TrackioExporter

__all__ = ["ConsoleExporter", "OtlpJsonFileExporter", "TrackioExporter"]
