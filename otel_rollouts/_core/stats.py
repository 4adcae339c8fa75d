"""Counters: every episode seen, kept and dropped, and every loss, by reason."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

Pending = Callable[[], "list[tuple[tuple[int, str], str, int]]"]

_MAX_STEPS_KEPT = 4096  # per-step counters of the most recent steps
_FOLD_AT = 256  # step events waiting to be added up (bounds their memory: a few tens of KB)


class Stats:
    """Thread-safe counters behind ``otr.stats()``.

    Per-step events (every episode started, seen, kept, dropped) are the hot ones: they are
    appended to a deque (atomic, no lock) and added up when read, or by the thread that finds
    ``_FOLD_AT`` of them waiting, so recording an episode takes no lock here.

    The hottest counts (episodes offered one by one, and dropped at once) are not even events:
    the sampling pipeline keeps them as ints on its open steps and adds them here when a step
    closes; ``pending`` (set by the pipeline) gives what its open steps hold, and every read adds
    it to what it reports, so a read before the step closes sees them as if counted here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: OrderedDict[tuple[int, str], Counter] = OrderedDict()
        self._totals: Counter = Counter()
        self._events: deque[tuple[tuple[int, str], str, int]] = deque()
        self.pending: Pending | None = None  # counts held elsewhere (the pipeline's open steps)

    def _pending(self) -> list[tuple[tuple[int, str], str, int]]:
        """The counts held elsewhere now (read before this lock is taken: the pipeline's lock
        is always taken before this one)."""
        pending = self.pending
        if pending is None:
            return []
        try:
            return pending()
        except Exception:  # noqa: BLE001 - a read of the counters never fails
            return []

    def step(self, key: tuple[int, str], name: str, n: int = 1) -> None:
        events = self._events
        events.append((key, name, n))
        if len(events) >= _FOLD_AT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Add up the waiting step events (under the lock)."""
        events, steps, totals = self._events, self._steps, self._totals
        while True:
            try:
                key, name, n = events.popleft()
            except IndexError:
                return
            counter = steps.get(key)
            if counter is None:
                counter = steps[key] = Counter()
                if len(steps) > _MAX_STEPS_KEPT:
                    steps.popitem(last=False)
            counter[name] += n
            totals[name] += n

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._totals[name] += n

    def snapshot(self) -> dict[str, Any]:
        pending = self._pending()
        with self._lock:
            self._fold()
            steps = {key: dict(counter) for key, counter in self._steps.items()}
            totals = dict(self._totals)
        for key, name, n in pending:
            counter = steps.setdefault(key, {})
            counter[name] = counter.get(name, 0) + n
            totals[name] = totals.get(name, 0) + n
        return {"totals": totals, "steps": {f"{step}/{split}": counter for (step, split), counter in steps.items()}}

    def total(self, name: str) -> int:
        pending = self._pending()
        with self._lock:
            self._fold()
            return self._totals.get(name, 0) + sum(n for _, what, n in pending if what == name)

    def for_step(self, step: int, split: str = "train") -> dict[str, int]:
        pending = self._pending()
        with self._lock:
            self._fold()
            out = dict(self._steps.get((step, split), {}))
        for key, name, n in pending:
            if key == (step, split):
                out[name] = out.get(name, 0) + n
        return out
