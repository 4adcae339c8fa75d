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


def test_a_renderer_does_not_wait_for_a_gateway_that_died_before_it_connected(tmp_path) -> None:
    """A gateway killed before the renderer first reached it leaves its socket file and key
    behind; the socket refuses. The renderer asks, is refused, and renders at once (counted), as
    it would for a gateway lost later, instead of waiting the whole pull timeout per episode.
    One still starting (no socket yet) is waited for, up to the timeout."""
    import socket
    import time

    from otel_rollouts._core.stats import Stats
    from otel_rollouts.delivery.gateway_channel import Channel

    dead = str(tmp_path / "dead.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)  # bound, never listening, closed: what a SIGKILLed gateway leaves
    (tmp_path / "dead.sock.key").write_bytes(b"k" * 32)
    starting = str(tmp_path / "starting.sock")
    (tmp_path / "starting.sock.key").write_bytes(b"k" * 32)
    took = {}
    for name, address in (("dead", dead), ("starting", starting)):
        stats = Stats()
        channel = Channel(address, stats, role="renderer")
        begun = time.monotonic()
        assert channel.pull([1], timeout=1.5) == b""
        took[name] = time.monotonic() - begun
        assert stats.total("errors.gateway_pull") == 1
        channel.close(1)
    assert took["dead"] < 0.5 and took["starting"] >= 1.4, took
