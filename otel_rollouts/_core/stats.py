"""Counters: every episode seen, kept and dropped, and every loss, by reason."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any

_MAX_STEPS_KEPT = 4096  # per-step counters of the most recent steps


class Stats:
    """Thread-safe counters behind ``otr.stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: OrderedDict[tuple[int, str], Counter] = OrderedDict()
        self._totals: Counter = Counter()

    def step(self, key: tuple[int, str], name: str, n: int = 1) -> None:
        with self._lock:
            counter = self._steps.get(key)
            if counter is None:
                counter = self._steps[key] = Counter()
                if len(self._steps) > _MAX_STEPS_KEPT:
                    self._steps.popitem(last=False)
            counter[name] += n
            self._totals[name] += n

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._totals[name] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            steps = {
                f"{step}/{split}": dict(counter) for (step, split), counter in self._steps.items()
            }
            return {"totals": dict(self._totals), "steps": steps}

    def total(self, name: str) -> int:
        with self._lock:
            return self._totals.get(name, 0)

    def for_step(self, step: int, split: str = "train") -> dict[str, int]:
        with self._lock:
            return dict(self._steps.get((step, split), {}))
