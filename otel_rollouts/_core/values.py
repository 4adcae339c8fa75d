"""User values coerced to the numbers the span model needs, or refused with a reason that names
the field and describes the value as far as the run's content rule allows."""

from __future__ import annotations

import math
from typing import Any

from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import call_user, scalar, short_repr, type_name

__all__ = ["refused", "to_float", "to_int"]


def refused(value: Any) -> str:
    """How a refused value is described in ``rl.invalid`` and the library's warning: its type and
    a short ``repr``, or its type alone when content capture is off (the value may be content)."""
    rt = _runtime.installed()
    if rt is not None and not rt.capture_content:
        return type_name(value)
    return f"{type_name(value)} {short_repr(value)}"


def to_float(value: Any, field: str) -> tuple[float | None, str | None]:
    """Coerce a reward-like value to float; return (number, None) or (None, reason).

    Accepts ints, floats, bools, numpy/torch scalars and numeric strings (legacy loggers
    formatted rewards as text). NaN and infinities are refused with a reason naming ``field``.
    """
    if type(value) is float and math.isfinite(value):  # the common case, first
        return value, None
    value = scalar(value)
    if isinstance(value, bool):
        return float(value), None
    if isinstance(value, (int, float)):
        number, exc = call_user(float, value)
    elif isinstance(value, (str, bytes)):
        number, exc = call_user(float, value)
        if exc is not None:
            return None, f"{field}: not a number: {refused(value)}"
    else:
        # a hostile __float__ is refused like any non-number, whatever it raises
        number, exc = call_user(float, value)
    if exc is not None or type(number) is not float:
        return None, f"{field}: not a number: {refused(value)}"
    if math.isnan(number) or math.isinf(number):
        return None, f"{field}: not finite: {number!r}"
    return number, None


def to_int(value: Any, field: str) -> tuple[int | None, str | None]:
    """Coerce an index/step-like value to int; refuse floats with a fraction and non-numbers."""
    if type(value) is int:  # the common case, first
        return value, None
    value = scalar(value)
    if isinstance(value, bool):
        return int(value), None
    if type(value) is int:
        return value, None
    if isinstance(value, int):  # an int subclass: its own __int__ is user code
        number, exc = call_user(int.__index__, value)
        if exc is None:
            return number, None
    if type(value) is float and value.is_integer():
        return int(value), None
    if type(value) is str:
        try:
            return int(value), None
        except ValueError:
            pass
    return None, f"{field}: not an integer: {refused(value)}"
