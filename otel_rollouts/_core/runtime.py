"""What the recording side reads of the configured instance, and the one process slot holding it.

``otr.configure()`` builds an ``otr.Rollouts`` (a ``Runtime``) and installs it here; the
recording API (episodes, ``@traced``, decoding, adapters, workers) reads it through
``current()``. The stages above depend on this module, never the other way round: what the
recording side calls on the pipeline is the ``EpisodeSink`` protocol below, so this module knows
nothing of sampling or delivery.

Module state: exactly one ``ProcessSlot`` (the installed instance, the last one stopped, a
pending rebuild after fork). It is per process by nature: a forked child gets a copy, which it
replaces on first use.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from otel_rollouts._core.logprobs import MismatchOptions
from otel_rollouts._core.stats import Stats

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.trace import Tracer

    from otel_rollouts._core.spans import EpisodeRecord, SpanRecord

logger = logging.getLogger("otel_rollouts")

__all__ = [
    "EpisodeSink",
    "ProcessSlot",
    "active",
    "bound_to",
    "Redacting",
    "Runtime",
    "current",
    "install",
    "installed",
    "new_id128",
    "new_id64",
]


class EpisodeSink(Protocol):
    """Where recorded episodes go (the sampling pipeline): what the recording side calls."""

    def started(self, record: EpisodeRecord) -> None:
        """An episode began (counted; its step may close older ones)."""

    def part_ended(self, record: EpisodeRecord) -> None:
        """The root or the reward span ended: the episode may be complete."""

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        """A span ended after its episode was decided."""

    def adopt(self, spans: list[ReadableSpan], record: EpisodeRecord | None = None) -> None:
        """Finished spans made in another process for an episode held here."""

    def claim_trace_id(self, trace_id: int, key: tuple[int, str],
                       derive: Callable[[int], int]) -> tuple[int, int]:
        """A deterministic trace id claimed for an episode of step ``key``: (the id to use,
        occurrence: 0 the first time; a repeat gets ``derive(occurrence)``)."""

    def offer_batch(self, batch: Any) -> list[Any] | None:
        """Offer the rows of a ``sampling.batch.RowBatch`` at once: the rows to record as
        episodes, or None when every row must be recorded as an episode."""

    def attach(self, recorded: list[tuple[Any, EpisodeRecord | None]]) -> None:
        """The episodes recorded for the rows ``offer_batch`` returned."""

    def on_kept(self, hook: Callable[[EpisodeRecord], None] | None) -> None:
        """Call ``hook`` with every episode kept from now on, after it went to delivery (the
        logs integration's evaluation events); None: no more."""


class Redacting(Protocol):
    """The run's redaction, as the recording side uses it (``_core.redaction.Redactor``)."""

    def __call__(self, text: str) -> str: ...

    def name(self, text: str) -> str: ...

    def mapping(self, value: Any) -> Any: ...


@dataclass(eq=False)  # compared by identity: an instance is one run
class Runtime:
    """Everything a recording call needs, fixed when the instance is built.

    A disabled one (``enabled=False``) makes every recording call a cheap no-op.
    """

    enabled: bool
    pipeline: EpisodeSink | None = None
    provider: TracerProvider | None = None
    counters: Stats | None = None  # behind otr.stats()
    capture_content: bool = True
    max_spans_per_episode: int = 1024
    max_attributes_per_span: int = 1024
    max_attribute_chars: int = 16_384
    strict: bool = False
    run_id: str = ""
    # the run id as configured (``configure(run_id=...)``), None when it was made up here: what
    # other processes of the run are told to share (``sampling.ray_budget``)
    given_run_id: str | None = None
    deterministic_ids: bool = False
    tracer: Tracer | None = None
    redactor: Redacting | None = None  # what leaves the process is redacted with it (None: off)
    current_step: int = 0
    pid: int = 0  # the process that built it: a forked child must not use its parent's
    # how train–inference mismatch is summarised (_core.logprobs.MismatchOptions)
    mismatch: MismatchOptions = field(default_factory=MismatchOptions)
    # each kind of problem is logged once per run (``_core.guard.report``); the rest are counted
    logged: set[str] = field(default_factory=set)
    # what an integration keeps for this run (the Ray bridge's span collector), by name
    extensions: dict[str, Any] = field(default_factory=dict)
    # called before a step closes (end_step, flush): spans still on their way join first
    before_close: list[Callable[[], None]] = field(default_factory=list)
    # called once at shutdown, after the last ``before_close``: an integration's own threads stop
    # (bounded) before the caller goes on to shut down what they use (``ray.shutdown()``)
    on_stop: list[Callable[[], None]] = field(default_factory=list)

    def settle(self) -> None:
        """Run the ``before_close`` hooks; telemetry never breaks the caller."""
        self._run_hooks(self.before_close, "before_close")

    def stop_integrations(self) -> None:
        """Run the ``on_stop`` hooks; telemetry never breaks the caller."""
        self._run_hooks(self.on_stop, "on_stop")

    def _run_hooks(self, hooks: list[Callable[[], None]], what: str) -> None:
        for hook in list(hooks):
            try:
                hook()
            except Exception as exc:  # noqa: BLE001
                if self.counters is not None:
                    self.counters.add(f"errors.{what}")
                logger.debug("otel_rollouts: %s hook failed: %s", what, exc)

    def rebuild_after_fork(self) -> Callable[[], Runtime | None] | None:
        """How a forked child builds its own instance from this one's settings (None: it can't)."""
        return None


_DISABLED = Runtime(enabled=False)


class ProcessSlot:
    """The installed instance of this process, the last one stopped (``otr.stats()`` reads its
    final totals after shutdown) and a rebuild pending after fork."""

    def __init__(self) -> None:
        self.installed: Runtime | None = None
        self.last_stopped: Runtime | None = None
        self.revive: Callable[[], Runtime | None] | None = None
        self.revive_lock = threading.Lock()
        # configure() and shutdown() of this process's instances, one at a time
        self.configure_lock = threading.RLock()
        # the logging integration (``otr.instrument_logging``): a handler on the root logger,
        # so one per process, whichever instance is installed
        self.logging_integration: object | None = None
        self.logging_lock = threading.Lock()
        self.warned_unconfigured = False
        self.logged_unconfigured: set[str] = set()  # log-once kinds before any configure()
        # the instance bound to the current context (``Rollouts.activate()``, an episode of an
        # instance that is not installed): it wins over the installed one in that context only
        self.bound: ContextVar[Runtime | None] = ContextVar("otel_rollouts_instance", default=None)

    def claim_unconfigured_note(self) -> bool:
        """True the first time in this process: the caller says, once, why little is recorded
        here (the generic "not configured" warning then stays quiet)."""
        with self.logging_lock:
            if self.warned_unconfigured:
                return False
            self.warned_unconfigured = True
            return True

    def current(self) -> Runtime:
        """The active instance; a disabled one (with a one-time warning) before configure()."""
        rt = self.installed
        if rt is not None:
            return rt
        if self.revive is not None:
            rt = self._run_revive()
            if rt is not None:
                return rt
        if not self.warned_unconfigured:
            self.warned_unconfigured = True
            logger.warning(
                "otel_rollouts: not configured, nothing is recorded; call otel_rollouts.configure()"
            )
        return _DISABLED

    def install(self, rt: Runtime | None) -> None:
        self.installed = rt
        self.revive = None

    def _run_revive(self) -> Runtime | None:
        with self.revive_lock:
            revive, self.revive = self.revive, None
        if revive is None:
            return self.installed
        try:
            return revive()
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the child
            logger.warning("otel_rollouts: could not rebuild the runtime after fork: %s", exc)
            return None

    def after_fork_in_child(self) -> None:
        """The child drops the parent's instance (its undecided episodes and export queue stay
        the parent's) and rebuilds its own, lazily, from the same settings."""
        self.revive_lock = threading.Lock()
        self.configure_lock = threading.RLock()
        self.logging_lock = threading.Lock()
        rt = self.installed
        if rt is None or not rt.enabled:
            return
        self.installed = None
        self.revive = rt.rebuild_after_fork()

    def logged(self) -> set[str]:
        """The log-once set of the active instance (or of the unconfigured process)."""
        rt = self.bound.get() or self.installed
        return rt.logged if rt is not None else self.logged_unconfigured


_slot = ProcessSlot()


def slot() -> ProcessSlot:
    """This process's slot."""
    return _slot


def current() -> Runtime:
    """The active instance: the one bound to this context, else the installed one; a disabled
    one (with a one-time warning) before configure()."""
    rt = _slot.bound.get() or _slot.installed
    return rt if rt is not None else _slot.current()


def active() -> Runtime | None:
    """The instance bound to this context, else the installed one, or None (no warning, no
    rebuild): whose strictness and counters a report in this context uses."""
    return _slot.bound.get() or _slot.installed


def installed() -> Runtime | None:
    """The installed instance, or None (no warning, no rebuild)."""
    return _slot.installed


@contextmanager
def bound_to(rt: Runtime | None) -> Iterator[None]:
    """Bind ``rt`` to the current context for the block (an entry point given its instance as
    an argument); None leaves the context as it is."""
    if rt is None:
        yield
        return
    token = _slot.bound.set(rt)
    try:
        yield
    finally:
        _slot.bound.reset(token)


def install(rt: Runtime | None) -> None:
    _slot.install(rt)


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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_slot.after_fork_in_child)
