"""Turning arbitrary user values into recordable ones.

Two jobs, kept apart on purpose:

* at record time (the training thread) values are only *snapshotted*: containers are copied so
  that later mutation by the environment cannot change what was recorded, numbers are coerced;
  nothing is serialised, because most episodes are dropped by the sampler;
* at materialisation (only for kept episodes, off the training thread) snapshots are rendered
  to JSON text and long text is cut keeping its head *and* its tail.

User values are hostile: a container may refer to itself or share children many times over, and
``__repr__``, ``__str__``, ``__float__``, ``items()`` may raise anything, ``SystemExit``
included. So both walks remember what they already visited (a cycle becomes ``"<cycle>"``, a
shared child is copied once) and stop at a node budget, keeping the head and the tail of what
is too long; and every call into user code goes through one guarded conversion that turns any
exception into a placeholder naming the type. The one exception let through is a
``KeyboardInterrupt`` on the main thread: that is Ctrl-C, and it must still stop the program.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

_MAX_DEPTH = 64
DEFAULT_MAX_NODES = 16_384  # containers and items copied or rendered per value (the attribute budget)
CYCLE = "<cycle>"
MAX_DEPTH = "<max depth>"
_ATOMS = (str, int, float, bool)
_MAIN_THREAD = threading.main_thread()


class Deferred:
    """A value computed only if its episode is kept (e.g. decoding token ids into text).

    ``fn`` runs on the export thread; its result is rendered like any other content.
    """

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def resolve(self) -> object:
        return self.fn()


class Entry(Deferred):
    """One key of a mapping that ``source()`` computes once for several attributes (e.g. a
    decoded episode body, a generation's worst tokens): resolved only if the episode is kept."""

    __slots__ = ("key",)

    def __init__(self, source: Callable[[], Mapping[str, object]], key: str) -> None:
        super().__init__(source)
        self.key = key

    def resolve(self) -> object:
        return self.fn()[self.key]


# --- the one guarded way into user code ---------------------------------------------------------
def reraise_interrupt(exc: BaseException) -> None:
    """Re-raise ``exc`` if it is Ctrl-C on the main thread; anything else is the caller's to contain."""
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is _MAIN_THREAD:
        raise exc


def type_name(value: object) -> str:
    """The qualified name of ``value``'s type, whatever its metaclass does."""
    try:
        name = type(value).__qualname__
        return name if type(name) is str else "object"
    except BaseException as exc:  # noqa: BLE001 - a hostile metaclass is still only a value
        reraise_interrupt(exc)
        return "object"


def call_user(fn: Callable[..., object], *args: object) -> tuple[Any, BaseException | None]:
    """``fn(*args)`` with any exception returned instead of raised (Ctrl-C on main excepted)."""
    try:
        return fn(*args), None
    except BaseException as exc:  # noqa: BLE001 - containment is the point
        reraise_interrupt(exc)
        return None, exc


def text(value: object, how: Callable[[object], str] = str) -> str:
    """``str(value)`` (or ``how(value)``, e.g. ``repr``) that never raises.

    A failing conversion gives ``<TypeName: str raised ExceptionType>``.
    """
    if type(value) is str and how is str:
        return value
    result, exc = call_user(how, value)
    if exc is None and isinstance(result, str):
        return result
    failure = type_name(exc) if exc is not None else f"returned {type_name(result)}"
    return f"<{type_name(value)}: {getattr(how, '__name__', 'conversion')} raised {failure}>"


def short_repr(value: object, limit: int = 80) -> str:
    """A guarded ``repr`` cut to ``limit`` characters."""
    out = text(value, repr)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def exception_text(exc: BaseException) -> str:
    """``"Type: message"`` of an exception, whatever its ``__str__`` does."""
    message = text(exc)
    name = type_name(exc)
    return f"{name}: {message}" if message else name


def _ends(n: int, room: int) -> tuple[int, int]:
    """How many items to keep from the head and the tail of ``n`` when only ``room`` fit."""
    room = max(room, 2)
    head = (room + 1) // 2
    return head, room - head


def _cut_marker(removed: int) -> str:
    return f"<{removed} items cut>"


# --- record time: snapshots ------------------------------------------------------------------
def snapshot(value: object, max_nodes: int = DEFAULT_MAX_NODES) -> Any:
    """Copy containers (not their immutable leaves) so later mutation cannot leak in.

    Dicts, other mappings, lists, tuples and sets are copied; every container once, however
    often it is referred to (a shared child is copied once and shared in the copy; a container
    that contains itself becomes ``"<cycle>"``). At most ``max_nodes`` items are copied in all:
    a longer container keeps its head and its tail around a ``"<N items cut>"`` marker. Other
    objects are kept as they are and rendered (guarded) only if their episode is kept.
    """
    if value is None or type(value) in _ATOMS:
        return value
    copied = _shallow(value, max_nodes)  # the common case: a message, a list of messages
    if copied is not None:
        return copied
    return _Snapshot(max_nodes).copy(value, 0)


def flat_dict(value: dict) -> dict | None:
    """A copy of a plain dict whose values are all atoms (None when it has containers): the
    common message, copied in one C call."""
    atoms = _ATOMS
    for item in value.values():
        if item is not None and type(item) not in atoms:
            return None
    return value.copy()


def _shallow(value: object, max_nodes: int) -> Any:
    """A fast copy of the shapes calls pass most (a plain dict or list of atoms, of plain dicts
    of atoms, or of plain lists of those: a message, a message list, a tool call's bound
    arguments); None for anything else, which the full walk handles (deeper, cyclic,
    subclasses, huge). A child referred to twice is copied once and shared, as in the walk."""
    kind = type(value)
    if kind is dict:  # exactly a dict (no subclass)
        if len(value) > max_nodes:  # type: ignore[arg-type]
            return None
        flat = flat_dict(value)  # type: ignore[arg-type]
        return flat if flat is not None else _Shallow(max_nodes).nested(value)  # type: ignore[arg-type]
    if kind is not list:
        return None
    return _Shallow(max_nodes).flat_list(value)  # type: ignore[arg-type]


class _Shallow:
    """One fast copy: the children copied so far (by id: a shared child is copied once) and the
    items left in the node budget."""

    __slots__ = ("memo", "left")

    def __init__(self, max_nodes: int) -> None:
        self.memo: dict[int, Any] = {}
        self.left = max_nodes

    def child(self, item: dict[object, object]) -> dict[object, object] | None:
        done = self.memo.get(id(item))
        if done is not None:
            return done
        self.left -= len(item)
        copied = flat_dict(item) if self.left >= 0 else None
        if copied is not None:
            self.memo[id(item)] = copied
        return copied

    def flat_list(self, items: list[object]) -> list[object] | None:
        """A plain list of atoms and flat dicts."""
        done = self.memo.get(id(items))
        if done is not None:
            return done  # type: ignore[no-any-return]
        self.left -= len(items)
        if self.left < 0:
            return None
        out: list[object] = []
        atoms = _ATOMS
        for item in items:
            if item is None or type(item) in atoms:
                out.append(item)
            elif type(item) is dict:
                copied = self.child(item)
                if copied is None:
                    return None
                out.append(copied)
            else:
                return None
        self.memo[id(items)] = out
        return out

    def nested(self, value: dict[object, object]) -> dict[object, object] | None:
        """A plain dict of atoms, flat dicts and flat lists."""
        self.left -= len(value)
        out: dict[object, object] = {}
        atoms = _ATOMS
        for key, item in value.items():
            kind = type(item)
            if item is None or kind in atoms:
                out[key] = item
                continue
            if kind is dict:
                copied: object = self.child(item)  # type: ignore[arg-type]
            elif kind is list:
                copied = self.flat_list(item)  # type: ignore[arg-type]
            else:
                return None
            if copied is None:
                return None
            out[key] = copied
        return out


class _Snapshot:
    __slots__ = ("memo", "active", "left")

    def __init__(self, max_nodes: int) -> None:
        self.memo: dict[int, object] = {}
        self.active: set[int] = set()
        self.left = max_nodes

    def copy(self, value: object, depth: int) -> Any:
        if value is None or type(value) in _ATOMS:
            return value
        if isinstance(value, (dict, list, tuple, Mapping, set, frozenset)):
            key = id(value)
            done = self.memo.get(key)
            if done is not None:
                return done
            if key in self.active:
                return CYCLE
            if depth >= _MAX_DEPTH:
                return MAX_DEPTH
            self.active.add(key)
            try:
                out = self._container(value, depth)
            finally:
                self.active.discard(key)
            self.memo[key] = out
            return out
        return value

    def _container(self, value: object, depth: int) -> Any:
        if isinstance(value, dict):
            items = list(dict.items(value))  # the stored items: a subclass's items() is not called
        elif isinstance(value, Mapping):
            items, exc = call_user(lambda m: list(m.items()), value)
            if exc is not None:
                return f"<{type_name(value)}: items() raised {type_name(exc)}>"
        elif isinstance(value, (list, tuple)):
            # the stored items (a subclass's __iter__ is not called); only the head and the
            # tail are taken from a container longer than the budget
            base: Any = list if isinstance(value, list) else tuple  # its own methods, not a subclass's
            get, size = base.__getitem__, base.__len__
            n = size(value)
            if n > self.left:
                head, tail = _ends(n, self.left)
                seq = [*get(value, slice(0, head)), _cut_marker(n - head - tail), *get(value, slice(n - tail, n))]
            else:
                seq = list(get(value, slice(None)))
            self.left -= len(seq)
            return self._items(seq, depth + 1)
        else:  # set, frozenset
            seq, exc = call_user(list, value)
            if exc is not None:
                return f"<{type_name(value)}: iteration raised {type_name(exc)}>"
            return self._sequence(seq, depth)
        n = len(items)
        if n > self.left:
            head, tail = _ends(n, self.left)
            items = items[:head] + [("<cut>", _cut_marker(n - head - tail))] + items[n - tail:]
        self.left -= len(items)
        keys = [k for k, _ in items]
        return dict(zip(keys, self._items([v for _, v in items], depth + 1), strict=True))

    def _sequence(self, seq: list[object], depth: int) -> list[object]:
        n = len(seq)
        if n > self.left:
            head, tail = _ends(n, self.left)
            seq = seq[:head] + [_cut_marker(n - head - tail)] + seq[n - tail:]
        self.left -= len(seq)
        return self._items(seq, depth + 1)

    def _items(self, values: list[object], depth: int) -> list[object]:
        copy, atoms = self.copy, _ATOMS
        return [v if v is None or type(v) in atoms else copy(v, depth) for v in values]


def scalar(value: object) -> object:
    """Unwrap numpy / torch scalars (and 0-d or 1-element arrays) into Python numbers."""
    if value is None or type(value) in _ATOMS:
        return value
    try:
        item = getattr(value, "item", None)
        if item is not None and callable(item):
            numel = getattr(value, "numel", None)  # torch
            size = numel() if callable(numel) else getattr(value, "size", 1)  # numpy
            if size == 1:
                return item()
    except BaseException as exc:  # noqa: BLE001 - anything odd stays as it was
        reraise_interrupt(exc)
    return value


# --- materialisation: JSON ------------------------------------------------------------------------
def jsonable(value: object, max_nodes: int = 4 * DEFAULT_MAX_NODES) -> Any:
    """A JSON-safe copy of ``value``: cycles, shared children, depth, bytes, numpy, dataclasses.

    At most ``max_nodes`` items are rendered (a structure that shares children renders each
    path, so this bound is what keeps a small hostile graph from expanding exponentially); a
    container past it keeps its head and tail. Any user code that fails leaves a placeholder.
    """
    if value is None or type(value) in (str, bool, int):
        return value
    return _Render(max_nodes).render(value, 0)


class _Render:
    __slots__ = ("active", "left")

    def __init__(self, max_nodes: int) -> None:
        self.active: set[int] = set()
        self.left = max_nodes

    def render(self, value: object, depth: int) -> Any:
        try:
            return self._render(value, depth)
        except BaseException as exc:  # noqa: BLE001 - a hostile value renders as a placeholder
            reraise_interrupt(exc)
            return f"<{type_name(value)}: not renderable ({type_name(exc)})>"

    def _render(self, value: object, depth: int) -> Any:
        if value is None or type(value) in (str, bool, int):
            return value
        if type(value) is float:
            return value if math.isfinite(value) else repr(value)
        if isinstance(value, Deferred):
            resolved, exc = call_user(value.resolve)
            if exc is not None:
                return f"<deferred value failed: {exception_text(exc)}>"
            return self.render(resolved, depth)
        if isinstance(value, str):  # subclasses: their stored value, no user __str__
            return str.__str__(value)
        if isinstance(value, int):
            return int.__int__(value)
        if isinstance(value, float):
            return self._render(float.__float__(value), depth)
        if depth >= _MAX_DEPTH:
            return MAX_DEPTH
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return "base64:" + base64.b64encode(raw[:65536]).decode("ascii")
        unwrapped = scalar(value)
        if unwrapped is not value:
            return self.render(unwrapped, depth)
        marker = id(value)
        if marker in self.active:
            return CYCLE
        self.active.add(marker)
        try:
            return self._composite(value, depth)
        finally:
            self.active.discard(marker)

    def _composite(self, value: object, depth: int) -> Any:
        nxt = depth + 1
        if isinstance(value, Mapping):
            items = list(dict.items(value)) if isinstance(value, dict) else list(value.items())
            n = len(items)
            if n > self.left:
                head, tail = _ends(n, self.left)
                items = items[:head] + [("<cut>", _cut_marker(n - head - tail))] + items[n - tail:]
            self.left -= len(items)
            return {
                (k if type(k) is str else text(k)): self.render(v, nxt) for k, v in items
            }
        if isinstance(value, (list, tuple, set, frozenset)):
            seq = list.copy(value) if isinstance(value, list) else list(value)
            n = len(seq)
            if n > self.left:
                head, tail = _ends(n, self.left)
                seq = seq[:head] + [_cut_marker(n - head - tail)] + seq[n - tail:]
            self.left -= len(seq)
            return [self.render(v, nxt) for v in seq]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
            return self.render(fields, nxt)
        tolist = getattr(value, "tolist", None)
        if callable(tolist):
            listed, exc = call_user(tolist)
            if exc is None:
                return self.render(listed, nxt)
        return short_repr(value, 1000)


def to_json(value: object, max_nodes: int = 4 * DEFAULT_MAX_NODES) -> str:
    """JSON text of ``value`` (strings, and deferred values that resolve to one, stay as they are)."""
    if isinstance(value, Deferred):
        value = jsonable(value, max_nodes)
    if type(value) is str:
        return value
    return json.dumps(jsonable(value, max_nodes), ensure_ascii=False, separators=(",", ":"))


_CHARS_CUT = "…["
_CHARS_CUT_END = " chars cut]…"
_MARKER_DIGITS = 19  # the most digits a count of characters takes


def text_cut_marker(removed: int) -> str:
    """What stands for ``removed`` characters cut out of the middle of a text."""
    return f"{_CHARS_CUT}{removed}{_CHARS_CUT_END}"


def removed_chars(text: str, start: int, end: int) -> int:
    """How many characters ``text[start:end]`` stands for: its length, where a cut marker inside
    it (a text cut earlier, see ``precut``) counts for what that cut removed, not for itself."""
    removed = end - start
    at = text.find(_CHARS_CUT, start, end)
    while at >= 0:
        close = text.find(_CHARS_CUT_END, at + 2, min(at + 2 + _MARKER_DIGITS + len(_CHARS_CUT_END), end))
        digits = text[at + 2:close] if close >= 0 else ""
        if digits.isdigit() and digits.isascii():
            marker = close + len(_CHARS_CUT_END) - at
            if int(digits) > marker:  # a real cut (ours remove more than their marker's length)
                removed += int(digits) - marker
            at = text.find(_CHARS_CUT, close, end)
        else:
            at = text.find(_CHARS_CUT, at + 1, end)
    return removed


def cut(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut ``text`` to about ``max_chars`` keeping head and tail; return (text, was_cut).

    The marker counts the characters cut out, those of a text cut earlier by ``precut`` (or
    ``Redactor.bounded``) included.
    """
    if max_chars <= 0 or len(text) <= max_chars:
        return text, False
    keep = max(max_chars - 40, 2)
    head = keep // 2
    tail = keep - head
    removed = removed_chars(text, head, len(text) - tail)
    return f"{text[:head]}{text_cut_marker(removed)}{text[len(text) - tail:]}", True


def precut(text: str, keep: int) -> str:
    """``text`` with its middle cut out when it is longer than a later ``cut`` can show.

    ``keep``: the most characters a later ``cut`` keeps of the head and of the tail. The head
    and tail kept here are that long, so ``cut(precut(text, keep), n)`` (and the cut of a JSON
    text holding it) is ``cut(text, n)`` for every ``n <= 2 * keep - 2``, at the cost of
    ``keep``, not of the length of ``text``: what is encoded, redacted and copied afterwards
    is bounded by the limits, not by the input.
    """
    n = len(text)
    if keep <= 0 or n <= 2 * keep + _PRECUT_MIN:
        return text
    return f"{text[:keep]}{text_cut_marker(removed_chars(text, keep, n - keep))}{text[n - keep:]}"


_PRECUT_MIN = 64  # the fewest characters worth cutting out early
