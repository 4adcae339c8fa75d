"""``configure()`` and the process-wide controls: ``end_step``, ``flush``, ``shutdown``, ``stats``."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_rollouts import conventions as c
from otel_rollouts._core import exit as _exit
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.guard import guarded, reset_reports
from otel_rollouts._core.redaction import RedactingLogFilter, Redactor, make_redactor
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.defaults import default_exporters
from otel_rollouts.delivery.materialize import Materializer
from otel_rollouts.delivery.outlet import DEFAULT_MAX_REQUEST_BYTES, Delivery
from otel_rollouts.sampling.pipeline import Pipeline
from otel_rollouts.sampling.policies import TailSampler

logger = logging.getLogger("otel_rollouts")

__all__ = ["configure", "end_step", "flush", "shutdown", "stats", "set_step"]

_lock = threading.RLock()
_ticker: threading.Thread | None = None
_ticker_stop = threading.Event()
_last: _runtime.Runtime | None = None  # the last runtime stopped: otr.stats() reads it after shutdown


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("otel-rollouts")
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


def _redact_own_logs(redactor: Redactor | None) -> None:
    """The library's own log lines quote refused values and error messages: they are redacted
    with the run's redactor before any handler (a console, an OTLP log exporter) sees them."""
    own = logging.getLogger(c.SCOPE_NAME)
    for old in [f for f in own.filters if isinstance(f, RedactingLogFilter)]:
        own.removeFilter(old)
    if redactor is not None:
        own.addFilter(RedactingLogFilter(redactor))


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
    max_attribute_chars: int = 16_384,
    max_queue: int | None = None,
    redact: bool | Callable[[str], str] | None = True,
    strict: bool = False,
    set_global_provider: bool = False,
    redact_patterns: Sequence[str] = (),
    max_episode_chars: int | None = 1_048_576,
    max_attributes_per_span: int = 1024,
    spool_dir: str | os.PathLike[str] | None = None,
    spool_max_bytes: int = 256 * 1024 * 1024,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    handle_signals: bool = True,
    exit_timeout: float = 10.0,
    metric_readers: Sequence[Any] | None = None,
    agent_name: str | None = None,
    episode_timeout_s: float | None = None,
    max_pending_bytes: int = 64 * 1024 * 1024,
) -> None:
    """Set up tracing of episodes for this process. Safe to call again: it reconfigures.

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
    * ``agent_name``: ``gen_ai.agent.name`` on every episode root (default: the service name).
    * ``episode_timeout_s``: an episode still open after this long is ended as truncated
      (``rl.timed_out``), decided and counted (``episodes.timed_out``); default None: never.
    * ``max_pending_bytes``: per exporter, the bytes of batches waiting in memory for it; past
      that the oldest go to the spool (or are dropped, counted, without one).
    * ``metric_readers``: OpenTelemetry metric readers for the rollout metrics (see
      ``otel_rollouts.correlate.metrics``; ``OTEL_METRICS_EXPORTER=otlp`` adds OTLP). Exporters with a
      ``log_metrics(step, values)`` method (Trackio) get each closed step's summary.
    """
    global _last
    arguments = dict(locals())  # a forked child rebuilds its own runtime from these (workers.py)
    if episode_timeout_s is not None and not episode_timeout_s > 0:
        raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s!r}")
    if not max_pending_bytes > 0:
        raise ValueError(f"max_pending_bytes must be > 0, got {max_pending_bytes!r}")
    with _lock:
        old = _runtime.installed()
        if old is not None and old.extra.get("pid", os.getpid()) != os.getpid():
            old = None  # inherited through fork: the parent's threads are not here; the parent delivers it
        if old is not None:
            # its open episodes are ended (truncated) and delivered by the pipeline they began in
            _stop_runtime(old, timeout=10.0)
        _last = None  # a new run: otr.stats() counts from zero
        if _env_flag(c.ENV_SDK_DISABLED):
            _runtime.install(_runtime.Runtime(enabled=False))
            return
        if capture_content is None:
            env = _env_flag(c.ENV_CAPTURE_CONTENT)
            capture_content = True if env is None else env
        sampler = sampler or TailSampler()
        run_id = run_id or uuid.uuid4().hex[:12]
        redactor = make_redactor(redact, redact_patterns)
        resource = _resource(service_name, resource_attributes, run_id, redactor)
        _redact_own_logs(redactor)
        reset_reports()
        stats = Stats()
        if exporters is None:
            exporters = default_exporters(trackio_project, redactor)
        materializer = Materializer(
            resource,
            InstrumentationScope(c.SCOPE_NAME, _version()),
            max_attribute_chars=max_attribute_chars,
            redact=redactor,
            max_episode_chars=max_episode_chars,
            agent_name=agent_name,
            capture_content=bool(capture_content),
        )
        queue_size = max_queue or max(1024, 16 * sampler.max_traces_per_step)
        delivery = Delivery(
            list(exporters),
            materializer,
            stats,
            max_queue=queue_size,
            spool_dir=spool_dir,
            spool_max_bytes=spool_max_bytes,
            max_request_bytes=max_request_bytes,
            max_pending_bytes=max_pending_bytes,
        )
        pipeline = Pipeline(sampler, delivery, stats, episode_timeout_s=episode_timeout_s)
        provider = TracerProvider(
            resource=resource,
            shutdown_on_exit=False,
            span_limits=SpanLimits(
                max_attributes=max_attributes_per_span,
                max_event_attributes=max_attributes_per_span,
                max_span_attributes=max_attributes_per_span,
            ),
        )
        provider.add_span_processor(pipeline)
        if set_global_provider:
            from opentelemetry import trace

            trace.set_tracer_provider(provider)
        rt = _runtime.Runtime(
            enabled=True,
            pipeline=pipeline,
            delivery=delivery,
            provider=provider,
            stats=stats,
            capture_content=bool(capture_content),
            max_spans_per_episode=max_spans_per_episode,
            strict=strict,
            run_id=run_id,
            deterministic_ids=deterministic_ids,
            tracer=provider.get_tracer(c.SCOPE_NAME, _version()),
            redactor=redactor,
        )
        rt.extra["pid"] = os.getpid()
        rt.extra["configure_kwargs"] = arguments
        _attach_metrics(rt, resource, metric_readers, exporters)
        _runtime.install(rt)
        _start_ticker()
        _exit.install(_at_exit_flush, exit_timeout, handle_signals)


