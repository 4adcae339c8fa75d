"""Which OTLP transport the standard environment variables ask for, per signal."""

from __future__ import annotations

import os

from otel_rollouts import conventions as c

__all__ = ["GRPC", "HTTP_JSON", "HTTP_PROTOBUF", "PROTOCOLS", "otlp_protocol", "protocol_source", "uses_http"]

# the values of OTEL_EXPORTER_OTLP_(TRACES_|METRICS_|LOGS_)PROTOCOL (OpenTelemetry's exporter spec)
GRPC, HTTP_PROTOBUF, HTTP_JSON = "grpc", "http/protobuf", "http/json"
PROTOCOLS = (GRPC, HTTP_PROTOBUF, HTTP_JSON)


def protocol_source(signal_env: str) -> str | None:
    """The variable whose valid value sets the protocol of ``signal_env``'s signal:
    ``signal_env`` itself (e.g. ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``), else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``; None when neither holds a valid one.

    A value that is not a protocol is skipped here as if it were unset; ``check_environment``
    (settings) is what warns about it by name, and removes it."""
    for variable in (signal_env, c.ENV_OTLP_PROTOCOL):
        if (os.environ.get(variable) or "").strip().lower() in PROTOCOLS:
            return variable
    return None


def otlp_protocol(signal_env: str) -> str:
    """``grpc``, ``http/protobuf`` or ``http/json``: what ``signal_env``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, asks for; gRPC by default, as in the Python SDK."""
    variable = protocol_source(signal_env)
    return GRPC if variable is None else (os.environ.get(variable) or GRPC).strip().lower()


def uses_http(signal_env: str) -> bool:
    """True when ``signal_env`` (e.g. ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``), else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, names an HTTP protocol (protobuf or JSON)."""
    return otlp_protocol(signal_env) != GRPC
