"""Turning arbitrary user values into recordable ones.

Two jobs, kept apart on purpose:

* at record time (the training thread) values are only *snapshotted*: containers are copied so
  that later mutation by the environment cannot change what was recorded, numbers are coerced;
  nothing is serialised, because most episodes are dropped by the sampler;
* at materialisation (only for kept episodes, off the training thread) snapshots are rendered
  to JSON text and long text is cut keeping its head *and* its tail.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

_MAX_SNAPSHOT_DEPTH = 32
_MAX_RENDER_DEPTH = 64
_MAX_ITEMS = 10_000


class Deferred:
    """A value computed only if its episode is kept (e.g. decoding token ids into text).

    ``fn`` runs on the export thread; its result is rendered like any other content.
    """

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def resolve(self) -> Any:
        return self.fn()


def snapshot(value: Any, _depth: int = 0) -> Any:
    """Copy containers (not their immutable leaves) so later mutation cannot leak in."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if _depth >= _MAX_SNAPSHOT_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: snapshot(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [snapshot(v, _depth + 1) for v in value]
    return value


def scalar(value: Any) -> Any:
    """Unwrap numpy / torch scalars (and 0-d or 1-element arrays) into Python numbers."""
    item = getattr(value, "item", None)
    if item is not None and callable(item):
        try:
            numel = getattr(value, "numel", None)  # torch
            size = numel() if callable(numel) else getattr(value, "size", 1)  # numpy
            if size == 1:
                return item()
        except Exception:  # noqa: BLE001 - anything odd stays as it was
            return value
    return value


def to_float(value: Any, field: str) -> tuple[float | None, str | None]:
    """Coerce a reward-like value to float; return (number, None) or (None, reason).

    Accepts ints, floats, bools, numpy/torch scalars and numeric strings (legacy loggers
    formatted rewards as text). NaN and infinities are refused with a reason naming ``field``.
    """
    value = scalar(value)
    if isinstance(value, bool):
        return float(value), None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, (str, bytes)):
        try:
            number = float(value)
        except ValueError:
            return None, f"{field}: not a number: {_short_repr(value)}"
    else:
        try:
            number = float(value)
        except Exception:  # noqa: BLE001 - a hostile __float__ is refused like any non-number
            return None, f"{field}: not a number: {type(value).__name__} {_short_repr(value)}"
    if math.isnan(number) or math.isinf(number):
        return None, f"{field}: not finite: {number!r}"
    return number, None


def to_int(value: Any, field: str) -> tuple[int | None, str | None]:
    """Coerce an index/step-like value to int; refuse floats with a fraction and non-numbers."""
    value = scalar(value)
    if isinstance(value, bool):
        return int(value), None
    if isinstance(value, int):
        return value, None
    if isinstance(value, float) and value.is_integer():
        return int(value), None
    if isinstance(value, str):
        try:
            return int(value), None
        except ValueError:
            pass
    return None, f"{field}: not an integer: {type(value).__name__} {_short_repr(value)}"


def _short_repr(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def jsonable(value: Any, _depth: int = 0, _path: set[int] | None = None) -> Any:
    """A JSON-safe copy of ``value``: cycles, depth, bytes, numpy, dataclasses handled."""
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Deferred):
        try:
            value = value.resolve()
        except Exception as exc:  # noqa: BLE001 - a failing deferred value is recorded, not raised
            return f"<deferred value failed: {type(exc).__name__}: {exc}>"
        return jsonable(value, _depth, _path)
    if _depth >= _MAX_RENDER_DEPTH:
        return "<max depth>"
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(raw[:65536]).decode("ascii")
    unwrapped = scalar(value)
    if unwrapped is not value:
        return jsonable(unwrapped, _depth, _path)
    path = _path if _path is not None else set()
    marker = id(value)
    if marker in path:
        return "<cycle>"
    path.add(marker)
    try:
        if isinstance(value, Mapping):
            out = {}
            for i, (k, v) in enumerate(value.items()):
                if i >= _MAX_ITEMS:
                    out["<truncated>"] = f"{len(value) - i} more items"
                    break
                out[k if isinstance(k, str) else str(k)] = jsonable(v, _depth + 1, path)
            return out
        if isinstance(value, (list, tuple, set, frozenset)):
            seq = list(value)
            out_list = [jsonable(v, _depth + 1, path) for v in seq[:_MAX_ITEMS]]
            if len(seq) > _MAX_ITEMS:
                out_list.append(f"<{len(seq) - _MAX_ITEMS} more items>")
            return out_list
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
            return jsonable(fields, _depth + 1, path)
        tolist = getattr(value, "tolist", None)
        if callable(tolist):
            try:
                return jsonable(tolist(), _depth + 1, path)
            except Exception:  # noqa: BLE001
                pass
        return _short_repr(value, 1000)
    finally:
        path.discard(marker)


def to_json(value: Any) -> str:
    """JSON text of ``value`` (strings, and deferred values that resolve to one, stay as they are)."""
    if isinstance(value, Deferred):
        value = jsonable(value)
    if isinstance(value, str):
        return value
    return json.dumps(jsonable(value), ensure_ascii=False, separators=(",", ":"))


def cut(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut ``text`` to about ``max_chars`` keeping head and tail; return (text, was_cut)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text, False
    keep = max(max_chars - 40, 2)
    head = keep // 2
    tail = keep - head
    removed = len(text) - head - tail
    return f"{text[:head]}…[{removed} chars cut]…{text[len(text) - tail:]}", True
