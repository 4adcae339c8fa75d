"""configure(render="process"): kept episodes rendered and exported by a renderer process.

Real parts: the real OTLP/JSON file exporter and the real renderer process (a fresh
interpreter); what the child stored is read back from the file in this process."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.spans import EpisodeRecord, SpanRecord
from otel_rollouts.delivery.dispatch import Delivery
from otel_rollouts.delivery.process import ProcessDelivery
from otel_rollouts.exporters import OtlpJsonFileExporter
from otel_rollouts.exporters.otlp_json import read_requests

SPANS = 6  # per episode: root, prompt, turn, generation, tool call, reward
PROMPT = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Add 2 and 3. My key is sk-abcdefghijklmnopqrstuvwx1234."}]


@pytest.fixture(autouse=True)
def _shutdown() -> Iterator[None]:
    yield
    otr.shutdown(timeout=10)


def _run(path: Path, render: str, **kwargs: Any) -> otr.Rollouts:
    return otr.configure(exporters=[OtlpJsonFileExporter(path)], render=render, run_id="render-process",
                         deterministic_ids=True, sampler=otr.TailSampler(1000, "top_bottom", step_lag=None),
                         **kwargs)


def _episodes(step: int, n: int) -> None:
    for i in range(n):
        with otr.episode(step=step, episode_id=f"e{i}", group_id=f"g{i // 4}", sample_index=i % 4) as ep:
            ep.prompt(PROMPT)
            with ep.turn() as turn:
                turn.record_generation(f"It is {5 + i}.", model="policy", output_tokens=4)
                with turn.tool_call("calc", arguments={"a": 2, "b": 3}) as call:
                    call.result("5")
            ep.reward(1.0 if i % 2 else 0.0)
    otr.end_step(step)


_ID = re.compile(r"\b[0-9a-f]{16}\b")  # span ids (tool call ids are made from them): random


_TIME = re.compile(r'(seconds":)[-0-9.e]+')  # durations measured as the episode ran


def _masked(text: str) -> str:
    return _TIME.sub(r"\1<t>", _ID.sub("<id>", text))


def _stored(path: Path) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every stored span: its name and its text attributes (times and durations differ, and
    span ids are random)."""
    out = []
    for request in read_requests(path):
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = tuple(sorted((a.key, _masked(a.value.string_value)) for a in span.attributes
                                         if a.value.WhichOneof("value") == "string_value"))
                    out.append((span.name, attrs))
    return sorted(out)


def _renderer(rt: otr.Rollouts) -> ProcessDelivery:
    assert isinstance(rt.delivery, ProcessDelivery)
    return rt.delivery


def test_same_spans_as_thread_mode_and_delivered(tmp_path: Path) -> None:
    thread_file, process_file = tmp_path / "thread.jsonl", tmp_path / "process.jsonl"
    rt = _run(thread_file, "thread")
    assert type(rt.delivery) is Delivery
    _episodes(0, 6)
    assert otr.flush(30)
    otr.shutdown(10)

    rt = _run(process_file, "process")
    delivery = _renderer(rt)
    _episodes(0, 6)
    assert otr.flush(30)  # returns once the child answered: the file is complete now
    stored = _stored(process_file)
    assert len(stored) == 6 * SPANS
    assert stored == _stored(thread_file)
    assert "sk-abcdefghijklmnopqrstuvwx1234" not in process_file.read_text()  # redacted in the child
    report = otr.stats()["delivery"]["OtlpJsonFileExporter"]
    assert report["delivered"] == 6 and report["pending"] == 0 and report["dropped"] == 0
    pid = delivery.renderer_pid
    assert pid is not None and pid != os.getpid()


def test_env_variable_selects_process_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_ROLLOUTS_RENDER", "process")
    rt = otr.configure(exporters=[OtlpJsonFileExporter(tmp_path / "x.jsonl")])
    assert isinstance(rt.delivery, ProcessDelivery)


