"""Episode context across Ray calls: remote functions and actor methods join the episode.

``@otr.ray_remote`` stands in for ``@ray.remote`` (same options). Each call made from inside an
episode carries the episode's context (W3C ``traceparent`` + baggage) to the task; the spans the
task records with ``@otr.traced`` are recorded there under the caller's span, like a process-pool
task's (``correlate.workers``), and come back as one extra return object of the same task, with
the log records the task made in the episode (the worker's records exported:
``otr.instrument_logging(otlp=True)`` or ``exporter=`` in the actor or task; at most
``MAX_TASK_LOG_BYTES`` a call, the rest counted ``dropped.worker_logs``), which join the
episode in the caller, kept or dropped with it, with the run's resource. The
caller gets exactly the object refs it would get from ``@ray.remote``; the extra one goes to this
run's ``RaySpans`` collector, which hands the spans to their episode, held and kept or dropped
with it. Nothing is exported from the actor.

    @otr.ray_remote                       # instead of @ray.remote
    @otr.traced(kind="tool")
    def run_tool(query): ...

    @otr.ray_remote(max_concurrency=4)    # a threaded actor; async actors work the same
    class Env:
        @otr.traced(kind="env")
        def step(self, action): ...

    env = Env.remote()
    with otr.episode(step=3) as ep:
        obs = ray.get(env.step.remote(action))     # the env span is a child of the episode

Timing: the collector adopts spans in a background thread as their tasks finish, and
``otr.end_step`` / ``otr.flush`` first adopt every one whose task has finished, so a call whose
value the trainer already has is in its episode when the step is decided. A task still running
when its step closes delivers its spans late: exported if the episode was kept, dropped (counted
as ``dropped.late_spans``) if not. Spans of a task that died with its actor are lost (counted as
``dropped.ray_spans``). At most ``MAX_PENDING`` calls wait for their spans; past that a call's
spans are not waited for (counted as ``dropped.ray_spans``).

Limits: spans of a remote call made *inside* a remote task join that task's own spans only if
the task runs in a process where otel_rollouts holds the episode (not one level further down).
An actor handle got back with ``ray.get_actor`` is Ray's own: wrap it with ``otr.ray_actor``.
``ray.kill`` takes ``handle.ray_handle``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import exception_text
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts.correlate.workers import (
    _EXC_ATTR,
    _EXC_LOGS_ATTR,
    _hand_over,
    _hand_over_logs,
    _run_captured,
    _run_captured_async,
    context_carrier,
)

__all__ = ["RaySpans", "TracedActorClass", "TracedActorHandle", "TracedRemoteFunction", "ray_actor", "ray_remote"]

MAX_PENDING = 100_000
_PREFIX = "_otr_call__"  # the actor's carrier-taking twin of each public method
_EXTENSION = "ray_spans"
# how long a step's close waits for the spans of a call whose value is stored (they are stored
# right after it: microseconds, unless the machine preempts Ray's thread between the two)
_SPANS_AFTER_VALUE_S = 1.0
_STOP_S = 1.0  # how long shutdown waits for the collector thread (one ray.wait of 0.2 s at most)


def _ray() -> Any:
    import ray

    return ray


def ray_remote(target: Any = None, /, **options: Any) -> Any:
    """``@ray.remote`` for functions and actor classes, with the episode's context carried into
    every call and the call's spans brought back to the episode. Takes ``ray.remote``'s options
    (``@otr.ray_remote(num_cpus=1)``); Ray itself is imported at the first call."""
    if target is None:
        return lambda t: ray_remote(t, **options)
    if inspect.isclass(target):
        return TracedActorClass(target, options)
    if callable(target):
        return TracedRemoteFunction(target, options)
    raise TypeError(f"otr.ray_remote: expected a function or a class, got {type(target).__name__}")


def _returns(options: dict[str, Any], default: int = 1) -> int:
    n = options.get("num_returns", default)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TypeError(f"otr.ray_remote: num_returns={n!r} is not supported (a positive int only)")
    return n


# --- the task side ---------------------------------------------------------------------------------
def _split(result: Any, n: int) -> tuple[Any, ...]:
    """The task's value(s), then what goes back to its episode: spans, trace id, log records
    and how many of them did not fit (``WorkerResult``'s, as a pool task's)."""
    spans = (result.spans, result.trace_id, result.logs, result.lost_logs)
    if n == 1:
        return (result.value, spans)
    return (*result.value, spans)


def _task(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """``fn`` taking the carrier first and returning its value(s) plus its spans."""
    if inspect.iscoroutinefunction(fn):

        async def call_async(carrier: dict[str, str], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
            return _split(await _run_captured_async(fn, carrier, args, kwargs), n)

        return _named(call_async, fn)

    def call(carrier: dict[str, str], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return _split(_run_captured(fn, carrier, args, kwargs), n)

    return _named(call, fn)


def _named(call: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` under ``fn``'s name (what Ray shows), keeping its own signature: Ray checks a
    call's arguments against the signature it sees, and ``call`` takes the carrier first."""
    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        try:
            setattr(call, attr, getattr(fn, attr))
        except (AttributeError, TypeError):
            pass
    return call


