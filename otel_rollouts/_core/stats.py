"""Counters: every episode seen, kept and dropped, and every loss, by reason."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from typing import Any

_MAX_STEPS_KEPT = 4096  # per-step counters of the most recent steps
_FOLD_AT = 256  # step events waiting to be added up (bounds their memory: a few tens of KB)


class Stats:
    """Thread-safe counters behind ``otr.stats()``.

    Per-step events (every episode started, seen, kept, dropped) are the hot ones: they are
    appended to a deque (atomic, no lock) and added up when read, or by the thread that finds
    ``_FOLD_AT`` of them waiting, so recording an episode takes no lock here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: OrderedDict[tuple[int, str], Counter] = OrderedDict()
        self._totals: Counter = Counter()
        self._events: deque[tuple[tuple[int, str], str, int]] = deque()

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
        with self._lock:
            self._fold()
            steps = {
                f"{step}/{split}": dict(counter) for (step, split), counter in self._steps.items()
            }
            return {"totals": dict(self._totals), "steps": steps}

    def total(self, name: str) -> int:
        with self._lock:
            self._fold()
            return self._totals.get(name, 0)

    def for_step(self, step: int, split: str = "train") -> dict[str, int]:
        with self._lock:
            self._fold()
            return dict(self._steps.get((step, split), {}))
