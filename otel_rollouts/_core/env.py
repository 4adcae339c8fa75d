"""Which OTLP transport the standard environment variables ask for, per signal."""

from __future__ import annotations

import os

from otel_rollouts import conventions as c


def uses_http(signal_env: str) -> bool:
    """True when ``signal_env`` (e.g. ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``), else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, names an HTTP protocol; gRPC by default, as in the SDK."""
    protocol = os.environ.get(signal_env) or os.environ.get(c.ENV_OTLP_PROTOCOL) or "grpc"
    return protocol.strip().lower().startswith("http")
