"""Where the span gateway sends the log records it received (rebuilt as SDK records by the
codec, with their own resource and scope): any SDK log exporter sends them on unchanged."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from otel_rollouts import conventions as c
from otel_rollouts._core.stats import Stats

if TYPE_CHECKING:
    from opentelemetry.sdk._logs import ReadWriteLogRecord
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExporter

__all__ = ["LogOutlet", "default_log_exporter"]

logger = logging.getLogger("otel_rollouts")


class LogOutlet:
    """Where received log records of kept episodes (and of no episode) go: an SDK log exporter
    behind a batch processor (its ``on_emit`` only queues: the caller never waits)."""

    def __init__(self, exporter: LogRecordExporter | None, stats: Stats) -> None:
        self.stats = stats
        self._exporter = exporter
        self._processor: BatchLogRecordProcessor | None = None
        self._lock = threading.Lock()

    def _ready(self) -> BatchLogRecordProcessor | None:
        if self._processor is None and self._exporter is not None:
            with self._lock:
                if self._processor is None:
                    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

                    self._processor = BatchLogRecordProcessor(self._exporter)
        return self._processor

    def send(self, records: Sequence[ReadWriteLogRecord]) -> None:
        processor = self._ready()
        if processor is None:
            self.stats.add("dropped.gateway_logs_no_exporter", len(records))
            return
        for record in records:
            processor.on_emit(record)
        self.stats.add("gateway.logs_sent", len(records))

    def flush(self, timeout_millis: int = 5_000) -> bool:
        processor = self._processor
        return True if processor is None else bool(processor.force_flush(timeout_millis))

    def shutdown(self) -> None:
        processor = self._processor
        if processor is not None:
            try:
                processor.shutdown()
            except Exception:  # noqa: BLE001
                pass


def default_log_exporter() -> LogRecordExporter | None:
    """The OTLP log exporter the environment asks for (``OTEL_LOGS_EXPORTER=otlp``, or an OTLP
    logs endpoint set), else None: received records of kept episodes are then counted, not sent."""
    wanted = [w.strip() for w in os.environ.get(c.ENV_LOGS_EXPORTER, "").lower().split(",")]
    if "none" in wanted:
        return None
    if "otlp" not in wanted and not (os.environ.get(c.ENV_OTLP_ENDPOINT) or os.environ.get(c.ENV_OTLP_LOGS_ENDPOINT)):
        return None
    from otel_rollouts.delivery.defaults import otlp_log_exporter

    return otlp_log_exporter()
