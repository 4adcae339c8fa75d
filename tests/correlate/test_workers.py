"""Episode context in thread pools, process pools and multiprocessing workers, with real
processes (fork and spawn), and fork safety of the buffered episodes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.status import StatusCode
from otr_helpers import configure_memory

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]


@contextlib.contextmanager
def _pool(ctx, processes: int) -> Iterator:
    """``ctx.Pool(processes)`` closed and joined on the way out (its workers leave on their own)
    rather than ``Pool.__exit__``'s ``terminate()``: SIGTERM reaches a forked worker through
    whatever handler the parent had at fork time, and once another test has started Ray in
    this process that is Ray's C-level failure handler, which can deadlock a forked child."""
    pool = ctx.Pool(processes)
    try:
        yield pool
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


# --- what the workers run (module level: picklable by reference) ----------------------------------
@otr.traced(kind="tool")
def score(text: str) -> dict:
    """A tool run in a worker: its span, and a nested one, must join the parent's episode."""
    length = measure(text)
    return {"pid": os.getpid(), "length": length}


@otr.traced
def measure(text: str) -> int:
    return len(text)


@otr.traced(kind="tool")
def explode(text: str) -> None:
    raise ValueError(f"cannot score {text!r}")


def plain(text: str) -> int:
    return len(text)


SECRET = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789"


@otr.traced(kind="tool")
def leak(text: str) -> str:
    return f"token is {SECRET}"


@otr.traced
def nested(i: int, k: int) -> int:
    return i * 100 + k


_SYNC: dict[str, threading.Event] = {}  # set in the worker process by four_concurrent_calls


@otr.traced(kind="tool")
def concurrent_tool(i: int) -> int:
    """Call 0 returns at once; the others record their nested spans only after it returned."""
    _SYNC[f"inside{i}"].set()
    if i > 0:
        _SYNC["first_done"].wait(60)
    return sum(nested(i, k) for k in range(20))


def four_concurrent_calls(tasks: list) -> list:
    """In a fresh (unconfigured) worker process: four calls in four threads of one process, as
    a threaded actor runs them; the first finishes while the others are still recording."""
    _SYNC.update({"first_done": threading.Event(), **{f"inside{i}": threading.Event() for i in range(4)}})
    results: list = [None] * 4
    threads = []
    for i, task in enumerate(tasks):
        def run(i: int = i, task=task) -> None:
            results[i] = task(i)

        thread = threading.Thread(target=run)
        thread.start()
        _SYNC[f"inside{i}"].wait(60)  # call 0 is inside before the others start
        threads.append(thread)
    threads[0].join(60)
    _SYNC["first_done"].set()
    for thread in threads[1:]:
        thread.join(60)
    return results


# --- fixtures ------------------------------------------------------------------------------------
@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = configure_memory(1, "first", handle_signals=False)
    yield exporter
    otr.shutdown()


def _by_trace(exporter: InMemorySpanExporter) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(f"{span.context.trace_id:032x}", []).append(span)
    return out


def _current_span_id() -> int:
    return trace.get_current_span().get_span_context().span_id


def _assert_worker_spans(spans, parent_id: int) -> None:
    """``execute_tool score`` under ``parent_id`` and ``measure`` under it, with the run's
    resource, like every other span of the episode."""
    by_name = {s.name: s for s in spans}
    tool, nested = by_name["execute_tool score"], by_name["measure"]
    assert tool.parent.span_id == parent_id
    assert nested.parent.span_id == tool.context.span_id
    assert tool.attributes[c.GEN_AI_TOOL_NAME] == "score"
    assert json.loads(tool.attributes[c.GEN_AI_TOOL_CALL_RESULT])["length"] == 5
    root = by_name["episode"]
    assert tool.resource.attributes == root.resource.attributes


# --- threads ---------------------------------------------------------------------------------------
def test_thread_pool_tasks_join_the_episode(exported):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with otr.episode(step=0) as ep:
            with ep.turn():
                turn_id = _current_span_id()
                result = otr.submit(pool, score, "hello").result(timeout=30)
                direct = pool.submit(otr.with_context(score), "hello").result(timeout=30)
            ep.reward(1.0)
    assert result["pid"] == direct["pid"] == os.getpid()
    otr.flush()
    spans = _by_trace(exported)[ep.trace_id]
    tools = [s for s in spans if s.name == "execute_tool score"]
    assert len(tools) == 2 and all(t.parent.span_id == turn_id for t in tools)


