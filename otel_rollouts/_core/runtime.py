"""The process-wide runtime that ``configure()`` installs and the recording API reads.

Kept in its own module so that the recording side (episode API, @traced) never imports the
configuration code: it only reads ``current()``.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from otel_rollouts._core.redaction import Redactor
    from otel_rollouts._core.stats import Stats
    from otel_rollouts.delivery.outlet import Delivery
    from otel_rollouts.sampling.pipeline import Pipeline

logger = logging.getLogger("otel_rollouts")


@dataclass
class Runtime:
    """Everything a recording call needs, fixed at configure() time."""

    enabled: bool
    pipeline: Pipeline | None = None
    delivery: Delivery | None = None
    provider: TracerProvider | None = None
    stats: Stats | None = None
    capture_content: bool = True
    max_spans_per_episode: int = 1024
    strict: bool = False
    run_id: str = ""
    deterministic_ids: bool = False
    tracer: Any = None
    redactor: Redactor | None = None  # what leaves the process is redacted with it (None: off)
    current_step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


_DISABLED = Runtime(enabled=False)
_runtime: Runtime | None = None
_warned_unconfigured = False


def current() -> Runtime:
    """The active runtime; a disabled one (with a one-time warning) before configure()."""
    global _warned_unconfigured
    rt = _runtime
    if rt is not None:
        return rt
    if _revive is not None:
        rt = _run_revive()
        if rt is not None:
            return rt
    if not _warned_unconfigured:
        _warned_unconfigured = True
        logger.warning(
            "otel_rollouts: not configured, nothing is recorded; call otel_rollouts.configure()"
        )
    return _DISABLED


def install(rt: Runtime | None) -> None:
    global _runtime, _revive
    _runtime = rt
    _revive = None


# --- a forked child rebuilds its runtime on first use (see workers.py) ----------------------------
_revive = None
_revive_lock = threading.Lock()


def set_revive(revive) -> None:
    """Register a callable that builds the runtime the first time ``current()`` needs one."""
    global _revive
    _revive = revive


def pending_revive():
    return _revive


def _run_revive() -> Runtime | None:
    global _revive
    with _revive_lock:
        revive, _revive = _revive, None
    if revive is None:
        return _runtime
    try:
        return revive()
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the child
        logger.warning("otel_rollouts: could not rebuild the runtime after fork: %s", exc)
        return None


def installed() -> Runtime | None:
    return _runtime


def new_id64() -> int:
    """A random non-zero 64-bit span id (random is re-seeded in forked children)."""
    while True:
        value = random.getrandbits(64)
        if value:
            return value


def new_id128() -> int:
    while True:
        value = random.getrandbits(128)
        if value:
            return value
