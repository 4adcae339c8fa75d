"""Containment: a library error never reaches user code unless strict mode was asked for."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import exception_text, reraise_interrupt

logger = logging.getLogger("otel_rollouts")
P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F")
_MAX_KINDS_LOGGED = 50
_MAX_LOGGED_CHARS = 500


class InvalidValue(ValueError):
    """Raised in strict mode for a value the library refused (the message names the field)."""


def report(message: str, *, exc: BaseException | None = None, may_raise: bool = True) -> None:
    """Count and log (once per message kind) a problem; raise it in strict mode (of the instance
    active in this context: bound to it, else installed)."""
    rt = _runtime.active()
    if rt is not None and rt.counters is not None:
        rt.counters.add("errors.library" if exc is not None else "invalid_values")
    if rt is not None and rt.strict and may_raise:
        if exc is not None:
            raise exc
        raise InvalidValue(message)
    # the kind is the message's first part (the field, or the function that failed); a message
    # is shortened for the log (a refused value may be huge) and the number of kinds logged is
    # capped, so bad input can never flood the log: everything is counted in otr.stats()
    kind = message.split(":", 1)[0][:80]
    if not first_time(kind):
        return
    logged = _runtime.slot().logged()
    if len(message) > _MAX_LOGGED_CHARS:
        message = message[:_MAX_LOGGED_CHARS] + f"... ({len(message)} chars)"
    try:
        if len(logged) > _MAX_KINDS_LOGGED:
            logger.warning("otel_rollouts: many kinds of problems reported; from now on they are only counted")
        elif exc is not None:
            logger.warning("otel_rollouts: internal error contained: %s", message, exc_info=exc)
        else:
            logger.warning("otel_rollouts: %s (further reports of this kind are counted only)", message)
    except BaseException as err:  # noqa: BLE001 - a traceback that cannot be printed, a broken handler
        reraise_interrupt(err)


def first_time(kind: str) -> bool:
    """Whether ``kind`` (of problem, warning, exporter failure) is seen for the first time in
    this run: the one log-once rule of the library. Each run (``configure()``) has its own set,
    bounded: past ``_MAX_KINDS_LOGGED`` kinds nothing more is logged, everything is counted."""
    logged = _runtime.slot().logged()
    if kind in logged or len(logged) > _MAX_KINDS_LOGGED:
        return False
    logged.add(kind)
    return True


def contained(where: str, exc: BaseException) -> None:
    """Count and log (once per kind) a failure that must not raise, even in strict mode.

    For the places where raising would replace the user's own exception (``__exit__``).
    """
    report(f"{where}: {exception_text(exc)}", exc=exc, may_raise=False)


def failed(where: str, exc: Exception) -> None:
    """A guarded body raised ``exc``: a value refused in strict mode goes on to the caller,
    anything else is reported (raised in strict mode) and the caller returns its fallback.

    The rule of ``guarded``; the per-span calls of the episode API write it inline
    (``try: ... except Exception as exc: failed(...)``) to spare a wrapper's call on every span.
    """
    if isinstance(exc, InvalidValue):
        raise exc
    report(f"{where}: {exception_text(exc)}", exc=exc)


def guarded_or(
    fallback: Callable[[], F],
) -> Callable[[Callable[P, R]], Callable[P, R | F]]:
    """Run the function; a library exception is reported and ``fallback()`` returned instead.

    ``fallback`` gives what the caller can still use (a no-op handle, an empty list), so user
    code that goes on with the result never breaks.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R | F]:
        where = getattr(fn, "__qualname__", "call")

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | F:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - containment is the point
                failed(where, exc)
                return fallback()

        return wrapper

    return decorate


def guarded(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Run the function; a library exception is reported and None returned instead."""
    return guarded_or(_none)(fn)


def _none() -> None:
    return None


def takes_instance(fn: Callable[P, R]) -> Callable[P, R]:
    """An entry point whose ``rollouts=`` keyword names the instance it records into: bound to
    the context for the call (its guard, strictness and counters included), so the installed
    instance is not consulted. A value that is not an instance is reported and ignored."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        rt = kwargs.get("rollouts")
        if rt is None:
            return fn(*args, **kwargs)
        if not isinstance(rt, _runtime.Runtime):
            kwargs["rollouts"] = None
            report(f"rollouts: expected an otr.Rollouts (from otr.configure), got {type(rt).__name__}")
            return fn(*args, **kwargs)
        with _runtime.bound_to(rt):
            return fn(*args, **kwargs)

    return wrapper
