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


def test_a_socket_directory_that_is_not_the_users_leaves_the_run_without_a_gateway(tmp_path, monkeypatch, caplog) -> None:
    """The gateway's Unix socket lives in a directory only its user can enter. One that is not
    a directory of this user's (a symlink planted by someone else) is refused: the run goes on
    without a gateway, with a warning and a count, and nothing is made there."""
    import os

    import otel_rollouts as otr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"otel-rollouts-{os.getuid()}").symlink_to(elsewhere)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    otr.configure(exporters=[], handle_signals=False, gateway=otr.GatewayOptions(http_port=0, grpc_port=0))
    try:
        assert otr.gateway() is None
        with otr.episode(step=0) as ep:
            ep.reward(1.0)
    finally:
        otr.shutdown()
    assert otr.stats()["totals"]["errors.gateway_start"] == 1
    assert "is not a directory of this user's" in caplog.text
    assert list(elsewhere.iterdir()) == []
