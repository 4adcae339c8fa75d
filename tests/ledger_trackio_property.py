"""The ledger property against Trackio's real SQLite storage, with the faults a disk and another
process produce: the database locked by another process, the filesystem full. Each for one step,
or for the rest of the run (past shutdown).

Run as its own process by ``test_ledger.py``: Trackio reads ``TRACKIO_DIR`` when it is imported,
so ``TRACKIO_DIR`` must already be the small filesystem (a tmpfs) this script fills to make the
disk full. Prints ``examples: N`` and exits 0 when every example held; raises otherwise.

    TRACKIO_DIR=/mnt/small python tests/ledger_trackio_property.py EXAMPLES
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import uuid
from collections import Counter
from pathlib import Path

from disk_faults import LockHolder, fill
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter

TRACKIO_DIR = Path(os.environ["TRACKIO_DIR"])
FAULTS = ["ok", "ok", "lock", "full", "lock_forever", "full_forever"]
examples = 0


class Fault:
    """One fault, on until ``off()``: another process holding an exclusive lock on the project's
    database, or a file filling what the filesystem has left."""

    def __init__(self, kind: str, db: Path) -> None:
        self.holder = LockHolder(db) if kind.startswith("lock") else None
        self.filler = fill(TRACKIO_DIR, f"filler-{uuid.uuid4().hex[:8]}") if kind.startswith("full") else None

    def off(self) -> None:
        if self.holder is not None:
            self.holder.release()
        if self.filler is not None:
            self.filler.unlink(missing_ok=True)


def stored(db: Path) -> Counter:
    """Trace ids (hex) Trackio stored, with how many times each."""
    if not db.exists():
        return Counter()
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT metadata FROM traces").fetchall()
    except sqlite3.OperationalError:
        return Counter()
    finally:
        conn.close()
    return Counter(json.loads(r[0])["trace_id"] for r in rows)


@settings(max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 6, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=3), cap=st.integers(1, 3))
def ledger_balances_with_trackio(faults: list[str], cap: int) -> None:
    global examples
    examples += 1
    project = f"prop-{uuid.uuid4().hex[:10]}"
    db = TRACKIO_DIR / f"{project}.db"
    memory = InMemorySpanExporter()
    forever: list[Fault] = []
    try:
        otr.configure(exporters=[TrackioExporter(project, run="r", table=False), memory],
                      sampler=otr.TailSampler(cap, "top_bottom"), handle_signals=False, exit_timeout=3.0)
        for step, kind in enumerate(faults):
            # a lock while a forever-fault holds: a forever-lock is that same lock (a second holder
            # would wait on it), a full disk forever leaves no room for another lock's journal
            held = kind.startswith("lock") and bool(forever)
            fault = Fault(kind, db) if kind != "ok" and not held else None
            for i in range(3):
                with otr.episode(step=step, sample_index=i) as ep:
                    ep.prompt("question")
                    ep.reward(float(i))
            otr.end_step(step)
            otr.flush(timeout=2.0)
            if fault is not None:
                if kind.endswith("_forever"):
                    forever.append(fault)
                else:
                    fault.off()
        otr.shutdown(timeout=3.0)
    finally:
        for fault in forever:
            fault.off()
        otr.shutdown(timeout=1.0)
    stats = otr.stats()
    for name in ("TrackioExporter", "InMemorySpanExporter"):
        for step, counts in stats["steps"].items():
            entered = counts.get(f"ledger.entered.{name}", 0)
            delivered = counts.get(f"delivered.{name}", 0)
            dropped = sum(v for k, v in counts.items() if k.startswith("lost.") and k.endswith("." + name))
            assert counts.get("kept", 0) == entered == delivered + dropped, (faults, name, step, counts)
        assert stats["delivery"][name]["pending"] == 0, (faults, name)
    in_trackio = stored(db)
    delivered = stats["totals"].get("delivered.TrackioExporter", 0)
    assert len(in_trackio) >= delivered, (faults, in_trackio, stats["totals"])  # counted => stored
    assert max(in_trackio.values(), default=1) == 1, (faults, in_trackio)  # never stored twice
    if all(f == "ok" for f in faults):
        assert delivered == len(faults) * min(cap, 3), (faults, stats["totals"])


if __name__ == "__main__":
    ledger_balances_with_trackio()
    print(f"examples: {examples}", flush=True)
