"""User values coerced to the numbers the span model needs, or refused with a reason that names
the field and describes the value as far as the run's content rule allows."""

from __future__ import annotations

import math

from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import call_user, scalar, short_repr, type_name

__all__ = ["INT64_MAX", "INT64_MIN", "fits_int64", "refused", "storable_number", "to_float", "to_int"]

# Backends store integers as signed 64-bit (OTLP's int_value, SQLite's INTEGER, Trackio's orjson):
# a Python int beyond these bounds cannot be stored as an integer anywhere downstream
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def fits_int64(value: int) -> bool:
    """Whether an int is a signed 64-bit integer (what every backend can store as one)."""
    return INT64_MIN <= value <= INT64_MAX


def refused(value: object) -> str:
    """How a refused value is described in ``rl.invalid`` and the library's warning: its type and
    a short ``repr``, or its type alone when content capture is off (the value may be content)."""
    rt = _runtime.active()
    if rt is not None and not rt.capture_content:
        return type_name(value)
    return f"{type_name(value)} {short_repr(value)}"


def to_float(value: object, field: str) -> tuple[float | None, str | None]:
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


def storable_number(value: int | float, field: str) -> tuple[int | float | str, str | None]:
    """A metadata number every backend can store: an int beyond signed 64 bits becomes the
    nearest float (its magnitude kept, its low digits not), with a reason naming ``field`` for
    ``rl.invalid``; any other number is returned as it is. Without this an exporter whose storage
    is 64-bit (Trackio, OTLP) would lose the value, or the whole episode with it."""
    if type(value) is bool or not isinstance(value, int) or fits_int64(value):
        return value, None
    try:
        number = float(value)
    except OverflowError:  # beyond a float too: exact as text (hex past Python's str() digit limit)
        try:
            text = str(value)
        except ValueError:
            text = hex(value)
        return text, f"{field}: beyond 64-bit integer range, stored as text: {refused(value)}"
    return number, f"{field}: beyond 64-bit integer range, stored as float: {refused(value)}"


def to_int(value: object, field: str) -> tuple[int | None, str | None]:
    """Coerce an index/step-like value to a signed 64-bit int; refuse floats with a fraction,
    non-numbers and integers beyond 64 bits (no backend stores them as integers: a step or index
    is a key, so it is refused with a reason rather than rounded)."""
    if type(value) is int and INT64_MIN <= value <= INT64_MAX:  # the common case, in place
        return value, None
    number, problem = _to_int(value, field)
    if number is not None and not fits_int64(number):
        return None, f"{field}: beyond 64-bit integer range: {refused(value)}"
    return number, problem


def _to_int(value: object, field: str) -> tuple[int | None, str | None]:
    """``to_int`` without the 64-bit bound."""
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