def test_without_the_wrapper_a_thread_pool_task_is_outside_the_episode(exported):
    # the control for the test above: context does not flow into pool threads by itself
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with otr.episode(step=0) as ep:
            pool.submit(score, "hello").result(timeout=30)
            ep.reward(1.0)
    otr.flush()
    spans = _by_trace(exported)[ep.trace_id]
    assert "execute_tool score" not in {s.name for s in spans}


# --- processes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_process_pool_spans_join_the_episode_and_are_dropped_with_it(exported, method):
    ctx = multiprocessing.get_context(method)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        # TailSampler(1, "first"): the first episode to complete is kept, the second dropped
        with otr.episode(step=0) as kept:
            with kept.turn():
                turn_id = _current_span_id()
                result = otr.submit(pool, score, "hello").result(timeout=120)
            kept.reward(1.0)
        with otr.episode(step=0) as dropped:
            with dropped.turn():
                otr.submit(pool, score, "world").result(timeout=120)
            dropped.reward(0.0)
    assert result == {"pid": result["pid"], "length": 5} and result["pid"] != os.getpid()
    otr.flush()
    traces = _by_trace(exported)
    _assert_worker_spans(traces[kept.trace_id], turn_id)
    assert dropped.trace_id not in traces  # not even the worker's spans of it
    assert otr.stats()["totals"]["dropped.sampled_out"] == 1


def test_multiprocessing_pool_map_with_adopt(exported):
    ctx = multiprocessing.get_context(METHODS[0])
    with _pool(ctx, 2) as pool:
        with otr.episode(step=0) as ep:
            with ep.turn():
                turn_id = _current_span_id()
                raw = pool.map(otr.with_context(score), ["hello", "hello", "hello"])
                assert all(isinstance(r, otr.WorkerResult) for r in raw)
                values = [otr.adopt(r) for r in raw]
            ep.reward(1.0)
    assert [v["length"] for v in values] == [5, 5, 5]
    otr.flush()
    spans = _by_trace(exported)[ep.trace_id]
    tools = [s for s in spans if s.name == "execute_tool score"]
    assert len(tools) == 3 and all(t.parent.span_id == turn_id for t in tools)
    assert len({t.context.span_id for t in tools}) == 3  # no id collides across workers


def test_a_failing_worker_task_brings_its_error_span_back(exported):
    ctx = multiprocessing.get_context(METHODS[0])
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with otr.episode(step=0) as ep:
            future = otr.submit(pool, explode, "x")
            with pytest.raises(ValueError, match="cannot score"):
                future.result(timeout=120)
            ep.reward(0.0)
    otr.flush()
    spans = _by_trace(exported)[ep.trace_id]
    (tool,) = [s for s in spans if s.name == "execute_tool explode"]
    assert tool.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in tool.events)


def test_carrier_is_plain_strings_and_works_through_any_payload(exported):
    with otr.episode(step=6, episode_id="e6") as ep:
        carrier = otr.context_carrier()
        parent_id = _current_span_id()
        ep.reward(1.0)
        # the carrier travels as JSON (a queue message, a Ray payload) and is re-attached there
        payload = json.loads(json.dumps({"carrier": carrier, "text": "hello"}))
        ctx = multiprocessing.get_context(METHODS[0])
        with _pool(ctx, 1) as pool:
            result = pool.apply(otr.with_context(score, payload["carrier"]), (payload["text"],))
        assert otr.adopt(result)["length"] == 5
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in carrier.items())
    assert pickle.loads(pickle.dumps(carrier)) == carrier
    assert f"{int(ep.trace_id, 16):032x}" in carrier["traceparent"]
    assert "rl.step=6" in carrier["baggage"] and "rl.episode.id=e6" in carrier["baggage"]
    otr.flush()
    spans = _by_trace(exported)[ep.trace_id]
    _assert_worker_spans(spans, parent_id)


def test_adopt_passes_plain_values_through_and_worker_outside_an_episode_records_nothing(exported):
    assert otr.adopt(7) == 7
    ctx = multiprocessing.get_context(METHODS[0])
    with _pool(ctx, 1) as pool:
        result = pool.apply(otr.with_context(plain), ("abc",))
    assert isinstance(result, otr.WorkerResult) and result.spans == b""
    assert otr.adopt(result) == 3


