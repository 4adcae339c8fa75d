"""A run's settings: small frozen option groups, and one table of the environment variables.

``configure()`` keeps its flat keyword arguments (the contract); it resolves them here into a
``Settings`` of option groups, each value from its argument or else from its environment
variable or else its default. The instance keeps the result, so that a forked child rebuilds
the same run from it.

``ENV_VARIABLES`` is the one table of the environment variables: every ``OTEL_*`` and
``OTEL_ROLLOUTS_*`` variable that the library or the OpenTelemetry SDK reads, with how its text
is checked and the default used instead of a bad value. ``check_environment()`` runs it at
``import otel_rollouts`` and at every ``configure()``: configuration never crashes training (a
bad value gives one warning naming the variable and the default, and is removed from
``os.environ`` so that the SDK, which raises on it, reads its default; see there why).
"""

from __future__ import annotations

import logging
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from otel_rollouts import conventions as c
from otel_rollouts._core.logprobs import MismatchOptions

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger("otel_rollouts")

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "ContentSettings",
    "DeliverySettings",
    "ENV_TABLE",
    "ENV_VARIABLES",
    "EnvOption",
    "LimitSettings",
    "SamplingSettings",
    "Settings",
    "check_environment",
    "env_flag",
    "from_environment",
    "given_or",
    "phoenix_annotations",
    "traces_exporter_names",
    "validated",
]

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024 - 64 * 1024  # gRPC's default receive limit, less headroom