def _attach_metrics(rt: _runtime.Runtime, resource: Resource, readers, exporters) -> None:
    """Rollout metrics when there is somewhere to send them (readers, OTLP env, Trackio)."""
    from otel_rollouts.correlate.metrics import RolloutMetrics, meter_provider

    provider = meter_provider(resource, readers)
    sinks = [e for e in exporters if callable(getattr(e, "log_metrics", None))]
    if provider is None and not sinks:
        return
    label = rt.redactor.name if rt.redactor is not None else None
    rt.extra["metrics"] = rt.pipeline.observer = RolloutMetrics(provider, sinks, rt.stats, label)


def _start_ticker() -> None:
    global _ticker
    if _ticker is not None and _ticker.is_alive():
        return
    _ticker_stop.clear()

    def tick() -> None:
        while not _ticker_stop.wait(1.0):
            rt = _runtime.installed()
            if rt is not None and rt.pipeline is not None:
                try:
                    rt.pipeline.tick()
                except BaseException:  # noqa: BLE001 - a user policy's error never stops the ticker
                    if rt.stats is not None:
                        rt.stats.add("errors.ticker")

    _ticker = threading.Thread(target=tick, name="otel-rollouts-ticker", daemon=True)
    _ticker.start()


def _stop_runtime(rt: _runtime.Runtime, timeout: float) -> bool:
    """End open episodes (truncated), close every step, deliver, stop; within ``timeout``.

    Every lock is taken with a deadline: at a signal the thread holding one may be the one
    that was interrupted. What cannot be decided by then is counted, not waited for.
    """
    global _last
    if not rt.enabled or rt.pipeline is None or rt.delivery is None:
        return True
    deadline = time.monotonic() + timeout
    rt.pipeline.end_open(c.STATUS_TRUNCATED, timeout=timeout / 4)
    rt.enabled = False
    closed = rt.pipeline.close_all(timeout=max(deadline - time.monotonic(), 0.0) / 3)
    metrics = rt.extra.get("metrics")
    if metrics is not None:
        metrics.flush(max(deadline - time.monotonic(), 0.0) / 2)  # step summaries go before exporters stop
    ok = rt.delivery.shutdown(max(deadline - time.monotonic(), 0.0))
    if metrics is not None:
        metrics.shutdown(max(deadline - time.monotonic(), 0.0))
    _last = rt
    return ok and closed