def _method(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """An actor method's twin: ``self`` first, then the carrier."""
    if inspect.iscoroutinefunction(fn):

        async def call_async(self: Any, carrier: dict[str, str], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
            return _split(await _run_captured_async(fn, carrier, (self, *args), kwargs), n)

        return call_async

    def call(self: Any, carrier: dict[str, str], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return _split(_run_captured(fn, carrier, (self, *args), kwargs), n)

    return call


# --- the caller side -------------------------------------------------------------------------------
def _outgoing() -> tuple[dict[str, str], EpisodeRecord | None]:
    """The carrier for a call made now, and the episode it belongs to ({} outside an episode)."""
    try:
        span = trace.get_current_span()
        if not span.get_span_context().is_valid:
            return {}, None
        record = span.episode if isinstance(span, SpanRecord) else None
        return context_carrier(), record
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the call
        _report(f"ray call context: {exception_text(exc)}")
        return {}, None


def _returned(refs: Any, n: int, carrier: dict[str, str], record: EpisodeRecord | None) -> Any:
    """The refs the caller asked for; the spans ref goes to the run's collector."""
    if carrier:
        try:
            collector = RaySpans.of_current()
            if collector is not None:
                collector.track(refs[-1], record, refs[:-1])
        except Exception as exc:  # noqa: BLE001
            _report(f"ray spans: {exception_text(exc)}")
    return refs[0] if n == 1 else list(refs[:-1])


def _report(message: str) -> None:
    from otel_rollouts._core.guard import report

    report(message, may_raise=False)


class TracedRemoteFunction:
    """A remote function whose calls carry the episode context (``otr.ray_remote``)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any], built: Any = None) -> None:
        self._fn = fn
        self._options = dict(options)
        self._n = _returns(self._options)
        self._built = built
        functools.update_wrapper(self, fn)

    def _remote_function(self) -> Any:
        if self._built is None:
            options = {**self._options, "num_returns": self._n + 1}
            self._built = _ray().remote(**options)(_task(self._fn, self._n))
        return self._built

    def options(self, **options: Any) -> TracedRemoteFunction:
        n = _returns(options, self._n)
        built = self._remote_function().options(**{**options, "num_returns": n + 1})
        return TracedRemoteFunction(self._fn, {**self._options, **options}, built)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        carrier, record = _outgoing()
        refs = self._remote_function().remote(carrier, *args, **kwargs)
        return _returned(refs, self._n, carrier, record)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"remote function {self._fn.__name__} is called with .remote(...)")


class TracedActorClass:
    """An actor class whose method calls carry the episode context (``otr.ray_remote``)."""

    def __init__(self, cls: type, options: dict[str, Any], built: Any = None) -> None:
        self._cls = cls
        self._options = dict(options)
        self._built = built
        self._returns = {
            name: getattr(member, "__ray_num_returns__", 1)
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")
        }
        self.__name__, self.__qualname__, self.__doc__ = cls.__name__, cls.__qualname__, cls.__doc__

    def _actor_class(self) -> Any:
        if self._built is None:
            ray = _ray()
            twins: dict[str, Any] = {}
            for name, n in self._returns.items():
                twin = _method(getattr(self._cls, name), n)
                twins[_PREFIX + name] = ray.method(num_returns=n + 1)(twin)
            traced = type(self._cls.__name__, (self._cls,), {**twins, "__module__": self._cls.__module__,
                                                                  "__qualname__": self._cls.__qualname__})
            self._built = ray.remote(**self._options)(traced) if self._options else ray.remote(traced)
        return self._built

    def options(self, **options: Any) -> TracedActorClass:
        built = self._actor_class().options(**options)
        return TracedActorClass(self._cls, {**self._options, **options}, built)

    def remote(self, *args: Any, **kwargs: Any) -> TracedActorHandle:
        return TracedActorHandle(self._actor_class().remote(*args, **kwargs), self._returns)


def ray_actor(handle: Any, cls: type | TracedActorClass) -> TracedActorHandle:
    """Wrap a Ray handle of an ``otr.ray_remote`` actor got some other way (``ray.get_actor``)."""
    returns = cls._returns if isinstance(cls, TracedActorClass) else TracedActorClass(cls, {})._returns
    return TracedActorHandle(handle, returns)


class TracedActorHandle:
    """A Ray actor handle whose method calls carry the episode context; picklable, so it can be
    passed to other tasks and actors. ``ray_handle`` is Ray's own (for ``ray.kill``)."""

    def __init__(self, handle: Any, returns: dict[str, int]) -> None:
        self.ray_handle = handle
        self._returns = returns

    def __getattr__(self, name: str) -> Any:
        returns = self.__dict__.get("_returns", {})
        if name in returns:
            return TracedActorMethod(getattr(self.ray_handle, _PREFIX + name), returns[name])
        return getattr(self.__dict__["ray_handle"], name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TracedActorHandle, (self.ray_handle, self._returns))

    def __repr__(self) -> str:
        return f"TracedActorHandle({self.ray_handle!r})"


class TracedActorMethod:
    """One method of a ``TracedActorHandle``: ``.remote(...)`` and ``.options(...)``."""

    def __init__(self, method: Any, n: int) -> None:
        self._method = method
        self._n = n

    def options(self, **options: Any) -> TracedActorMethod:
        n = _returns(options, self._n)
        return TracedActorMethod(self._method.options(**{**options, "num_returns": n + 1}), n)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        carrier, record = _outgoing()
        refs = self._method.remote(carrier, *args, **kwargs)
        return _returned(refs, self._n, carrier, record)


# --- the run's collector ---------------------------------------------------------------------------
class RaySpans:
    """Waits for the spans of this run's Ray calls and hands them to their episodes.

    One per installed run (``Runtime.extensions``); a daemon thread adopts spans as their tasks
    finish, and ``settle`` (run before a step closes) adopts every one already finished."""

    def __init__(self, rt: _runtime.Runtime, ray: Any, limit: int = MAX_PENDING) -> None:
        self.rt = rt
        self.ray = ray
        self.limit = limit
        self.lock = threading.Lock()
        # held while popping finished calls and adopting their spans: ``settle`` waits for the
        # thread's batch under way, so a call the thread took is in its episode when settle returns
        self.adopting = threading.Lock()
        self.wake = threading.Event()
        self.pending: dict[Any, EpisodeRecord | None] = {}
        # each pending spans ref's value refs (what the caller got): a call whose values are
        # ready has finished, and its spans ref is stored right after them (``settle``)
        self.values: dict[Any, tuple[Any, ...]] = {}
        self.thread: threading.Thread | None = None
        self.stopped = False  # the run shut down: the thread ends and none starts again

    @classmethod
    def of_current(cls) -> RaySpans | None:
        """The installed run's collector (made on first use); None when nothing is recorded."""
        rt = _runtime.installed()
        if rt is None or not rt.enabled:
            return None
        collector = rt.extensions.get(_EXTENSION)
        if collector is None:
            with _runtime.slot().configure_lock:
                collector = rt.extensions.get(_EXTENSION)
                if collector is None:
                    collector = rt.extensions[_EXTENSION] = cls(rt, _ray())
                    rt.before_close.append(collector.settle)
                    rt.on_stop.append(collector.stop)
        return collector

    def _count(self, name: str, n: int = 1) -> None:
        if self.rt.counters is not None:
            self.rt.counters.add(name, n)

    def track(self, ref: Any, record: EpisodeRecord | None, values: Any = ()) -> None:
        with self.lock:
            if len(self.pending) >= self.limit:
                self._count("dropped.ray_spans")
                return
            self.pending[ref] = record
            if values:
                self.values[ref] = tuple(values)
            if self.thread is None and not self.stopped:
                self.thread = threading.Thread(target=self._run, name="otel-rollouts-ray-spans", daemon=True)
                self.thread.start()
        self.wake.set()

    def settle(self) -> None:
        """Adopt the spans of every call whose task has finished (run before a step closes).

        A call's returns are stored one after the other when its reply arrives: the caller may
        hold its value while its spans ref is not stored yet (a loaded machine preempts Ray's
        thread between the two). Such a call has finished: its spans are waited for (at most
        ``_SPANS_AFTER_VALUE_S``), so a call whose value the trainer has is in its episode when
        the step is decided."""
        with self.adopting:
            finished = self._finished(0)
            following = self._values_ready(finished)
            if following:
                ready, _ = self.ray.wait(following, num_returns=len(following),
                                         timeout=_SPANS_AFTER_VALUE_S, fetch_local=True)
                finished += list(ready)
            self._adopt(self._take(finished))

    def _values_ready(self, finished: list[Any]) -> list[Any]:
        """The pending spans refs not in ``finished`` whose call's values are all stored."""
        done = set(finished)
        with self.lock:
            waiting = [(ref, values) for ref, values in self.values.items()
                       if ref in self.pending and ref not in done]
        refs = [v for _, values in waiting for v in values]
        if not refs:
            return []
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        stored = set(ready)
        return [ref for ref, values in waiting if all(v in stored for v in values)]

    def stop(self, timeout: float = _STOP_S) -> None:
        """End the thread (at shutdown, after the last ``settle``), waiting for it at most
        ``timeout``: a user calls ``ray.shutdown()`` right after ``otr.shutdown()``, and a thread
        still asking Ray then would end the process (Ray's core worker exits on a call after its
        shutdown). What is still pending is counted ``dropped.ray_spans``."""
        with self.lock:
            self.stopped = True
            thread = self.thread
        self.wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self.lock:
            if self.pending:
                self._count("dropped.ray_spans", len(self.pending))
                self.pending.clear()
            self.values.clear()

    def _finished(self, timeout: float) -> list[Any]:
        """The pending calls whose task has finished (waiting up to ``timeout`` for one)."""
        with self.lock:
            refs = list(self.pending)
        if not refs:
            return []
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=True)
        return list(ready)

    def _take(self, refs: list[Any]) -> list[tuple[Any, EpisodeRecord | None]]:
        with self.lock:
            for ref in refs:
                self.values.pop(ref, None)
            return [(ref, self.pending.pop(ref)) for ref in refs if ref in self.pending]

    def _adopt(self, items: list[tuple[Any, EpisodeRecord | None]]) -> None:
        for ref, record in items:
            logs: tuple[bytes, int] | None = None
            try:
                data, trace_id, *rest = self.ray.get(ref)
                if len(rest) == 2:
                    logs = (rest[0], rest[1])
            except Exception as exc:  # noqa: BLE001 - the task raised, or its actor died
                cause = getattr(exc, "cause", None)
                carrier = cause if getattr(cause, _EXC_ATTR, None) is not None else exc
                carried = getattr(carrier, _EXC_ATTR, None)
                if carried is None:
                    self._count("dropped.ray_spans")
                    continue
                data, trace_id = carried
                logs = getattr(carrier, _EXC_LOGS_ATTR, None)
            _hand_over(data, trace_id, record)
            if logs is not None:
                _hand_over_logs(logs[0], logs[1], trace_id, record)

    def _run(self) -> None:
        while _runtime.installed() is self.rt and not self.stopped:
            if not self.pending:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                finished = self._finished(0.2)
                with self.adopting:
                    self._adopt(self._take(finished))
            except Exception as exc:  # noqa: BLE001 - a Ray shut down under us: stop waiting
                _report(f"ray spans: {exception_text(exc)}")
                with self.lock:
                    self._count("dropped.ray_spans", len(self.pending))
                    self.pending.clear()
                    self.values.clear()
        with self.lock:
            self.thread = None