DESCRIBED = {c.RL_SYSTEM_NAME: "verl", c.RL_SYSTEM_VERSION: "0.9.1", c.RL_ALGORITHM: "grpo",
             c.RL_MODEL_NAME: "Qwen/Qwen3-0.6B", c.RL_ENVIRONMENT_NAME: "gsm8k"}


def test_killed_renderer_counts_in_flight_and_restarts(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    rt = _run(path, "process")
    delivery = _renderer(rt)
    # the run's description (otr.describe_run) reaches the renderer, and the restarted one
    otr.describe_run(system="verl", system_version="0.9.1", algorithm="GRPO", model_name="Qwen/Qwen3-0.6B",
                     environment_name="gsm8k")
    _episodes(0, 2)
    assert otr.flush(30)
    renderer = delivery._renderer
    assert renderer is not None
    os.kill(renderer.process.pid, signal.SIGSTOP)  # it reads nothing more: the next step is in flight
    _episodes(1, 3)
    assert delivery.written(30)  # all three are in the pipe, none read
    os.kill(renderer.process.pid, signal.SIGKILL)
    assert renderer.dead.wait(30)
    totals = otr.stats()["totals"]
    assert totals["lost.renderer_died.OtlpJsonFileExporter"] == 3
    assert totals["render.process.died"] == 1
    _episodes(2, 4)  # the next items start a new renderer
    assert otr.flush(30)
    assert delivery.renderer_pid != renderer.process.pid
    report = otr.stats()["delivery"]["OtlpJsonFileExporter"]
    assert report["delivered"] == 2 + 4 and report["pending"] == 0
    assert otr.stats()["totals"]["render.process.restarts"] == 1
    assert len(_stored(path)) == (2 + 4) * SPANS
    resources = [{a.key: a.value.string_value for a in rs.resource.attributes}
                 for request in read_requests(path) for rs in request.resource_spans]
    assert len(resources) >= 2  # a request from each renderer
    for resource in resources:
        assert {k: resource.get(k) for k in DESCRIBED} == DESCRIBED


def test_shutdown_within_exit_timeout_and_child_gone(tmp_path: Path) -> None:
    rt = _run(tmp_path / "out.jsonl", "process", exit_timeout=5.0)
    delivery = _renderer(rt)
    _episodes(0, 3)
    assert otr.flush(60)  # the renderer is up (its start-up is not what is timed here)
    _episodes(1, 3)
    began = time.monotonic()
    assert otr.shutdown(timeout=5.0)
    assert time.monotonic() - began < 5.0
    renderer = delivery._renderer
    assert renderer is not None and renderer.process.poll() is not None
    assert otr.stats()["delivery"]["OtlpJsonFileExporter"]["delivered"] == 6


def test_hung_renderer_is_terminated_within_timeout(tmp_path: Path) -> None:
    rt = _run(tmp_path / "out.jsonl", "process")
    delivery = _renderer(rt)
    _episodes(0, 1)
    assert otr.flush(30)
    renderer = delivery._renderer
    assert renderer is not None
    os.kill(renderer.process.pid, signal.SIGSTOP)
    _episodes(1, 2)
    began = time.monotonic()
    assert not otr.shutdown(timeout=2.0)
    assert time.monotonic() - began < 3.0
    assert renderer.process.poll() is not None
    totals = otr.stats()["totals"]
    assert totals["delivered.OtlpJsonFileExporter"] == 1
    assert totals["lost.undelivered_at_exit.OtlpJsonFileExporter"] == 2


class _Locked(InMemorySpanExporter):
    """An exporter that neither pickles (it holds a lock) nor has a recipe."""


def test_unpicklable_exporter_falls_back_to_thread_mode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    exporter = _Locked()
    rt = otr.configure(exporters=[exporter], render="process", sampler=otr.TailSampler(1000, step_lag=None))
    assert type(rt.delivery) is Delivery
    assert otr.stats()["totals"]["render.process_fallback"] == 1
    assert any("render=\"process\"" in r.getMessage() for r in caplog.records)
    _episodes(0, 2)
    assert otr.flush(30)
    assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 2


def test_unpicklable_value_is_flagged_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    rt = _run(path, "process")
    delivery = _renderer(rt)
    record = EpisodeRecord(0x1234, 0, "train", None, 16)
    root = SpanRecord(record, "episode", 0x99, None, c.KIND_EPISODE,
                      {c.RL_STEP: 0, c.RL_SPLIT: "train", "user.thing": threading.Lock()})
    root.end()
    record.spans.append(root)
    record.root = root
    delivery.episode(record)
    assert delivery.flush(30)
    stored = path.read_text()
    # the value went as its text (what the JSON-safe copy makes of an object), counted
    assert '"key":"user.thing","value":{"stringValue":"<unlocked _thread.lock object' in stored
    totals = otr.stats()["totals"]
    assert totals["render.process.unpicklable_values"] == 1
    assert totals["delivered.OtlpJsonFileExporter"] == 1


def test_other_processes_sdk_spans_reach_the_renderer_in_the_tree_and_late(tmp_path: Path) -> None:
    """A Ray task's spans come back as SDK ``ReadableSpan``s, which do not pickle (their
    attributes hold a lock): held with an undecided episode they go in its tree, arriving after
    it was kept they go on their own, both stored by the renderer process with their resource."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    path = tmp_path / "out.jsonl"
    rt = _run(path, "process")
    worker = TracerProvider(resource=Resource.create({"service.name": "ray-worker"})).get_tracer("w")
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    def worker_span(name: str, trace_id: int, parent_id: int) -> Any:
        parent = NonRecordingSpan(SpanContext(trace_id, parent_id, True, TraceFlags(1)))
        span = worker.start_span(name, context=set_span_in_context(parent), attributes={"worker.n": 7})
        span.end()
        return span

    with otr.episode(step=0, episode_id="e0") as ep:
        trace_id, root_id = int(ep.trace_id or "0", 16), ep.root.span_id  # type: ignore[union-attr]
        inside = worker_span("execute_tool step", trace_id, root_id)
        rt.pipeline.foreign.adopt([inside])
        ep.reward(1.0)
    otr.end_step(0)
    record = ep.root.episode  # type: ignore[union-attr]  # what a Ray call was started for
    rt.pipeline.foreign.adopt([worker_span("execute_tool late", trace_id, root_id)], record)  # after the keep
    assert otr.flush(30)
    stored = {}
    for request in read_requests(path):
        for resource_spans in request.resource_spans:
            service = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}.get("service.name")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    stored[span.name] = (int.from_bytes(span.trace_id, "big"), service,
                                         {kv.key: kv.value.int_value for kv in span.attributes})
    for name in ("execute_tool step", "execute_tool late"):
        assert stored[name] == (trace_id, "ray-worker", {"worker.n": 7}), name
    assert "dropped.unpicklable_spans" not in otr.stats()["totals"]


def test_render_auto_uses_the_renderer_process_for_the_exporters_the_library_makes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default, ``render="auto"``: the exporters made from the environment (here an OTLP
    endpoint beside local Trackio) go to the renderer process; exporter objects the user gave
    stay in this process, on the render thread, without a warning or a fallback counted; so do
    the library's own where no Python can be started (a frozen application)."""
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    monkeypatch.delenv("OTEL_ROLLOUTS_RENDER", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    rt = otr.configure(run_id="auto", handle_signals=False)
    delivery = _renderer(rt)
    assert [type(e).__name__ for e in delivery.exporters] == ["TrackioExporter", "OTLPSpanExporter"]
    otr.shutdown(timeout=10)
    given = InMemorySpanExporter()
    rt = otr.configure(exporters=[given], run_id="auto-given", handle_signals=False)
    assert type(rt.delivery) is Delivery
    _episodes(0, 2)
    assert otr.flush(30)
    assert len({s.context.trace_id for s in given.get_finished_spans()}) == 2  # the user's own object
    assert "render.process_fallback" not in otr.stats()["totals"]
    otr.shutdown(timeout=10)
    # an application whose executable is not a Python (frozen): the thread, as asked
    monkeypatch.setattr("sys.frozen", True, raising=False)
    rt = otr.configure(run_id="auto-frozen", handle_signals=False)
    assert type(rt.delivery) is Delivery


def test_builtin_exporters_are_rebuilt_in_the_renderer_process(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    from otel_rollouts.delivery.process import exporter_recipe
    from otel_rollouts.exporters import TrackioExporter
    from otel_rollouts.exporters.otlp_http_json import OTLPJsonSpanExporter

    http = HttpExporter(endpoint="http://127.0.0.1:1/v1/traces", headers={"x-team": "rl"}, timeout=3.0)
    built = exporter_recipe(http)
    assert built is not None
    copy: Any = built.build()
    assert type(copy) is HttpExporter and copy._client._endpoint == "http://127.0.0.1:1/v1/traces"
    assert copy._client._headers["x-team"] == "rl" and copy._client._timeout == 3.0
    grpc = GrpcExporter(endpoint="127.0.0.1:1", insecure=True, timeout=2.0)
    built = exporter_recipe(grpc)
    assert built is not None
    copy = built.build()
    assert type(copy) is GrpcExporter and copy._endpoint == grpc._endpoint and copy._timeout == 2.0
    json_http = OTLPJsonSpanExporter(endpoint="http://127.0.0.1:1/v1/traces")
    built = exporter_recipe(json_http)
    assert built is not None and type(built.build()) is OTLPJsonSpanExporter
    trackio = TrackioExporter("render-process-recipe", run="r1", config={"lr": 1e-5})
    built = exporter_recipe(trackio)
    assert built is not None
    copy = built.build()
    assert (copy.project, copy.run_name, copy.config) == ("render-process-recipe", "r1", {"lr": 1e-5})


def test_trackio_exporter_delivers_from_the_renderer_process() -> None:
    from otel_rollouts.exporters import TrackioExporter

    exporter = TrackioExporter("render-process-trackio", run="r1")
    rt = otr.configure(exporters=[exporter], render="process", sampler=otr.TailSampler(1000, step_lag=None))
    assert isinstance(rt.delivery, ProcessDelivery)
    _episodes(0, 3)
    assert otr.flush(60)
    report = otr.stats()["delivery"]["TrackioExporter"]
    # delivered: Trackio's write was checked (take_not_stored) in the renderer process
    assert report["delivered"] == 3 and report["pending"] == 0 and report["dropped"] == 0
    otr.shutdown(30)
    # the step's summary went to the renderer's copy too: this process's exporter never wrote
    assert exporter._run is None
    assert not [k for k in otr.stats()["totals"] if k.startswith(("errors.", "dropped.", "lost."))]


def test_a_forked_process_lets_go_of_the_renderers_pipes(tmp_path):
    """A fork (a data-loader worker) closes its copies of the renderer's pipes: it can never write
    into the renderer's stream, and the renderer sees the training process's end when it comes."""
    run = _run(tmp_path / "spans.jsonl", "process")
    _episodes(0, 2)
    assert otr.flush(30)
    delivery = run.delivery
    assert isinstance(delivery, ProcessDelivery)
    renderer = delivery._renderer
    assert renderer is not None
    fds = [renderer.out.fileno(), renderer.inbox.fileno()]
    pid = os.fork()
    if pid == 0:  # the fork: both descriptors closed
        still_open = 0
        for fd in fds:
            try:
                os.fstat(fd)
                still_open += 1
            except OSError:
                pass
        os._exit(still_open)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _episodes(1, 2)  # the training process's renderer is untouched
    assert otr.flush(30)
    assert otr.stats()["delivery"]["OtlpJsonFileExporter"]["delivered"] == 4