def _at_exit_flush(timeout: float) -> None:
    rt = _runtime.installed()
    if rt is not None and rt.extra.get("pid", os.getpid()) != os.getpid():
        return  # a forked child's copy of its parent's runtime: the parent delivers it
    shutdown(timeout=timeout)


@guarded
def end_step(step: int, split: str | None = None) -> None:
    """Close training step ``step`` (all splits, or one): the sampler decides and exports.

    Also advances the default step of new episodes to ``step + 1``.
    """
    rt = _runtime.current()
    if not rt.enabled or rt.pipeline is None:
        return
    rt.pipeline.end_step(int(step), split)
    if int(step) >= rt.current_step:
        rt.current_step = int(step) + 1


@guarded
def set_step(step: int) -> None:
    """Set the step that episodes started without ``step=`` belong to."""
    rt = _runtime.current()
    rt.current_step = int(step)


def flush(timeout: float = 30.0) -> bool:
    """Close every open step and wait until kept episodes reached the exporters."""
    rt = _runtime.installed()
    if rt is None or not rt.enabled or rt.pipeline is None or rt.delivery is None:
        return True
    try:
        rt.pipeline.close_all()
        metrics = rt.extra.get("metrics")
        ok = metrics.flush(timeout) if metrics is not None else True
        return rt.delivery.flush(timeout) and ok
    except Exception as exc:  # noqa: BLE001
        logger.warning("otel_rollouts: flush failed: %s", exc)
        return False


def shutdown(timeout: float = 30.0) -> bool:
    """Flush and stop; episodes still open are ended and marked truncated. Never hangs.

    Returns within ``timeout`` whatever holds the library's locks (at a signal, the interrupted
    thread may): what could not be delivered by then is counted in ``otr.stats()``, which keeps
    the final totals after shutdown.
    """
    deadline = time.monotonic() + timeout
    locked = _lock.acquire(timeout=max(timeout / 4, 0.0))
    try:
        rt = _runtime.installed()
        if rt is None:
            return True
        try:
            ok = _stop_runtime(rt, max(deadline - time.monotonic(), 0.0)) and locked
        except Exception as exc:  # noqa: BLE001
            logger.warning("otel_rollouts: shutdown failed: %s", exc)
            ok = False
        _runtime.install(None)
        _ticker_stop.set()
        return ok
    finally:
        if locked:
            _lock.release()


def _snapshot(rt: _runtime.Runtime) -> dict[str, Any]:
    snapshot = rt.stats.snapshot() if rt.stats is not None else {"totals": {}, "steps": {}}
    if rt.delivery is not None:
        snapshot["delivery"] = rt.delivery.report()
    return snapshot


def stats() -> dict[str, Any]:
    """Counters: per ``"step/split"`` (started, seen, kept, dropped.<reason>, late) and totals.

    After ``shutdown()`` (and until the next ``configure()``) the final totals of the last run.
    """
    rt = _runtime.installed()
    if rt is None or rt.stats is None:
        last = _last
        return _snapshot(last) if last is not None else {"totals": {}, "steps": {}}
    return _snapshot(rt)
