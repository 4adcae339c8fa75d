"""OTLP/HTTP with JSON bodies (``OTEL_EXPORTER_OTLP_PROTOCOL=http/json``), for spans, logs and
metrics.

The OpenTelemetry Python SDK ships OTLP/HTTP exporters for protobuf only. These are the SDK's
own exporters (``opentelemetry.exporter.otlp.proto.http``), so they read the same environment
variables (``OTEL_EXPORTER_OTLP_[SIGNAL_]ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``,
``_COMPRESSION``, ``_CERTIFICATE``, ``_CLIENT_KEY``, ``_CLIENT_CERTIFICATE``) and keep their
session, retries with backoff, ``Retry-After``, gzip/deflate, request-size limit and self-metrics.
Only the body changes: the exporter hands its HTTP client the serialised protobuf request; here
that client is wrapped so it posts the same request as OTLP/JSON instead (protobuf's JSON
mapping with hex ``traceId``/``spanId``/``parentSpanId`` and integer enums, as the OTLP
specification requires: https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding), with
``Content-Type: application/json``. The encoding is ``otlp_json.encode_message``, the one the
OTLP/JSON file exporter writes.

The cost of re-reading the protobuf bytes (a few microseconds per span, in C) is paid on the
exporter's thread, never on the training thread. The request-size limit is checked, as the SDK
does, on the protobuf size; the JSON body is about twice that.

The SDK's HTTP client is private API (``_client`` with ``export(bytes)``, ``_headers``; SDK
1.4x). On an SDK without it, constructing these exporters raises ``TypeError``; the factories in
``otel_rollouts.delivery.defaults`` then warn by name and fall back to http/protobuf.
"""

from __future__ import annotations

import logging
from typing import Any

from google.protobuf.message import Message
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_rollouts.exporters.otlp_json import encode_message

__all__ = ["JSON_CONTENT_TYPE", "OTLPJsonLogExporter", "OTLPJsonMetricExporter", "OTLPJsonSpanExporter"]

logger = logging.getLogger("otel_rollouts")

JSON_CONTENT_TYPE = "application/json"


class _JsonClient:
    """Stands in for an SDK OTLP/HTTP exporter's client: ``export(data)`` receives the
    serialised protobuf request, re-encodes it as OTLP/JSON and lets the SDK's client post it
    (its compression, retries and error handling unchanged). Everything else is the client's."""

    def __init__(self, client: Any, request_type: type[Message]) -> None:
        headers = getattr(client, "_headers", None)
        if not callable(getattr(client, "export", None)) or not isinstance(headers, dict):
            raise TypeError("this OpenTelemetry SDK's OTLP/HTTP exporter has no client to post JSON through")
        for key in [k for k in headers if isinstance(k, str) and k.lower() == "content-type"]:
            del headers[key]
        headers["content-type"] = JSON_CONTENT_TYPE
        self._client = client
        self._request_type = request_type

    def export(self, data: bytes) -> Any:
        try:
            request = self._request_type.FromString(data)
            body = encode_message(request).encode("utf-8")
        except Exception as exc:  # noqa: BLE001 - an export fails (and is counted), never raises
            logger.error("otel_rollouts: could not encode an OTLP/JSON request: %s", exc)
            from opentelemetry.exporter.otlp.common.http import _ExportResult

            return _ExportResult(False, None, None, exc)
        return self._client.export(body)

    def shutdown(self) -> None:
        self._client.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # a layer that wraps the client's parts (``delivery.otlp_probe`` wraps ``_transport``)
        # must reach the client that uses them
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._client, name, value)


_OWN = frozenset({"_client", "_request_type"})


def _post_json(exporter: Any, request_type: type[Message]) -> None:
    try:
        exporter._client = _JsonClient(getattr(exporter, "_client", None), request_type)
    except TypeError:
        try:
            exporter.shutdown()  # its HTTP session, opened by the SDK's constructor
        except Exception:  # noqa: BLE001 - the TypeError is what the caller needs
            pass
        raise


class OTLPJsonSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter (same arguments, same environment variables), posting
    OTLP/JSON to ``…/v1/traces``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _post_json(self, ExportTraceServiceRequest)


class OTLPJsonLogExporter(OTLPLogExporter):
    """The SDK's OTLP/HTTP log exporter, posting OTLP/JSON to ``…/v1/logs``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _post_json(self, ExportLogsServiceRequest)


class OTLPJsonMetricExporter(OTLPMetricExporter):
    """The SDK's OTLP/HTTP metric exporter, posting OTLP/JSON to ``…/v1/metrics``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _post_json(self, ExportMetricsServiceRequest)