# --- fork safety -----------------------------------------------------------------------------------
class _FileExporter(SpanExporter):
    """Appends one JSON line per exported span (with the exporting pid) to a file shared by
    parent and child. In the parent it can be held on a gate, so that kept episodes are still
    buffered in the export path when the process forks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gate = threading.Event()
        self.gate_pid = os.getpid()
        self.entered = threading.Event()

    def export(self, spans) -> SpanExportResult:
        if os.getpid() == self.gate_pid:
            self.entered.set()
            self.gate.wait(60)
        lines = "".join(
            json.dumps({"pid": os.getpid(), "trace": f"{s.context.trace_id:032x}", "name": s.name})
            + "\n"
            for s in spans
        )
        with open(self.path, "a") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS


def _child(path: str, out: str) -> None:
    """In the forked child: record and export an episode of its own, then shut down."""
    try:
        assert _runtime.installed() is None  # the parent's runtime was not kept
        with otr.episode(step=9) as ep:
            ep.reward(1.0)
        otr.end_step(9)
        ok = otr.flush(30)
        otr.shutdown(30)  # would end and export the parent's open episode, had it been kept
        Path(out).write_text(json.dumps({"trace": ep.trace_id, "flushed": ok}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        Path(out).write_text(json.dumps({"error": repr(exc)}))


@pytest.mark.skipif("fork" not in METHODS, reason="needs fork")
def test_a_forked_child_neither_duplicates_nor_loses_buffered_episodes(tmp_path):
    path = tmp_path / "spans.jsonl"
    exporter = _FileExporter(path)
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(8, "first"), handle_signals=False)
    try:
        kept = []
        for _ in range(3):  # kept at once ("first"), then held up in the export path
            with otr.episode(step=0) as ep:
                ep.reward(1.0)
            kept.append(ep.trace_id)
        assert exporter.entered.wait(30)
        open_ep = otr.episode(step=0)  # undecided at fork: the root has not ended
        open_ep.__enter__()
        try:
            out = tmp_path / "child.json"
            child = multiprocessing.get_context("fork").Process(target=_child, args=(str(path), str(out)))
            child.start()
            child.join(120)
            assert child.exitcode == 0
        finally:
            open_ep.reward(0.5)
            open_ep.__exit__(None, None, None)
        report = json.loads(out.read_text())
        assert "error" not in report, report
        assert report["flushed"] is True
        exporter.gate.set()
        assert otr.flush(30)
    finally:
        exporter.gate.set()
        otr.shutdown()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    roots = [(r["trace"], r["pid"]) for r in rows if r["name"] == "episode"]
    parent_traces = kept + [open_ep.trace_id]
    # every episode of the parent exported exactly once, by the parent
    assert sorted(roots) == sorted([(t, os.getpid()) for t in parent_traces] + [(report["trace"], child.pid)])
    assert report["trace"] not in parent_traces


def test_an_explicit_carrier_in_the_same_process_joins_the_episode(exported):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with otr.episode(step=0) as ep:
            with ep.turn():
                carrier = otr.context_carrier()
                parent_id = _current_span_id()
            # e.g. an actor in this process that only got the carrier in its payload
            result = pool.submit(otr.with_context(score, carrier), "hello").result(timeout=30)
            ep.reward(1.0)
    assert result["pid"] == os.getpid()
    otr.flush()
    _assert_worker_spans(_by_trace(exported)[ep.trace_id], parent_id)


def test_secrets_in_worker_content_are_redacted(exported):
    ctx = multiprocessing.get_context(METHODS[0])
    with _pool(ctx, 1) as pool:
        with otr.episode(step=0) as ep:
            otr.adopt(pool.apply(otr.with_context(leak), ("x",)))
            ep.reward(1.0)
    otr.flush()
    (tool,) = [s for s in _by_trace(exported)[ep.trace_id] if s.name == "execute_tool leak"]
    result = tool.attributes[c.GEN_AI_TOOL_CALL_RESULT]
    assert "token is" in result and SECRET not in result


def test_concurrent_calls_into_one_worker_process_lose_no_span(exported):
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with otr.episode(step=0) as ep:
            with ep.turn():
                turn_id = _current_span_id()
                tasks = [otr.with_context(concurrent_tool) for _ in range(4)]
                results = pool.submit(four_concurrent_calls, tasks).result(timeout=120)
                values = [otr.adopt(r) for r in results]
            ep.reward(1.0)
    assert values == [sum(i * 100 + k for k in range(20)) for i in range(4)]
    otr.flush()
    spans = _by_trace(exported)[ep.trace_id]
    tools = [s for s in spans if s.name == "execute_tool concurrent_tool"]
    assert len(tools) == 4 and all(t.parent.span_id == turn_id for t in tools)
    children = [s for s in spans if s.name == "nested"]
    assert len(children) == 80  # 20 under each call, none lost when call 0 finished first
    tool_ids = {t.context.span_id for t in tools}
    assert all(s.parent.span_id in tool_ids for s in children)
