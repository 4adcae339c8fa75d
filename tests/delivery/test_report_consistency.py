"""``otr.stats()["delivery"]`` read while an episode is being confirmed: the episode is counted
pending or delivered, never both (a benchmark once read "safe 130 of 128") and never neither.

Real parts: the OpenTelemetry SDK's ``InMemorySpanExporter`` behind the library's delivery
layers. The counters object is wrapped so the test can read the report at the exact moment the
ledger counts an episode delivered, from another thread, as a user's monitoring thread would.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts._core.stats import Stats

_WAIT_S = 2.0  # how long the counting thread lets a concurrent report run before going on


class _ReadWhileCounting(Stats):
    """Stats that, while counting an episode delivered, lets another thread read the report."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[dict[str, Any]] = []
        self.readers: list[threading.Thread] = []
        self.run: Any = None

    def step(self, key: tuple[int, str], name: str, n: int = 1) -> None:
        if name.startswith("delivered.") and self.run is not None and not self.readers:
            done = threading.Event()

            def read() -> None:
                self.read.append(self.run.delivery.report())
                done.set()

            reader = threading.Thread(target=read, daemon=True)
            self.readers.append(reader)
            reader.start()
            done.wait(_WAIT_S)  # a consistent report cannot finish before this count is in
        super().step(key, name, n)


def test_a_report_never_counts_an_episode_both_pending_and_delivered(otr_shutdown, monkeypatch):
    import otel_rollouts._rollouts as rollouts

    stats = _ReadWhileCounting()
    monkeypatch.setattr(rollouts, "Stats", lambda: stats)
    exporter = InMemorySpanExporter()
    run = otr.configure(exporters=[exporter], sampler=otr.TailSampler(max_traces_per_step=4), handle_signals=False)
    stats.run = run
    with otr.episode(step=0) as ep:
        ep.prompt([{"role": "user", "content": "q"}])
        ep.reward(1.0)
    otr.end_step(0)
    assert otr.flush(60)
    assert stats.readers, "the episode was never counted delivered"
    stats.readers[0].join(60)  # (a report blocked until the count was in finishes after it)
    assert stats.read, "the report was not read while the episode was counted"
    (name, seen), = stats.read[0].items()
    assert seen["pending"] + seen["delivered"] == 1, seen
    final = otr.stats()["delivery"][name]
    assert (final["pending"], final["delivered"]) == (0, 1)
