"""The exporters a run gets when it names none, and the OTLP exporters the standard environment
asks for.

``OTEL_TRACES_EXPORTER`` unset: local Trackio, plus OTLP when an OTLP endpoint is set (the
two-command default). Set: exactly the exporters it names, as OpenTelemetry's SDK environment
specification says (https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/#exporter-selection):
``otlp`` (the protocol from ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``), ``otlp_proto_grpc``,
``otlp_proto_http``, ``console`` (our episode tree on stdout), ``trackio`` (our name for the
local Trackio project), ``none`` (no exporter: episodes are still sampled and counted), or any
installed ``opentelemetry_traces_exporter`` entry point (e.g. ``zipkin``), built with no
arguments as the SDK builds it. Invalid values are refused by name in ``_core.settings``.

Each OTLP factory picks the transport from ``OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL``, else
``OTEL_EXPORTER_OTLP_PROTOCOL``, else gRPC: ``grpc``, ``http/protobuf`` (the SDK's exporters) or
``http/json`` (``exporters.otlp_http_json``: the SDK's HTTP exporter posting OTLP/JSON).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace.export import SpanExporter

from otel_rollouts import conventions as c
from otel_rollouts._core.content import exception_text, reraise_interrupt
from otel_rollouts._core.env import GRPC, HTTP_JSON, HTTP_PROTOBUF, otlp_protocol, protocol_source
from otel_rollouts._core.redaction import Redactor
from otel_rollouts._core.settings import TRACES_EXPORTER_GROUP, traces_exporter_names
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.phoenix import PhoenixAnnotations

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["default_exporters", "otlp_exporter_from_env", "otlp_log_exporter", "otlp_metric_exporter"]

logger = logging.getLogger("otel_rollouts")

# per signal: its protocol variable, and the exporter class ("module:Class") for each protocol
_OTLP: dict[str, tuple[str, dict[str, str]]] = {
    "traces": (c.ENV_OTLP_TRACES_PROTOCOL, {
        GRPC: "opentelemetry.exporter.otlp.proto.grpc.trace_exporter:OTLPSpanExporter",
        HTTP_PROTOBUF: "opentelemetry.exporter.otlp.proto.http.trace_exporter:OTLPSpanExporter",
        HTTP_JSON: "otel_rollouts.exporters.otlp_http_json:OTLPJsonSpanExporter",
    }),
    "logs": (c.ENV_OTLP_LOGS_PROTOCOL, {
        GRPC: "opentelemetry.exporter.otlp.proto.grpc._log_exporter:OTLPLogExporter",
        HTTP_PROTOBUF: "opentelemetry.exporter.otlp.proto.http._log_exporter:OTLPLogExporter",
        HTTP_JSON: "otel_rollouts.exporters.otlp_http_json:OTLPJsonLogExporter",
    }),
    "metrics": (c.ENV_OTLP_METRICS_PROTOCOL, {
        GRPC: "opentelemetry.exporter.otlp.proto.grpc.metric_exporter:OTLPMetricExporter",
        HTTP_PROTOBUF: "opentelemetry.exporter.otlp.proto.http.metric_exporter:OTLPMetricExporter",
        HTTP_JSON: "otel_rollouts.exporters.otlp_http_json:OTLPJsonMetricExporter",
    }),
}


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _otlp(signal: str, protocol: str | None = None, **kwargs: object) -> Any:
    """The OTLP exporter of ``signal`` for ``protocol`` (default: what the environment asks).
    http/json on an SDK whose HTTP exporter cannot post JSON: a warning naming the variable,
    and http/protobuf instead (never protobuf sent as if it were JSON, never silently)."""
    variable, classes = _OTLP[signal]
    protocol = protocol or otlp_protocol(variable)
    if protocol == HTTP_JSON:
        try:
            return _load(classes[HTTP_JSON])(**kwargs)
        except TypeError as exc:
            logger.warning("otel_rollouts: %s=http/json: %s; using http/protobuf instead",
                           protocol_source(variable) or variable, exc)
            protocol = HTTP_PROTOBUF
    return _load(classes[protocol if protocol in classes else GRPC])(**kwargs)


def otlp_exporter_from_env(protocol: str | None = None) -> SpanExporter:
    """The OTLP span exporter for ``protocol``, default ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``
    (else grpc), posting each episode's evaluations to Phoenix as span annotations when its
    endpoint is a Phoenix (``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS``, see ``delivery.phoenix``)."""
    timeout = None
    if not (os.environ.get(c.ENV_OTLP_TRACES_TIMEOUT) or os.environ.get(c.ENV_OTLP_TIMEOUT)):
        timeout = 5.0  # its own retries must give up soon: our spool retries for as long as it takes
    exporter: SpanExporter = _otlp("traces", protocol, timeout=timeout)
    PhoenixAnnotations.attach(exporter)
    return exporter


def otlp_log_exporter() -> Any:
    """The OTLP log record exporter for ``OTEL_EXPORTER_OTLP_(LOGS_)PROTOCOL`` (else grpc)."""
    return _otlp("logs")


def otlp_metric_exporter() -> Any:
    """The OTLP metric exporter for ``OTEL_EXPORTER_OTLP_(METRICS_)PROTOCOL`` (else grpc)."""
    return _otlp("metrics")


def _trackio(project: str | None, redactor: Redactor | None, run: str | None) -> SpanExporter:
    """Local Trackio. ``run``: the run id the user gave (``configure(run_id=)``,
    ``OTEL_ROLLOUTS_RUN_ID``), the Trackio run's name: every process of one training run (a
    trainer's workers, Ray actors) then writes one Trackio run, not one of its own each; None
    (no id given): Trackio names a new run."""
    from otel_rollouts.exporters import TrackioExporter

    return TrackioExporter(project or os.environ.get(c.ENV_TRACKIO_PROJECT) or "otel-rollouts", run=run,
                           redact=redactor if redactor is not None else False)


def _named(name: str, project: str | None, redactor: Redactor | None, run: str | None) -> SpanExporter:
    """The exporter ``OTEL_TRACES_EXPORTER`` names ``name`` (validated in settings)."""
    if name == "trackio":
        return _trackio(project, redactor, run)
    if name == "otlp":
        return otlp_exporter_from_env()
    if name == "otlp_proto_grpc":
        return otlp_exporter_from_env(GRPC)
    if name == "otlp_proto_http":  # HTTP, in JSON only when the protocol variable says so
        json = otlp_protocol(c.ENV_OTLP_TRACES_PROTOCOL) == HTTP_JSON
        return otlp_exporter_from_env(HTTP_JSON if json else HTTP_PROTOBUF)
    if name == "console":
        from otel_rollouts.exporters import ConsoleExporter

        return ConsoleExporter()
    from importlib.metadata import entry_points

    for point in entry_points(group=TRACES_EXPORTER_GROUP):
        if point.name.lower() == name:
            return _from_entry_point(point)
    raise LookupError(f"no {TRACES_EXPORTER_GROUP} entry point is named {name!r}")


class EntryPointError(Exception):
    """An installed exporter entry point that failed to load or build: it names the entry point
    and what it raised (``SystemExit`` included, which must not end the program from here)."""


def _from_entry_point(point: EntryPoint) -> SpanExporter:
    """The exporter an installed entry point builds (with no arguments, as the SDK builds it).

    Its module and its factory are third-party code run inside ``configure()``: whatever they
    raise (``SystemExit``, ``GeneratorExit``...) becomes an ``EntryPointError`` naming the entry
    point; only Ctrl-C on the main thread goes through, as everywhere user code is called."""
    where = f"entry point {point.name} = {point.value} ({point.group})"
    try:
        exporter = point.load()()
    except BaseException as exc:  # noqa: BLE001 - third-party code: contained, Ctrl-C excepted
        reraise_interrupt(exc)
        raise EntryPointError(f"{where} raised {exception_text(exc)}") from None
    if not isinstance(exporter, SpanExporter):
        raise EntryPointError(f"{where} built a {type(exporter).__name__}, not a span exporter")
    return exporter


def default_exporters(project: str | None = None, redactor: Redactor | None = None,
                      stats: Stats | None = None, run: str | None = None) -> list[SpanExporter]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names; unset (or invalid): local Trackio (nothing
    to start), plus OTLP when an OTLP endpoint is set in the environment. Never raises: an
    exporter that cannot be built (whatever it raises, ``SystemExit`` included; Ctrl-C on the
    main thread excepted) is left out with a warning naming it, and counted in ``stats`` as
    ``errors.build_exporter.<name>``; the others are built."""
    names = traces_exporter_names()
    if names is None:
        exporters = [_trackio(project, redactor, run)]
        if os.environ.get(c.ENV_OTLP_TRACES_ENDPOINT) or os.environ.get(c.ENV_OTLP_ENDPOINT):
            exporters.append(otlp_exporter_from_env())
        return exporters
    if "trackio" not in names:
        logger.info("otel_rollouts: %s=%s: no local Trackio project (add trackio to the list to keep it)",
                    c.ENV_TRACES_EXPORTER, ",".join(names) or "none")
    built: list[SpanExporter] = []
    for name in names:
        try:
            built.append(_named(name, project, redactor, run))
        except BaseException as exc:  # noqa: BLE001 - configure() never fails on an exporter it cannot build
            reraise_interrupt(exc)
            logger.warning("otel_rollouts: %s names %r, which could not be built (%s); it is left out",
                           c.ENV_TRACES_EXPORTER, name, exception_text(exc))
            if stats is not None:
                stats.add(f"errors.build_exporter.{name}")
    return built
