"""``otr.Rollouts``: one configured run (provider, pipeline, delivery, metrics, ticker, exit
hooks), ``configure()`` that builds and installs it, and the module-level controls that call
the installed one: ``end_step``, ``set_step``, ``flush``, ``shutdown``, ``stats``."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_rollouts import conventions as c
from otel_rollouts._core import exit as _exit
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import exception_text, text
from otel_rollouts._core.guard import guarded
from otel_rollouts._core.logprobs import MismatchOptions
from otel_rollouts._core.redaction import (
    RedactingLogFilter,
    Redactor,
    make_redactor,
    redact_sdk_logs,
)
from otel_rollouts._core.runtime import Redacting
from otel_rollouts._core.settings import (
    DEFAULT_MAX_REQUEST_BYTES,
    RENDER_AUTO,
    RENDER_THREAD,
    ContentSettings,
    DeliverySettings,
    LimitSettings,
    SamplingSettings,
    Settings,
    from_environment,
    given_or,
    validated,
)
from otel_rollouts._core.stats import Stats
from otel_rollouts.correlate.gateway import GatewayOptions, SpanGateway
from otel_rollouts.correlate.metrics import RolloutMetrics
from otel_rollouts.delivery.defaults import default_exporters
from otel_rollouts.delivery.dispatch import Delivery
from otel_rollouts.delivery.materialize import Materializer
from otel_rollouts.delivery.phoenix import PhoenixAnnotations
from otel_rollouts.delivery.process import exporter_recipe, is_otlp, make_delivery
from otel_rollouts.exporters.extras import GroupsSink, MetricsSink
from otel_rollouts.record.episode import Episode
from otel_rollouts.sampling.hung import HangOptions, HungWatcher
from otel_rollouts.sampling.pipeline import Pipeline
from otel_rollouts.sampling.tail import TailSampler

logger = logging.getLogger("otel_rollouts")

__all__ = [
    "Rollouts",
    "configure",
    "end_step",
    "flush",
    "set_step",
    "shutdown",
    "stats",
    "tracer_provider",
    "version",
]

_TICK_S = 1.0


def version() -> str:
    """This distribution's version ("0+unknown" when not installed)."""
    try:
        from importlib.metadata import version as installed_version

        return installed_version("otel-rollouts")
    except Exception:  # noqa: BLE001
        return "0+unknown"


def _resource(service_name: str | None, attributes: Mapping[str, Any] | None, run_id: str,
              redactor: Redactor | None) -> Resource:
    """The run's resource, redacted once here: it goes out with every span, metric and log."""
    from otel_rollouts.correlate.resource import run_resource

    resource = run_resource(service_name, attributes, run_id)
    if redactor is None:
        return resource
    return Resource(redactor.mapping(dict(resource.attributes)), resource.schema_url)


def _redact_own_logs(redactor: Redacting | None) -> None:
    """The library's own log lines quote refused values and error messages: they are redacted
    with the run's redactor before any handler (a console, an OTLP log exporter) sees them."""
    own = logging.getLogger(c.SCOPE_NAME)
    for old in [f for f in own.filters if isinstance(f, RedactingLogFilter)]:
        own.removeFilter(old)
    if redactor is not None:
        own.addFilter(RedactingLogFilter(redactor))
    # the OpenTelemetry SDK's own loggers print endpoints and header values: redacted too (its
    # password and header rules hold even with redaction off)
    redact_sdk_logs(redactor if redactor is not None else str)