# where kept episodes are rendered: a thread of the training process, a renderer process, or
# "auto": the renderer process for the exporters the library made itself (from the environment),
# when they can be made there; a thread for exporter objects the user gave, which stay theirs
RENDER_THREAD, RENDER_PROCESS, RENDER_AUTO = "thread", "process", "auto"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """The boolean an environment variable sets: None when unset, empty or not a boolean (the
    latter logged, as the OpenTelemetry SDK does), so the caller's default applies."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    try:
        return _flag(value)
    except ValueError:
        _warn(name, value, "is not a boolean (true/false)", "the default", secret=False)
        return None


# --- parsers: the text of one variable -> its value; ValueError (the reason) when invalid -----
def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("is not a boolean (true/false)")


def _positive_int(text: str) -> int:
    try:
        number = int(text.strip())
    except ValueError:
        raise ValueError("is not a positive integer") from None
    if number <= 0:
        raise ValueError("is not a positive integer")
    return number


def _limit(text: str) -> int | None:
    # the SDK's span limits: a non-negative integer, or "unset" (no limit)
    word = text.strip().lower()
    if word == "unset":
        return None
    try:
        number = int(word)
    except ValueError:
        raise ValueError("is not a non-negative integer") from None
    if number < 0:
        raise ValueError("is not a non-negative integer")
    return number


def _positive_float(text: str) -> float:
    try:
        number = float(text.strip())
    except ValueError:
        raise ValueError("is not a positive number") from None
    if not (number > 0 and math.isfinite(number)):
        raise ValueError("is not a positive number")
    return number


def _text(text: str) -> str:
    return text.strip()


def _one_of(*words: str) -> Callable[[str], str]:
    def read(text: str) -> str:
        word = text.strip().lower()
        if word not in words:
            raise ValueError("is not one of " + ", ".join(words))
        return word

    return read


# the OpenTelemetry SDK's liberal header grammar (opentelemetry.util.re): name=value, comma separated
_HEADER = re.compile(r"[ \t]*[\x21\x23-\x27\x2a\x2b\x2d\x2e\x30-\x39\x41-\x5a\x5e-\x7a\x7c\x7e]+[ \t]*=[ \t]*"
                     r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*[ \t]*")


def _headers(text: str) -> str:
    for item in re.split(r"[ \t]*,[ \t]*", text.strip()):
        if item and not _HEADER.fullmatch(item):
            raise ValueError("is not a comma separated list of name=value (URL encoded)")
    return text.strip()


def _endpoint(text: str) -> str:
    value = text.strip()
    if any(ch.isspace() or ord(ch) < 0x20 for ch in value):
        raise ValueError("is not a URL (it holds white space)")
    try:
        parsed = urllib.parse.urlsplit(value if "://" in value else "//" + value)
        _ = parsed.port  # ValueError on a port that is not a number in range
    except ValueError:
        raise ValueError("is not a URL") from None
    if not parsed.hostname:
        raise ValueError("is not a URL (no host)")
    return value


PHOENIX_AUTO, PHOENIX_ON, PHOENIX_OFF = "auto", "on", "off"


def phoenix_annotations(text: str) -> str:
    """``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS``: ``auto`` (post to an OTLP/HTTP endpoint that is a
    Phoenix), ``on`` (post without asking), ``off`` (booleans read as on/off), or Phoenix's base
    URL (``http(s)://host:port[/root]``, e.g. for a gRPC endpoint); see ``delivery.phoenix``."""
    word = text.strip()
    lower = word.lower()
    if lower == PHOENIX_AUTO:
        return PHOENIX_AUTO
    if lower in _TRUE:
        return PHOENIX_ON
    if lower in _FALSE:
        return PHOENIX_OFF
    reason = "is not auto, on, off or an http(s):// URL"
    try:
        parsed = urllib.parse.urlsplit(word)
        _ = parsed.port  # ValueError on a port that is not a number in range
    except ValueError:
        raise ValueError(reason) from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or any(
            ch.isspace() or ord(ch) < 0x20 for ch in word):
        raise ValueError(reason)
    return word.rstrip("/")


def _propagators(text: str) -> str:
    # opentelemetry.propagate (imported by the OpenTelemetry instrumentations) raises at import
    # on a name that no installed package provides
    from importlib.metadata import entry_points

    known = {point.name for point in entry_points(group="opentelemetry_propagator")} | {"none"}
    for name in text.split(","):
        if name.strip() and name.strip().lower() not in known:
            raise ValueError(f"names a propagator that is not installed ({name.strip()!r})")
    return text.strip()


# OTEL_TRACES_EXPORTER: the names configure() builds itself; any other name must be an installed
# entry point of the SDK's group (as the SDK's own auto-configuration requires)
TRACES_EXPORTER_NONE = "none"
BUILTIN_TRACES_EXPORTERS = ("trackio", "otlp", "otlp_proto_http", "otlp_proto_grpc", "console",
                            TRACES_EXPORTER_NONE)
TRACES_EXPORTER_GROUP = "opentelemetry_traces_exporter"
_TRACES_EXPORTER_DEFAULT = "the default exporters (Trackio, plus OTLP when an OTLP endpoint is set)"


def _traces_exporters(text: str) -> tuple[str, ...]:
    """``OTEL_TRACES_EXPORTER``: a comma separated list of exporter names, each built in or an
    installed ``opentelemetry_traces_exporter`` entry point, or ``none`` alone; the names in
    order, lowercase, without repeats."""
    names: list[str] = []
    for item in text.split(","):
        name = item.strip().lower()
        if name and name not in names:
            names.append(name)
    if not names:
        raise ValueError("names no exporter")
    if TRACES_EXPORTER_NONE in names and len(names) > 1:
        raise ValueError("names none together with other exporters")
    unknown = [n for n in names if n not in BUILTIN_TRACES_EXPORTERS]
    if unknown:
        from importlib.metadata import entry_points

        installed = {point.name.lower() for point in entry_points(group=TRACES_EXPORTER_GROUP)}
        missing = [n for n in unknown if n not in installed]
        if missing:
            raise ValueError(f"names an exporter that is neither built in ({', '.join(BUILTIN_TRACES_EXPORTERS)}) "
                             f"nor installed ({', '.join(repr(n) for n in missing)})")
    return tuple(names)


def traces_exporter_names(environ: MutableMapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (``()`` for ``none``), or None when it is
    unset or invalid (then the default exporters are used). An invalid value is warned about
    and removed here too, for a caller that did not go through ``check_environment`` first."""
    environ = os.environ if environ is None else environ
    text = environ.get(c.ENV_TRACES_EXPORTER)
    if text is None or not text.strip():
        return None
    try:
        names = _traces_exporters(text)
    except ValueError as exc:
        _warn(c.ENV_TRACES_EXPORTER, text, str(exc), _TRACES_EXPORTER_DEFAULT, secret=False)
        environ.pop(c.ENV_TRACES_EXPORTER, None)
        return None
    return () if names == (TRACES_EXPORTER_NONE,) else names


def _key_values(text: str) -> str:
    for item in text.split(","):
        if item.strip() and "=" not in item:
            raise ValueError("is not a comma separated list of key=value")
    return text.strip()


def _warn(variable: str, value: str, reason: str, default: str, secret: bool) -> None:
    """The warning about an invalid value: the variable, why, and the default used; the value of
    a variable that may hold credentials (headers, endpoints) is not shown. Given once per value:
    ``check_environment`` removes the value it warned about, so no later reader sees it."""
    shown = f"<{len(value)} characters, not shown>" if secret else repr(value)
    logger.warning("otel_rollouts: %s=%s %s; using %s instead", variable, shown, reason, default)


@dataclass(frozen=True)
class ContentSettings:
    """What is captured of prompts, completions, tool arguments and results, and how much."""

    capture_content: bool = True
    redact: bool | Callable[[str], str] | None = True
    redact_patterns: tuple[str, ...] = ()
    max_attribute_chars: int = 16_384
    max_episode_chars: int | None = 1_048_576
    agent_name: str | None = None


@dataclass(frozen=True)
class LimitSettings:
    """Bounds on what one episode may hold."""

    max_spans_per_episode: int = 1024
    max_attributes_per_span: int = 1024
    episode_timeout_s: float | None = None


@dataclass(frozen=True)
class DeliverySettings:
    """How kept episodes reach the exporters, and what happens at exit."""

    max_queue: int | None = None
    spool_dir: str | os.PathLike[str] | None = None
    spool_max_bytes: int = 256 * 1024 * 1024
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    max_pending_bytes: int = 64 * 1024 * 1024
    max_queue_bytes: int = 64 * 1024 * 1024
    handle_signals: bool = True
    exit_timeout: float = 10.0
    # where kept episodes are rendered and exported: "thread" (a thread of the training process),
    # "process" (a renderer process: delivery.process) or "auto" (RENDER_AUTO above)
    render: str = RENDER_AUTO


@dataclass(frozen=True)
class SamplingSettings:
    """Which episodes of a step are kept: the tail sampler (default ``TailSampler(32,
    "top_bottom")``) and whether ids are derived from (run, step, episode id)."""

    # an otel_rollouts.sampling.TailSampler, or None for the default; _core cannot name the
    # class (it sits above this layer), the instance checks it when it is built
    sampler: object = None
    deterministic_ids: bool = False
    # HangOptions (sampling.hung), True/None: automatic, a number: seconds, False: off
    hang: object = None
    mismatch: MismatchOptions | None = None  # the ratio band, worst tokens shown


@dataclass(frozen=True)
class Settings:
    """Everything ``configure()`` was given, resolved. The objects (exporters, sampler, metric
    readers) are the caller's; the groups are plain values."""

    service_name: str | None = None
    exporters: tuple[SpanExporter, ...] | None = None
    resource_attributes: Mapping[str, object] | None = None
    run_id: str | None = None
    trackio_project: str | None = None
    strict: bool = False
    set_global_provider: bool = False
    metric_readers: tuple[object, ...] | None = None
    disabled: bool = False
    gateway: object = None  # GatewayOptions (correlate.gateway), True, or None: no span gateway
    content: ContentSettings = field(default_factory=ContentSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)

    def for_forked_child(self) -> Settings:
        """A forked child's settings: a metric reader belongs to one MeterProvider (the
        parent's) and a spool directory to the parent: the child takes metric settings from the
        environment only and spools to its own default place."""
        return replace(self, metric_readers=None, gateway=None,
                       delivery=replace(self.delivery, spool_dir=None))


@dataclass(frozen=True)
class EnvOption:
    """One environment variable that the library or the OpenTelemetry SDK reads.

    ``parse`` turns its text into a value or raises ``ValueError`` (the reason); ``default``
    says, for the warning, what is used instead of a value that does not parse. ``option`` is
    the ``configure()`` option it sets (``group.field``, or a field of Settings; an argument
    given to ``configure()`` always wins), empty for a variable only validated here (read by
    the SDK, an exporter or the CLI). ``secret``: the value may hold credentials and is never
    printed.
    """

    variable: str
    option: str
    parse: Callable[[str], Any]
    default: str
    secret: bool = False


def _otlp(signal: str, what: str) -> str:
    return f"OTEL_EXPORTER_OTLP_{signal}{what}"


_SDK_DEFAULT = "the OpenTelemetry SDK's default"

# THE table: every OTEL_* / OTEL_ROLLOUTS_* variable the library or the OpenTelemetry SDK reads
# on our behalf, validated before either reads it (``check_environment``). Like Pydantic
# Logfire's settings table: one place to read what the environment can change.
ENV_VARIABLES: tuple[EnvOption, ...] = (
    # configure() options
    EnvOption(c.ENV_SDK_DISABLED, "disabled", _flag, "false (enabled)"),
    EnvOption(c.ENV_CAPTURE_CONTENT, "content.capture_content", _flag, "true (content captured)"),
    EnvOption(c.ENV_TRACKIO_PROJECT, "trackio_project", _text, "the project otel-rollouts"),
    EnvOption(c.ENV_RUN_ID, "run_id", _text, "a random run id per process"),
    EnvOption(c.ENV_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, "content.max_attribute_chars",
              _positive_int, f"{ContentSettings.max_attribute_chars} characters"),
    EnvOption(c.ENV_SPAN_ATTRIBUTE_COUNT_LIMIT, "limits.max_attributes_per_span", _positive_int,
              f"{LimitSettings.max_attributes_per_span} attributes"),
    EnvOption(c.ENV_SPOOL_DIR, "delivery.spool_dir", _text, "the default spool directory"),
    EnvOption(c.ENV_RENDER, "delivery.render", _one_of(RENDER_AUTO, RENDER_THREAD, RENDER_PROCESS),
              f"{RENDER_AUTO} (kept episodes rendered in a renderer process for the exporters made from "
              f"the environment, on a thread of the training process for exporters given to configure)"),
    # the library's own, read elsewhere
    EnvOption(c.ENV_TRACE_UI_URL, "", _endpoint, "no trace link"),
    EnvOption(c.ENV_PHOENIX_ANNOTATIONS, "", phoenix_annotations,
              "auto (annotations when the OTLP/HTTP endpoint is a Phoenix)", secret=True),
    EnvOption("OTEL_ROLLOUTS_DEBUG", "", _flag, "false"),
    EnvOption(c.ENV_SERVICE_NAME, "", _text, "the service name otel-rollouts"),
    EnvOption("OTEL_RESOURCE_ATTRIBUTES", "", _key_values, "no resource attributes from the environment",
              secret=True),
    EnvOption(c.ENV_TRACES_EXPORTER, "", _traces_exporters, _TRACES_EXPORTER_DEFAULT),
    EnvOption(c.ENV_METRICS_EXPORTER, "", _text, "no metrics exporter from the environment"),
    EnvOption(c.ENV_LOGS_EXPORTER, "", _text, "no logs exporter from the environment"),
    EnvOption("OTEL_PROPAGATORS", "", _propagators, "tracecontext,baggage"),
    # the SDK's limits (the SDK raises on an invalid one, even at import)
    *(EnvOption(name, "", _limit, _SDK_DEFAULT) for name in (
        "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_SPAN_EVENT_COUNT_LIMIT", "OTEL_SPAN_LINK_COUNT_LIMIT",
        "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_LOGRECORD_ATTRIBUTE_COUNT_LIMIT", "OTEL_LOGRECORD_ATTRIBUTE_VALUE_LENGTH_LIMIT")),
    # the SDK's batch processors and metric reader
    *(EnvOption(name, "", _positive_int, _SDK_DEFAULT) for name in (
        "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_BLRP_SCHEDULE_DELAY", "OTEL_BLRP_EXPORT_TIMEOUT",
        "OTEL_BLRP_MAX_QUEUE_SIZE", "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE",
        "OTEL_METRIC_EXPORT_INTERVAL", "OTEL_METRIC_EXPORT_TIMEOUT")),
    # the OTLP exporters, for every signal and for all of them
    *(option for signal in ("", "TRACES_", "METRICS_", "LOGS_") for option in (
        EnvOption(_otlp(signal, "ENDPOINT"), "", _endpoint, "no OTLP endpoint" if not signal
                  else "OTEL_EXPORTER_OTLP_ENDPOINT or the SDK's default", secret=True),
        EnvOption(_otlp(signal, "HEADERS"), "", _headers, "no headers", secret=True),
        EnvOption(_otlp(signal, "TIMEOUT"), "", _positive_float, "the default timeout"),
        EnvOption(_otlp(signal, "COMPRESSION"), "", _one_of("gzip", "deflate", "none"),
                  "no compression"),
        EnvOption(_otlp(signal, "PROTOCOL"), "", _one_of("grpc", "http/protobuf", "http/json"),
                  "grpc" if not signal else "OTEL_EXPORTER_OTLP_PROTOCOL or grpc"),
        EnvOption(_otlp(signal, "INSECURE"), "", _flag, "false"),
    )),
)

# the variables that set configure() options (a view of ENV_VARIABLES, which is the one table)
ENV_TABLE: tuple[EnvOption, ...] = tuple(entry for entry in ENV_VARIABLES if entry.option)


def check_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, object]:
    """Validate every variable of ``ENV_VARIABLES`` in ``environ`` (``os.environ`` by default)
    before the library or the OpenTelemetry SDK reads it; the valid ones' values, by name.

    A value that does not parse gives one warning (the variable, the reason, the default used)
    and is **removed** from ``environ``, as is an empty one (the specification's "unset"). Why
    removed rather than masked for a while: the SDK reads these variables itself, at import
    (span limits), in every constructor (TracerProvider, batch processors, OTLP exporters, the
    metric reader) and in objects built after ``configure()`` returns (a log exporter, a Ray
    worker's import, the user's own exporters); raising ``ValueError`` on a bad value in each of
    them. Masking ``os.environ`` for the duration of ``configure()`` would not cover the later
    readers and would race other threads reading the environment. Only invalid or empty
    values are removed; a valid one is never touched. Never raises.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for entry in ENV_VARIABLES:
        try:
            text = environ.get(entry.variable)
            if text is None:
                continue
            if text.strip():
                try:
                    value = entry.parse(text)
                except ValueError as exc:
                    _warn(entry.variable, text, str(exc), entry.default, entry.secret)
                else:
                    if value is not None:  # (None: a valid value meaning "none", kept as it is)
                        values[entry.variable] = value
                    continue
            environ.pop(entry.variable, None)
        except Exception:  # noqa: BLE001 - an odd mapping must not stop configure()
            continue
    return values


def from_environment(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The ``configure()`` options the environment sets, by option path (``ENV_TABLE``:
    ``"content.capture_content"`` -> False...); invalid values are warned about and left out."""
    environ = os.environ if environ is None else environ
    # a read-only mapping is checked as a copy: what is invalid is warned about and left out
    checked = check_environment(environ if isinstance(environ, MutableMapping) else dict(environ))
    return {entry.option: checked[entry.variable] for entry in ENV_TABLE if entry.variable in checked}


def given_or(value: T | None, environment: Mapping[str, Any], option: str, default: T) -> T:
    """One option as ``configure()`` resolves it: its argument (None: not given), else its
    environment variable's value (``option``: its path in ``ENV_TABLE``), else ``default``."""
    if value is not None:
        return value
    found: T = environment.get(option, default)
    return found


def validated(settings: Settings) -> Settings:
    """``settings`` with its sequences made tuples, checked (``ValueError`` names the option)."""
    if settings.exporters is not None and not isinstance(settings.exporters, tuple):
        settings = replace(settings, exporters=tuple(settings.exporters))
    if settings.metric_readers is not None and not isinstance(settings.metric_readers, tuple):
        settings = replace(settings, metric_readers=tuple(settings.metric_readers))
    if not isinstance(settings.content.redact_patterns, tuple):
        settings = replace(settings, content=replace(
            settings.content, redact_patterns=tuple(settings.content.redact_patterns)))
    _validate(settings)
    return settings


def _validate(settings: Settings) -> None:
    timeout = settings.limits.episode_timeout_s
    if timeout is not None and not timeout > 0:
        raise ValueError(f"episode_timeout_s must be > 0 or None, got {timeout!r}")
    render = settings.delivery.render
    if render not in (RENDER_AUTO, RENDER_THREAD, RENDER_PROCESS):
        raise ValueError(f"render must be {RENDER_AUTO!r}, {RENDER_THREAD!r} or {RENDER_PROCESS!r}, got {render!r}")
    pending = settings.delivery.max_pending_bytes
    if not pending > 0:
        raise ValueError(f"max_pending_bytes must be > 0, got {pending!r}")
