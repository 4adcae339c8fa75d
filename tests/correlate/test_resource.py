"""One resource per run: the same attributes on traces, metrics and logs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.correlate.resource import run_resource


def _clean_env(monkeypatch) -> None:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)


def test_identity_of_the_process_and_the_run(monkeypatch):
    _clean_env(monkeypatch)
    attrs = run_resource("grpo", {"team": "rl"}, "run42").attributes
    assert attrs[c.SERVICE_NAME] == "grpo"
    assert attrs[c.RL_RUN_ID] == "run42"
    assert attrs["team"] == "rl"
    assert attrs["host.name"] == socket.gethostname()
    assert attrs["process.pid"] == os.getpid()
    assert attrs[c.SERVICE_INSTANCE_ID] == f"{socket.gethostname()}-{os.getpid()}"
    assert c.RL_RANK not in attrs and c.RL_WORLD_SIZE not in attrs


def test_rank_and_world_size_from_the_launcher_env(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    attrs = run_resource(run_id="r").attributes
    assert (attrs[c.RL_RANK], attrs[c.RL_LOCAL_RANK], attrs[c.RL_WORLD_SIZE]) == (3, 1, 8)


def test_rank_from_an_initialised_torch_distributed_group(tmp_path):
    # torch.distributed wins over the env; a fresh interpreter so no process group lingers here
    code = textwrap.dedent(f"""
        import os, json
        os.environ.update(RANK="5", WORLD_SIZE="9")
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from otel_rollouts.correlate.resource import run_resource
        a = run_resource(run_id="r").attributes
        print(json.dumps([a["rl.rank"], a["rl.world_size"]]))
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 1]"


def test_service_name_defaults_and_env(monkeypatch):
    _clean_env(monkeypatch)
    assert run_resource().attributes[c.SERVICE_NAME] == "otel-rollouts"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert run_resource().attributes[c.SERVICE_NAME] == "from-env"
    assert run_resource("explicit").attributes[c.SERVICE_NAME] == "explicit"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=attrs,team=a,rl.run.id=env")
    attrs = run_resource(None, {"team": "b"}, "mine").attributes
    assert attrs[c.SERVICE_NAME] == "attrs"  # OTEL_RESOURCE_ATTRIBUTES is honoured
    assert attrs["team"] == "b" and attrs[c.RL_RUN_ID] == "mine"  # explicit values win


def test_traces_metrics_and_logs_carry_the_identical_resource(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    spans, reader, logs = InMemorySpanExporter(), InMemoryMetricReader(), InMemoryLogRecordExporter()
    otr.configure(service_name="grpo", exporters=[spans], sampler=otr.TailSampler(4, "first"),
                  metric_readers=[reader], run_id="run-7", handle_signals=False)
    try:
        integration = otr.instrument_logging("otr-test-resource", exporter=logs)
        import logging

        with otr.episode(step=0) as ep:
            logging.getLogger("otr-test-resource").warning("hello")
            ep.reward(1.0)
        otr.end_step(0)
        assert otr.flush()
        assert integration.flush()
        trace_resource = spans.get_finished_spans()[0].resource.attributes
        metric_resource = reader.get_metrics_data().resource_metrics[0].resource.attributes
        log_resource = logs.get_finished_logs()[0].resource.attributes
    finally:
        otr.uninstrument_logging()
        otr.shutdown()
    assert trace_resource == metric_resource == log_resource
    assert trace_resource[c.RL_RUN_ID] == "run-7"
    assert trace_resource[c.SERVICE_NAME] == "grpo"
    assert (trace_resource[c.RL_RANK], trace_resource[c.RL_WORLD_SIZE]) == (2, 4)


def test_every_process_of_a_run_shares_the_run_id_from_the_environment(monkeypatch) -> None:
    """``rl.run.id`` is the join key across processes: the launcher's OTEL_ROLLOUTS_RUN_ID gives
    every process the same one (each would draw its own otherwise); an argument still wins."""
    monkeypatch.setenv(c.ENV_RUN_ID, "grpo-run-7")
    spans = InMemorySpanExporter()
    otr.configure(exporters=[spans], handle_signals=False)
    try:
        with otr.episode(step=0) as ep:
            ep.reward(1.0)
        otr.flush()
        assert {s.resource.attributes[c.RL_RUN_ID] for s in spans.get_finished_spans()} == {"grpo-run-7"}
        child = subprocess.run(
            [sys.executable, "-c", "import otel_rollouts as otr; print(otr.configure(exporters=[]).run_id)"],
            env={**os.environ}, capture_output=True, text=True, timeout=120, check=True)
        assert child.stdout.strip().splitlines()[-1] == "grpo-run-7"
        assert otr.configure(exporters=[], run_id="explicit", handle_signals=False).run_id == "explicit"
    finally:
        otr.shutdown()
