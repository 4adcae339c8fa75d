"""The gateway's byte store (``correlate.gateway_store``): its bound is true in memory, and what
it lets go leaves nothing behind."""

from __future__ import annotations

import gc
import tracemalloc

from gateway_flooder import _request
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_rollouts.correlate.gateway_store import FULL_SPANS, Store

BOUND = 4 * 1024 * 1024


def test_what_the_store_holds_costs_what_it_counts_and_is_freed_when_let_go() -> None:
    requests = [ExportTraceServiceRequest.FromString(_request(n)) for n in range(1, 400)]  # ~6.6 MB of spans
    store = Store(max_held_bytes=BOUND, hold_s=30)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        refused = sum(store.add_spans(r, now=0.0).counts.get(FULL_SPANS, 0) for r in requests)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        counted = store.held_bytes
        store.expire(now=31.0)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert refused > 0 and BOUND - 4096 < counted <= BOUND  # it filled up to the bound, no further
    assert held <= counted * 1.1, (held, counted)  # the count is what it costs, within 10%
    assert store.held_bytes == 0 and store.stats() == {"held_bytes": 0, "traces": 0, "origins": 0}
    # strangers' traces let go: nothing remembered of them; what stays is the dicts' tables at
    # their peak size (bounded, like the traces held, by the bound)
    assert after < counted * 0.15, (after, counted)
