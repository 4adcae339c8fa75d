"""A run's settings: small frozen option groups, and one table of the environment variables.

``configure()`` keeps its flat keyword arguments (the contract); it resolves them here into a
``Settings`` of option groups, each value from its argument or else from its environment
variable or else its default. The instance keeps the result, so that a forked child rebuilds
the same run from it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from otel_rollouts import conventions as c

logger = logging.getLogger("otel_rollouts")

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "ContentSettings",
    "DeliverySettings",
    "ENV_TABLE",
    "EnvOption",
    "LimitSettings",
    "SamplingSettings",
    "Settings",
    "env_flag",
]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024 - 64 * 1024  # gRPC's default receive limit, less headroom

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """The boolean an environment variable sets: None when unset, empty or not a boolean (the
    latter logged, as the OpenTelemetry SDK does), so the caller's default applies."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    logger.warning("otel_rollouts: %s=%r is not a boolean (true/false); ignored", name, value)
    return None


def _env_int(name: str, environ: Mapping[str, str]) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number <= 0:
        logger.warning("otel_rollouts: %s=%r is not a positive integer; ignored", name, value)
        return None
    return number


def _env_text(name: str, environ: Mapping[str, str]) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


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
    handle_signals: bool = True
    exit_timeout: float = 10.0


@dataclass(frozen=True)
class SamplingSettings:
    """Which episodes of a step are kept: the tail sampler (default ``TailSampler(32,
    "top_bottom")``) and whether ids are derived from (run, step, episode id)."""

    sampler: Any = None
    deterministic_ids: bool = False


@dataclass(frozen=True)
class Settings:
    """Everything ``configure()`` was given, resolved. The objects (exporters, sampler, metric
    readers) are the caller's; the groups are plain values."""

    service_name: str | None = None
    exporters: tuple[Any, ...] | None = None
    resource_attributes: Mapping[str, Any] | None = None
    run_id: str | None = None
    trackio_project: str | None = None
    strict: bool = False
    set_global_provider: bool = False
    metric_readers: tuple[Any, ...] | None = None
    disabled: bool = False
    content: ContentSettings = field(default_factory=ContentSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)

    def for_forked_child(self) -> Settings:
        """A forked child's settings: a metric reader belongs to one MeterProvider (the
        parent's) and a spool directory to the parent: the child takes metric settings from the
        environment only and spools to its own default place."""
        return replace(self, metric_readers=None,
                       delivery=replace(self.delivery, spool_dir=None))


@dataclass(frozen=True)
class EnvOption:
    """One environment variable: the option it sets (``group.field``, or a field of Settings)
    and how its text is read. An argument given to ``configure()`` always wins."""

    variable: str
    option: str
    read: Callable[[str, Mapping[str, str]], Any]


# The one table of the environment variables configure() reads (the exporters read their own
# OTEL_EXPORTER_OTLP_* variables; the resource reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES).
ENV_TABLE: tuple[EnvOption, ...] = (
    EnvOption(c.ENV_SDK_DISABLED, "disabled", env_flag),
    EnvOption(c.ENV_CAPTURE_CONTENT, "content.capture_content", env_flag),
    EnvOption(c.ENV_TRACKIO_PROJECT, "trackio_project", _env_text),
    EnvOption(c.ENV_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, "content.max_attribute_chars", _env_int),
    EnvOption(c.ENV_SPAN_ATTRIBUTE_COUNT_LIMIT, "limits.max_attributes_per_span", _env_int),
    EnvOption(c.ENV_SPOOL_DIR, "delivery.spool_dir", _env_text),
)

_GROUPS = {"content": ContentSettings, "limits": LimitSettings, "delivery": DeliverySettings,
           "sampling": SamplingSettings}


def resolve(arguments: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``configure()``'s flat keyword arguments (None or absent: not given) and
    the environment, through ``ENV_TABLE``."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = dict(arguments)
    for entry in ENV_TABLE:
        # None is "not given" for the options the environment may set; elsewhere None is a
        # value (``max_episode_chars=None``: no episode budget)
        name = entry.option.rpartition(".")[2]
        if values.get(name) is not None:
            continue
        values.pop(name, None)
        value = entry.read(entry.variable, environ)
        if value is not None:
            values[name] = value
    groups: dict[str, Any] = {}
    for group, cls in _GROUPS.items():
        names = {f.name for f in fields(cls)}
        groups[group] = cls(**{k: v for k, v in values.items() if k in names})
    top = {f.name for f in fields(Settings)} - set(_GROUPS)
    settings = Settings(**{k: v for k, v in values.items() if k in top}, **groups)
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
    pending = settings.delivery.max_pending_bytes
    if not pending > 0:
        raise ValueError(f"max_pending_bytes must be > 0, got {pending!r}")


def flat(settings: Settings) -> dict[str, Any]:
    """The flat keyword arguments that build ``settings`` again (for ``configure(**...)``)."""
    out: dict[str, Any] = {}
    for f in fields(Settings):
        value = getattr(settings, f.name)
        if f.name in _GROUPS:
            out.update({g.name: getattr(value, g.name) for g in fields(value)})
        elif f.name != "disabled":
            out[f.name] = value
    return out

