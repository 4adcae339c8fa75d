"""The `phoenix` fixture is a real OTLP receiver: proven with the stock OpenTelemetry SDK alone.

Nothing from otel_rollouts is used here, so a failure points at the receiver harness, not at
the SDK under test.
"""

from __future__ import annotations

import uuid

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from receivers import PhoenixReceiver, free_ports


def _exporter(phoenix: PhoenixReceiver, protocol: str):
    if protocol == "http":
        return HttpSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)
    return GrpcSpanExporter(endpoint=phoenix.grpc_endpoint, insecure=True, timeout=10)


def _send_episode(phoenix: PhoenixReceiver, protocol: str, project: str) -> dict[str, str]:
    """Export a 3-span tree (episode > turn > chat) and return its hex ids by span name."""
    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": "otr-receiver-test", "openinference.project.name": project}
        )
    )
    provider.add_span_processor(SimpleSpanProcessor(_exporter(phoenix, protocol)))
    tracer = provider.get_tracer("tests.receiver_fixture")
    ids: dict[str, str] = {}
    try:
        with tracer.start_as_current_span(
            "episode",
            attributes={
                "openinference.span.kind": "AGENT",
                "rl.step": 3,
                "rl.reward.score": 0.5,
                "rl.split": "train",
            },
        ) as episode:
            with tracer.start_as_current_span(
                "turn", attributes={"openinference.span.kind": "CHAIN", "rl.turn.index": 0}
            ) as turn:
                with tracer.start_as_current_span(
                    "chat tiny-policy",
                    attributes={
                        "openinference.span.kind": "LLM",
                        "gen_ai.operation.name": "chat",
                        "gen_ai.request.model": "tiny-policy",
                    },
                ) as chat:
                    ids["chat"] = format(chat.get_span_context().span_id, "016x")
                ids["turn"] = format(turn.get_span_context().span_id, "016x")
            ids["episode"] = format(episode.get_span_context().span_id, "016x")
            ids["trace"] = format(episode.get_span_context().trace_id, "032x")
    finally:
        provider.shutdown()  # flushes; SimpleSpanProcessor has already exported each span
    return ids


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_phoenix_receives_a_span_tree(phoenix: PhoenixReceiver, protocol: str) -> None:
    project = f"fixture-{protocol}-{uuid.uuid4().hex[:8]}"
    ids = _send_episode(phoenix, protocol, project)

    spans = phoenix.wait_for_spans(project, 3, trace_ids=[ids["trace"]], timeout=60)
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == ["chat tiny-policy", "episode", "turn"]
    assert {s["context"]["trace_id"] for s in spans} == {ids["trace"]}

    episode, turn, chat = by_name["episode"], by_name["turn"], by_name["chat tiny-policy"]
    assert episode["context"]["span_id"] == ids["episode"]
    assert episode["parent_id"] is None
    assert turn["parent_id"] == ids["episode"]
    assert chat["parent_id"] == ids["turn"]

    # openinference.span.kind becomes Phoenix's span_kind column.
    assert (episode["span_kind"], turn["span_kind"], chat["span_kind"]) == ("AGENT", "CHAIN", "LLM")
    assert "openinference.span.kind" not in episode["attributes"]

    # Numbers stay numbers end to end.
    assert episode["attributes"]["rl.reward.score"] == 0.5
    assert isinstance(episode["attributes"]["rl.reward.score"], float)
    assert episode["attributes"]["rl.step"] == 3
    assert isinstance(episode["attributes"]["rl.step"], int)
    assert chat["attributes"]["gen_ai.request.model"] == "tiny-policy"

    # The project selector worked, and another project does not see these spans.
    assert project in phoenix.projects()
    assert phoenix.spans(f"{project}-other") == []


def test_spans_filter_by_trace_id(phoenix: PhoenixReceiver) -> None:
    project = f"fixture-filter-{uuid.uuid4().hex[:8]}"
    first = _send_episode(phoenix, "http", project)
    second = _send_episode(phoenix, "http", project)
    both = phoenix.wait_for_spans(project, 6, trace_ids=[first["trace"], second["trace"]])
    assert len(both) == 6
    only_first = phoenix.spans(project, trace_id=first["trace"])
    assert {s["context"]["trace_id"] for s in only_first} == {first["trace"]}
    assert len(only_first) == 3


def test_wait_for_spans_times_out_with_a_clear_error(phoenix: PhoenixReceiver) -> None:
    with pytest.raises(Exception, match="expected >= 1 spans"):
        phoenix.wait_for_spans(f"never-{uuid.uuid4().hex[:8]}", 1, timeout=0.5)


def test_free_ports_are_distinct() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4
    assert all(0 < p < 65536 for p in ports)


@pytest.mark.slow
def test_restart_keeps_ports_and_data(phoenix: PhoenixReceiver) -> None:
    """restart() is for outage tests: same endpoints before and after, data kept on disk."""
    project = f"fixture-restart-{uuid.uuid4().hex[:8]}"
    before = _send_episode(phoenix, "grpc", project)
    phoenix.wait_for_spans(project, 3, trace_ids=[before["trace"]])
    endpoints = (phoenix.http_endpoint, phoenix.grpc_endpoint)
    old_pid = phoenix.pid

    phoenix.restart()

    assert phoenix.is_running() and phoenix.pid != old_pid
    assert (phoenix.http_endpoint, phoenix.grpc_endpoint) == endpoints
    after = _send_episode(phoenix, "http", project)
    spans = phoenix.wait_for_spans(project, 6, trace_ids=[before["trace"], after["trace"]])
    assert {s["context"]["trace_id"] for s in spans} == {before["trace"], after["trace"]}


def test_phoenix_listens_on_loopback_only(phoenix: PhoenixReceiver) -> None:
    """Its UI/OTLP-HTTP port and its OTLP/gRPC port, which Phoenix itself binds to all interfaces."""
    import ipaddress

    import psutil

    server = psutil.Process(phoenix.pid)
    pids = {server.pid} | {p.pid for p in server.children(recursive=True)}
    listening = [conn for conn in psutil.net_connections(kind="inet")
                 if conn.status == psutil.CONN_LISTEN and conn.pid in pids]
    assert {conn.laddr.port for conn in listening} >= {phoenix.port, phoenix.grpc_port}, listening
    for conn in listening:
        address = ipaddress.ip_address(conn.laddr.ip)
        address = getattr(address, "ipv4_mapped", None) or address
        assert address.is_loopback, conn
