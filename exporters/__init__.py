"""Exporters for kept episodes. Each is a standard OpenTelemetry ``SpanExporter``.

* ``TrackioExporter`` — one ``trackio.Trace`` per episode (the embedded, local-first default);
* ``ConsoleExporter`` — an indented tree per episode on a terminal;
* ``OtlpJsonFileExporter`` — OTLP/JSON lines, replayable later (``otel-rollouts replay``);
* ``DatasetExporter`` — kept episodes as dataset rows (Parquet and a Hugging Face dataset).

OTLP to a collector uses the stock ``opentelemetry-exporter-otlp`` exporters.

What an exporter may offer beyond ``SpanExporter`` (step summaries, a step's groups, episodes it
took but did not store, running episodes shown as they hang) are the protocols of
``otel_rollouts.exporters.extras``: ``MetricsSink``, ``GroupsSink``, ``NotStoredReporter`` and
``PendingViewer``.
"""

from otel_rollouts.exporters.console import ConsoleExporter
from otel_rollouts.exporters.dataset import DatasetExporter
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink, NotStoredReporter, PendingViewer
from otel_rollouts.exporters.otlp_json import OtlpJsonFileExporter
from otel_rollouts.exporters.trackio import TrackioExporter

__all__ = [
    "ConsoleExporter",
    "DatasetExporter",
    "GroupsSink",
    "MetricsSink",
    "NotStoredReporter",
    "OtlpJsonFileExporter",
    "PendingViewer",
    "TrackioExporter",
]