class Rollouts(_runtime.Runtime):
    """One configured run: what ``otr.configure()`` returns.

    Owns the tracer provider, the sampling pipeline, delivery, rollout metrics, the ticker thread
    (episode and step timeouts) and the exit hooks. The module-level functions (``otr.end_step``,
    ``otr.flush``...) call the installed instance; an instance's own methods act on it whether
    it is installed or not, so several may exist (a test, a second project). Build one with
    ``Rollouts.build(settings)`` or ``otr.configure(..., install=False)``.
    """

    def __init__(self, settings: Settings) -> None:
        super().__init__(enabled=not settings.disabled, pid=os.getpid())
        self.settings = settings
        self.delivery: Delivery | None = None
        self.metrics: RolloutMetrics | None = None
        self.sampler: TailSampler | None = None
        # the same object as ``pipeline`` (which the recording side sees as an EpisodeSink)
        self.sampling_pipeline: Pipeline | None = None
        self.exit_hooks = _exit.hooks()
        self._ticker: threading.Thread | None = None
        self._ticker_stop = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.gateway: SpanGateway | None = None
        self.described: dict[str, str] = {}  # the run's description so far (describe_run)
        if self.enabled:
            self._build()

    # --- building ----------------------------------------------------------------------------
    def _build(self) -> None:
        s = self.settings
        content, limits, delivery_settings = s.content, s.limits, s.delivery
        given = s.sampling.sampler
        if given is not None and not isinstance(given, TailSampler):
            raise TypeError(f"sampler: expected an otr.TailSampler, got {type(given).__name__}")
        sampler = given if given is not None else TailSampler()
        run_id = s.run_id or uuid.uuid4().hex[:12]
        redactor = make_redactor(content.redact, content.redact_patterns)
        resource = _resource(s.service_name, s.resource_attributes, run_id, redactor)
        stats = Stats()
        exporters = (
            list(s.exporters) if s.exporters is not None
            else default_exporters(s.trackio_project, redactor, stats, str(s.run_id) if s.run_id else None)
        )
        for exporter in exporters:  # a stock OTLP exporter aimed at a Phoenix also posts the scores
            PhoenixAnnotations.attach(exporter)  # (per OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS; idempotent)
        materializer = Materializer(
            resource,
            InstrumentationScope(c.SCOPE_NAME, version()),
            max_attribute_chars=content.max_attribute_chars,
            redact=redactor,
            max_episode_chars=content.max_episode_chars,
            agent_name=content.agent_name,
            capture_content=content.capture_content,
        )
        queue_size = delivery_settings.max_queue or max(1024, 16 * sampler.max_traces_per_step)
        render = delivery_settings.render
        if render == RENDER_AUTO and s.exporters is not None:
            render = RENDER_THREAD  # exporter objects the user gave stay in this process, theirs
        delivery = make_delivery(
            render,
            exporters,
            materializer,
            stats,
            max_queue=queue_size,
            exit_timeout=delivery_settings.exit_timeout,
            spool_dir=delivery_settings.spool_dir,
            spool_max_bytes=delivery_settings.spool_max_bytes,
            max_request_bytes=delivery_settings.max_request_bytes,
            max_pending_bytes=delivery_settings.max_pending_bytes,
            max_queue_bytes=delivery_settings.max_queue_bytes,
        )
        pipeline = Pipeline(sampler, delivery, stats, episode_timeout_s=limits.episode_timeout_s)
        hang = HangOptions.of(s.sampling.hang)
        if hang is not None:  # episodes still running past the threshold are shown as they hang
            pipeline.hung = HungWatcher(hang, delivery, stats, is_closed=pipeline.is_closed,
                                        on_hung=self._hung)
        provider = TracerProvider(
            resource=resource,
            shutdown_on_exit=False,
            span_limits=SpanLimits(
                max_attributes=limits.max_attributes_per_span,
                max_event_attributes=limits.max_attributes_per_span,
                max_span_attributes=limits.max_attributes_per_span,
            ),
        )
        provider.add_span_processor(pipeline)
        self.sampler = sampler
        self.delivery = delivery
        self.pipeline = self.sampling_pipeline = pipeline
        self.provider = provider
        self.counters = stats
        self.capture_content = content.capture_content
        self.max_spans_per_episode = limits.max_spans_per_episode
        self.max_attributes_per_span = limits.max_attributes_per_span
        self.max_attribute_chars = content.max_attribute_chars
        self.strict = s.strict
        self.run_id = run_id
        self.given_run_id = str(s.run_id) if s.run_id else None
        self.deterministic_ids = s.sampling.deterministic_ids
        self.mismatch = MismatchOptions.of(s.sampling.mismatch)
        self.tracer = provider.get_tracer(c.SCOPE_NAME, version())
        self.redactor = redactor
        # step summaries reach the exporters where they live (the renderer process's copies)
        self.metrics = _metrics(resource, s.metric_readers, delivery.metric_sinks(), stats, redactor)
        pipeline.observer = self.metrics

    def _hung(self, key: tuple[int, str], n: int) -> None:
        metrics = self.metrics  # read once: shutdown may clear it meanwhile
        if metrics is not None:
            metrics.hung(key, n)

    def tracer_provider(self) -> TracerProvider | None:
        """This run's OpenTelemetry tracer provider: give it to other instrumentation so that
        their spans join the episodes (``set_global_provider=True`` installs it globally)."""
        return self.provider

    # --- installing --------------------------------------------------------------------------
    def install(self) -> Rollouts:
        """Make this the process's instance (what ``otr.episode`` & co record into): the one
        installed before is stopped (its open episodes ended, truncated, and delivered)."""
        slot = _runtime.slot()
        with slot.configure_lock:
            old = slot.installed
            if old is not None and old is not self and old.pid == os.getpid():
                if isinstance(old, Rollouts):
                    # bounded by the old run's exit_timeout; its retries back off meanwhile
                    old.shutdown(timeout=old.settings.delivery.exit_timeout)
            slot.last_stopped = None  # a new run: otr.stats() counts from zero
            slot.install(self)
            if not self.enabled:
                return self
            _redact_own_logs(self.redactor)
            self._start_gateway()  # after the run it replaces let go of the ports
            if self.settings.set_global_provider and self.provider is not None:
                from opentelemetry import trace

                trace.set_tracer_provider(self.provider)
            self._start_ticker()
            self.exit_hooks.install(self._at_exit_flush, self.settings.delivery.exit_timeout,
                                    self.settings.delivery.handle_signals)
        return self

    def rebuild_after_fork(self) -> Callable[[], _runtime.Runtime | None] | None:
        settings = self.settings.for_forked_child()
        if self.delivery is not None:
            try:
                self.delivery.forget_after_fork()  # (a renderer process's pipes: the parent's)
            except Exception:  # noqa: BLE001 - a fork must never fail here
                pass

        def rebuild() -> _runtime.Runtime | None:
            return Rollouts(settings).install()

        return rebuild

    def _start_gateway(self) -> None:
        options = self.settings.gateway
        pipeline, delivery = self.sampling_pipeline, self.delivery
        if options is None or pipeline is None or delivery is None or self.counters is None:
            return
        if options is True:
            options = GatewayOptions()
        if not isinstance(options, GatewayOptions):
            raise TypeError(f"gateway: expected True or an otr.GatewayOptions, got {type(options).__name__}")
        # the gateway process exports what belongs to no episode with the run's OTLP exporters
        recipes = [r for r in (exporter_recipe(e) for e in delivery.exporters) if r is not None and is_otlp(r)]
        log_recipe = None
        if options.log_exporter is not None:
            log_recipe = exporter_recipe(options.log_exporter)
            if log_recipe is None:
                self.counters.add("errors.gateway_log_exporter")
                logger.warning("otel_rollouts: GatewayOptions.log_exporter %s cannot be rebuilt in the gateway "
                     "process; the OTLP log exporter the environment names is used instead",
                     type(options.log_exporter).__name__)
        try:
            self.gateway = SpanGateway(options, self.counters, run_id=self.run_id, span_recipes=recipes,
                                       log_recipe=log_recipe).start()
        except Exception as exc:  # noqa: BLE001 - no gateway: reported, training goes on
            self.counters.add("errors.gateway_start")
            logger.warning("otel_rollouts: the span gateway could not start: %s", exception_text(exc))
            return
        pipeline.gateway = self.gateway
        delivery.use_gateway(self.gateway.address, options.pull_timeout_s)

    def _start_ticker(self) -> None:
        if self._ticker is not None and self._ticker.is_alive():
            return
        self._ticker_stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="otel-rollouts-ticker", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._ticker_stop.wait(_TICK_S):
            pipeline = self.sampling_pipeline
            if pipeline is None or not self.enabled:
                continue
            try:
                pipeline.tick()
            except BaseException:  # noqa: BLE001 - a user policy's error never stops the ticker
                if self.counters is not None:
                    self.counters.add("errors.ticker")

    def _at_exit_flush(self, timeout: float) -> None:
        if self.pid != os.getpid():
            return  # a forked child's copy of its parent's instance: the parent delivers it
        self.shutdown(timeout=timeout)

    def episode(self, step: int | None = None, split: str = "train", **fields: Any) -> Episode:
        """An episode recorded into this run (``otr.episode`` records into the installed one);
        takes the same arguments as ``otr.episode``."""
        return Episode(step, split, runtime=self, **fields)

    @contextmanager
    def activate(self) -> Iterator[Rollouts]:
        """Make this instance the active one in the current context for the ``with`` block.

        Every entry point called inside (``otr.episode``, ``otr.record_batch``,
        ``otr.record_token_batch``, ``@otr.traced``, the adapters, ``otr.end_step`` and the
        other module-level controls) then records into, counts in and takes its strictness from
        this instance instead of the installed one. Other threads and tasks are not affected
        (a ``contextvars`` binding: copy the context to carry it into a thread)."""
        bound = _runtime.slot().bound
        token = bound.set(self)
        try:
            yield self
        finally:
            bound.reset(token)

    # --- the controls ------------------------------------------------------------------------
    def end_step(self, step: int, split: str | None = None) -> None:
        """Close training step ``step`` (all splits, or one): the sampler decides and exports.

        Also advances the default step of new episodes to ``step + 1``."""
        pipeline = self.sampling_pipeline
        if not self.enabled or pipeline is None:
            return
        self.settle()
        pipeline.end_step(int(step), split)
        if int(step) >= self.current_step:
            self.current_step = int(step) + 1

    def set_step(self, step: int) -> None:
        """Set the step that episodes started without ``step=`` belong to."""
        self.current_step = int(step)

    def describe_run(self, *, system: object = None, system_version: object = None, algorithm: object = None,
                     model_name: object = None, environment_name: object = None) -> dict[str, str]:
        """Describe the run as the RL conventions' resource attributes (``rl.system.name``,
        ``rl.system.version``, ``rl.algorithm``, lower case, ``rl.model.name``,
        ``rl.environment.name``): on the resource of every span rendered from now on (the
        metrics' and logs' resources are the ones ``configure`` made). None: left as it is; a
        value given again replaces the earlier one. Adapters call it with what the framework's
        configuration says; a user may too. Returns the description so far."""
        given = {c.RL_SYSTEM_NAME: system, c.RL_SYSTEM_VERSION: system_version, c.RL_ALGORITHM: algorithm,
                 c.RL_MODEL_NAME: model_name, c.RL_ENVIRONMENT_NAME: environment_name}
        changed: dict[str, str] = {}
        for key, value in given.items():
            if value is None:
                continue
            label = value if type(value) is str else text(value)
            if key == c.RL_ALGORITHM:
                label = label.lower()
            if label and self.described.get(key) != label:
                changed[key] = label
        if changed and self.enabled and self.delivery is not None:
            self.described.update(changed)
            self.delivery.describe_run(changed)
        return dict(self.described)

    def flush(self, timeout: float = 30.0) -> bool:
        """Close every open step and wait until kept episodes reached the exporters."""
        pipeline = self.sampling_pipeline
        if not self.enabled or pipeline is None or self.delivery is None:
            return True
        try:
            self.settle()
            pipeline.close_all()
            ok = self.metrics.flush(timeout) if self.metrics is not None else True
            return self.delivery.flush(timeout) and ok
        except Exception as exc:  # noqa: BLE001
            logger.warning("otel_rollouts: flush failed: %s", exc)
            return False

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Flush and stop; episodes still open are ended and marked truncated. Never hangs.

        Returns within ``timeout`` whatever holds the library's locks (at a signal, the
        interrupted thread may): what could not be delivered by then is counted in ``stats()``,
        which keeps the final totals after shutdown."""
        deadline = time.monotonic() + timeout
        slot = _runtime.slot()
        locked = slot.configure_lock.acquire(timeout=max(timeout / 4, 0.0))
        try:
            try:
                ok = self._stop(max(deadline - time.monotonic(), 0.0)) and locked
            except Exception as exc:  # noqa: BLE001
                logger.warning("otel_rollouts: shutdown failed: %s", exc)
                ok = False
            if slot.installed is self:
                slot.install(None)
                slot.last_stopped = self
                redact_sdk_logs(None)
            return ok
        finally:
            if locked:
                slot.configure_lock.release()

    def _stop(self, timeout: float) -> bool:
        """End open episodes (truncated), close every step, deliver, stop; within ``timeout``.

        Every lock is taken with a deadline: at a signal the thread holding one may be the one
        that was interrupted. What cannot be decided by then is counted, not waited for."""
        self._ticker_stop.set()
        self.exit_hooks.uninstall(self._at_exit_flush)
        pipeline = self.sampling_pipeline
        if not self._stop_lock.acquire(blocking=False):
            return True  # another thread is stopping it
        try:
            if self._stopped or not self.enabled or pipeline is None or self.delivery is None:
                self._stopped = True
                return True
            self._stopped = True
            start = time.monotonic()
            deadline = start + timeout
            # the decisions (open episodes ended, steps closed) take at most a third of the time:
            # what is kept by then is delivered with the rest, what is not decided is counted
            decide_by = start + timeout / 3
            self.settle()  # spans of finished remote calls join before the last decisions
            self.stop_integrations()  # their threads (Ray's span collector) end before we return
            pipeline.stop_watching(timeout=max(decide_by - time.monotonic(), 0.0))  # hanging now: hung
            pipeline.end_open(c.STATUS_TRUNCATED, timeout=max(decide_by - time.monotonic(), 0.0) / 2,
                              deadline=decide_by)
            self.enabled = False
            closed = pipeline.close_all(timeout=max(decide_by - time.monotonic(), 0.0), deadline=decide_by)
            undecided = pipeline.count_undecided()
            if undecided:
                logger.warning(
                    "otel_rollouts: %d episode(s) were not decided before the shutdown deadline "
                    "(still open, or held by a step that could not be closed); none of them was "
                    "kept (counted undecided_at_exit in otr.stats())", undecided)
            metrics = self.metrics
            if metrics is not None:
                # step summaries go before the exporters stop (a tenth of what is left: the kept
                # episodes' delivery has the rest)
                metrics.flush(max(deadline - time.monotonic(), 0.0) / 10)
            # the last tenth (at most a second) is for the gateway and the metrics closed after
            # delivery; the renderer pulls the last kept episodes' server spans meanwhile
            reserve = min(timeout / 10, 1.0) if (self.gateway is not None or metrics is not None) else 0.0
            ok = self.delivery.shutdown(max(deadline - reserve - time.monotonic(), 0.0))
            if self.gateway is not None:  # the last decisions sent, the gateway's counts received
                self.gateway.stop(timeout=min(max(deadline - time.monotonic(), 0.0) / 2, 2.0))
            if metrics is not None:
                metrics.shutdown(max(deadline - time.monotonic(), 0.0))
            return ok and closed and not undecided
        finally:
            self._stop_lock.release()

    def stats(self) -> dict[str, Any]:
        """Counters: per ``"step/split"`` the sampler's (started, seen, kept, dropped.<reason>,
        late: ``seen = kept + dropped.*``) and delivery's per exporter (``ledger.entered``,
        ``delivered``, ``lost.<reason>``: ``kept = delivered + lost.* + pending``), totals, and
        per exporter what was delivered, spooled, pending and dropped (lost) now."""
        if self.counters is None:
            return {"totals": {}, "steps": {}}
        snapshot = self.counters.snapshot()
        if self.delivery is not None:
            snapshot["delivery"] = self.delivery.report()
        return snapshot



def configure(
    service_name: str | None = None,
    exporters: Sequence[SpanExporter] | None = None,
    sampler: TailSampler | None = None,
    *,
    capture_content: bool | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    trackio_project: str | None = None,
    deterministic_ids: bool = False,
    max_spans_per_episode: int = 1024,
    max_attribute_chars: int | None = None,
    max_queue: int | None = None,
    redact: bool | Callable[[str], str] | None = True,
    strict: bool = False,
    set_global_provider: bool = False,
    redact_patterns: Sequence[str] = (),
    max_episode_chars: int | None = 1_048_576,
    max_attributes_per_span: int | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    spool_max_bytes: int = 256 * 1024 * 1024,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    handle_signals: bool = True,
    exit_timeout: float = 10.0,
    metric_readers: Sequence[Any] | None = None,
    agent_name: str | None = None,
    episode_timeout_s: float | None = None,
    max_pending_bytes: int = 64 * 1024 * 1024,
    max_queue_bytes: int = 64 * 1024 * 1024,
    gateway: GatewayOptions | bool | None = None,
    hang: HangOptions | bool | float | None = None,
    mismatch: MismatchOptions | None = None,
    render: str | None = None,
    install: bool = True,
) -> Rollouts:
    """Set up tracing of episodes for this process and return the run (``otr.Rollouts``).

    Safe to call again: it reconfigures (the previous run's open episodes are ended, truncated,
    and delivered). Each option is taken from its argument, else from its environment variable
    (``otel_rollouts._core.settings.ENV_TABLE``: ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``,
    ``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``, ``OTEL_ROLLOUTS_SPOOL_DIR``...), else its default.
    ``install=False`` builds a run without making it the process's one (its methods still work).

    * ``exporters``: any OpenTelemetry ``SpanExporter`` (OTLP, in-memory, ours). Default: a local
      Trackio project (``trackio_project``, env ``OTEL_ROLLOUTS_TRACKIO_PROJECT``) plus OTLP
      when ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set.
    * ``sampler``: the per-step tail sampler (default ``TailSampler(32, "top_bottom")``).
    * ``capture_content``: record prompts, completions, tool arguments and results (default on;
      env ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false`` turns it off).
    * ``OTEL_SDK_DISABLED=true`` makes every call a cheap no-op.
    * ``strict``: raise on refused values instead of recording them flagged.
    * ``set_global_provider``: also install the TracerProvider as OpenTelemetry's global one, so
      other instrumentation's spans (httpx, OpenAI clients) join episode traces.
    * ``redact`` (default on), ``redact_patterns``: secrets in captured content are replaced
      before anything leaves the process (see ``otel_rollouts._core.redaction``); a callable is run
      after the built-in patterns; ``False`` turns the built-in patterns off.
    * ``max_attribute_chars`` / ``max_episode_chars``: text budgets per attribute and per
      episode (head and tail kept, cut attributes named in ``rl.content.truncated``);
      ``max_spans_per_episode``: spans beyond it are dropped and counted;
      ``max_attributes_per_span``: OpenTelemetry's attribute-count limit (default 128) raised.
    * ``spool_dir`` / ``spool_max_bytes``: where batches an exporter failed wait for it to come
      back (default: a private temporary directory, removed when empty), and its cap;
      ``max_request_bytes``: OTLP requests are split under the collector's message-size limit.
    * ``handle_signals`` / ``exit_timeout``: flush at exit, SIGTERM included, within this time.
    * ``gateway``: ``True`` or ``otr.GatewayOptions(...)`` receives OTLP (HTTP 4318, gRPC 4317 on
      127.0.0.1 by default) from inference servers and other services: their spans and log
      records are kept or dropped with their episode (``otr.gateway()`` says where it listens).
    * ``hang``: an episode still running past a threshold is shown while it hangs, as a pending
      snapshot (its tree so far, the span it is stuck in) to exporters that show them (Trackio),
      and counted ``hung`` if it never ends. Default (None or True): 3 × the step's median
      episode duration, at least 30 s (``otr.HangOptions``); a number: that many seconds;
      ``False``: off.
    * ``mismatch``: how the train–inference mismatch of token logprobs is summarised
      (``otr.MismatchOptions``: the importance-ratio band whose leavers are counted, default
      (0.5, 2.0); how many of a kept generation's worst tokens are shown, default 16).
    * ``agent_name``: ``gen_ai.agent.name`` on every episode root (default: the service name).
    * ``episode_timeout_s``: an episode still open after this long is ended as truncated
      (``rl.timed_out``), decided and counted (``episodes.timed_out``); default None: never.
    * ``max_pending_bytes``: per exporter, the bytes (real sizes, not characters) of batches
      waiting in memory for it; past that the oldest go to the spool (or are dropped, counted,
      without one).
    * ``max_queue_bytes``: the bytes of kept episodes waiting to be rendered; past that a kept
      episode is lost, counted (``lost.queue_full.<exporter>``), never waited for.
    * ``render``: where kept episodes are rendered (redaction, views, encoding) and exported:
      ``"thread"`` (a thread of this process), ``"process"`` (a renderer process that owns the
      exporters, off this process's GIL and CPU; see ``otel_rollouts.delivery.process``) or
      ``"auto"`` (default): the renderer process for the exporters made from the environment
      (``exporters`` not given: local Trackio, OTLP), a thread for exporter objects given here,
      which stay in this process as they were given; env ``OTEL_ROLLOUTS_RENDER``. With
      ``"process"``, exporters that cannot be made in another process fall back to ``"thread"``
      with a warning (``render.process_fallback`` in ``stats()``); ``"auto"`` falls back
      silently.
    * ``metric_readers``: OpenTelemetry metric readers for the rollout metrics (see
      ``otel_rollouts.correlate.metrics``; ``OTEL_METRICS_EXPORTER=otlp`` adds OTLP). Exporters with a
      ``log_metrics(step, values)`` method (``otel_rollouts.exporters.MetricsSink``: Trackio) get each closed step's summary.
    """
    env = from_environment()
    settings = validated(Settings(
        service_name=service_name,
        exporters=tuple(exporters) if exporters is not None else None,
        resource_attributes=resource_attributes,
        run_id=given_or(run_id, env, "run_id", None),
        trackio_project=given_or(trackio_project, env, "trackio_project", None),
        strict=strict,
        set_global_provider=set_global_provider,
        metric_readers=tuple(metric_readers) if metric_readers is not None else None,
        disabled=given_or(None, env, "disabled", False),
        gateway=gateway,
        content=ContentSettings(
            capture_content=given_or(capture_content, env, "content.capture_content",
                                     ContentSettings.capture_content),
            redact=redact,
            redact_patterns=tuple(redact_patterns),
            max_attribute_chars=given_or(max_attribute_chars, env, "content.max_attribute_chars",
                                         ContentSettings.max_attribute_chars),
            max_episode_chars=max_episode_chars,
            agent_name=agent_name,
        ),
        limits=LimitSettings(
            max_spans_per_episode=max_spans_per_episode,
            max_attributes_per_span=given_or(max_attributes_per_span, env, "limits.max_attributes_per_span",
                                             LimitSettings.max_attributes_per_span),
            episode_timeout_s=episode_timeout_s,
        ),
        delivery=DeliverySettings(
            max_queue=max_queue,
            spool_dir=given_or(spool_dir, env, "delivery.spool_dir", None),
            spool_max_bytes=spool_max_bytes,
            max_request_bytes=max_request_bytes,
            max_pending_bytes=max_pending_bytes,
            max_queue_bytes=max_queue_bytes,
            handle_signals=handle_signals,
            exit_timeout=exit_timeout,
            render=given_or(render, env, "delivery.render", DeliverySettings.render),
        ),
        sampling=SamplingSettings(
            sampler=sampler,
            deterministic_ids=deterministic_ids,
            hang=hang,
            mismatch=mismatch,
        ),
    ))
    rollouts = Rollouts(settings)
    return rollouts.install() if install else rollouts


def _metrics(resource: Resource, readers: Sequence[Any] | None, exporters: Sequence[Any],
             stats: Stats, redactor: Redactor | None) -> RolloutMetrics | None:
    """Rollout metrics when there is somewhere to send them (readers, OTLP env, Trackio)."""
    from otel_rollouts.correlate.metrics import meter_provider

    provider = meter_provider(resource, readers)
    sinks = [e for e in exporters if isinstance(e, (MetricsSink, GroupsSink))]
    if provider is None and not sinks:
        return None
    label = redactor.name if redactor is not None else None
    return RolloutMetrics(provider, sinks, stats, label)


def _installed() -> Rollouts | None:
    """The instance the module-level controls act on: the one bound to this context
    (``Rollouts.activate()``), else the installed one."""
    rt = _runtime.active()
    return rt if isinstance(rt, Rollouts) else None


def gateway() -> SpanGateway | None:
    """The installed run's span gateway (``configure(gateway=...)``), None without one."""
    rollouts = _installed()
    return rollouts.gateway if rollouts is not None else None


def tracer_provider() -> TracerProvider | None:
    """The installed run's OpenTelemetry tracer provider (None before ``configure()``)."""
    rollouts = _installed()
    return rollouts.provider if rollouts is not None else None


@guarded
def end_step(step: int, split: str | None = None) -> None:
    """Close training step ``step`` (all splits, or one): the sampler decides and exports.

    Also advances the default step of new episodes to ``step + 1``.
    """
    rt = _runtime.current()
    if isinstance(rt, Rollouts):
        rt.end_step(step, split)


@guarded
def describe_run(*, system: object = None, system_version: object = None, algorithm: object = None,
                 model_name: object = None, environment_name: object = None) -> dict[str, str]:
    """Describe the installed run: the framework (``rl.system.name``) and its version, the
    algorithm (``rl.algorithm``, lower case), the policy model (``rl.model.name``) and the
    environment (``rl.environment.name``), as resource attributes of every span exported from
    now on (see ``Rollouts.describe_run``). The adapters call it with what the framework's
    configuration says. Returns the description so far ({} before ``configure()``)."""
    rt = _runtime.current()
    if isinstance(rt, Rollouts):
        return rt.describe_run(system=system, system_version=system_version, algorithm=algorithm,
                               model_name=model_name, environment_name=environment_name)
    return {}


@guarded
def set_step(step: int) -> None:
    """Set the step that episodes started without ``step=`` belong to."""
    rt = _runtime.current()
    rt.current_step = int(step)


def flush(timeout: float = 30.0) -> bool:
    """Close every open step and wait until kept episodes reached the exporters."""
    rollouts = _installed()
    return rollouts.flush(timeout) if rollouts is not None else True


def shutdown(timeout: float = 30.0) -> bool:
    """Flush and stop; episodes still open are ended and marked truncated. Never hangs.

    Returns within ``timeout`` whatever holds the library's locks (at a signal, the interrupted
    thread may): what could not be delivered by then is counted in ``otr.stats()``, which keeps
    the final totals after shutdown.
    """
    rollouts = _installed()
    if rollouts is None:
        _runtime.install(None)
        return True
    return rollouts.shutdown(timeout)


def stats() -> dict[str, Any]:
    """Counters: per ``"step/split"`` (started, seen, kept, dropped.<reason>, late; and per
    exporter ledger.entered, delivered, lost.<reason>) and totals; see ``Rollouts.stats``.

    After ``shutdown()`` (and until the next ``configure()``) the final totals of the last run.
    """
    slot = _runtime.slot()
    rt = _runtime.active() or slot.last_stopped
    return rt.stats() if isinstance(rt, Rollouts) else {"totals": {}, "steps": {}}
