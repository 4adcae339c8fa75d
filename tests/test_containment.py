"""Containment: the training loop never hangs on, never sees, and never loses to a library fault.

Each test is one fault found by a hostile user: structures that share or contain themselves,
user objects whose ``__repr__``/``__str__``/``__float__`` raise ``SystemExit`` or
``KeyboardInterrupt``, exporters that raise ``SystemExit``, user exceptions that cannot be
printed, and a second ``configure()`` with episodes still open. Everything runs against the real
OpenTelemetry SDK and its in-memory exporter.
"""

from __future__ import annotations

import json
import threading

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import root, traces

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.content import CYCLE, DEFAULT_MAX_NODES, jsonable, snapshot


def _in_thread(fn, timeout: float = 60.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return in time."""
    result: list = []
    errors: list = []

    def run():
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"{fn} did not return within {timeout} s: it hangs"
    if errors:
        raise errors[0]
    return result[0] if result else None


def _roots(exporter) -> dict[str, dict]:
    return {
        s.attributes[c.RL_EPISODE_ID]: dict(s.attributes)
        for s in exporter.get_finished_spans()
        if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_EPISODE
    }


def _spans_named(exporter, prefix: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


# --- 1. structures that share children or contain themselves ------------------------------------
def _diamond(levels: int) -> dict:
    """Each level refers twice to the same child: 2**levels paths, ``levels`` containers."""
    node: dict = {"leaf": "x"}
    for i in range(levels):
        node = {"left": node, "right": node, "level": i}
    return node


def test_a_shared_child_is_copied_once_and_a_cycle_becomes_a_marker():
    shared = _in_thread(lambda: snapshot(_diamond(40)), timeout=10)
    node = shared
    for _ in range(40):  # the copy shares exactly as the original did: one copy per container
        assert node["left"] is node["right"]
        node = node["left"]
    assert node == {"leaf": "x"}

    loop: dict = {"name": "loop"}
    loop["a"] = loop
    loop["b"] = loop
    copied = _in_thread(lambda: snapshot(loop), timeout=10)
    assert copied == {"name": "loop", "a": CYCLE, "b": CYCLE}

    conversation: list = []
    for i in range(3):
        conversation.append({"role": "user", "content": f"m{i}", "history": conversation})
    copied = _in_thread(lambda: snapshot(conversation), timeout=10)
    assert [m["history"] for m in copied] == [CYCLE] * 3


def test_a_tool_calls_bound_arguments_are_copied_with_their_nested_parts_and_sharing():
    # the shapes a traced call passes most (a dict of a flat dict, a list of messages) take the
    # fast copy: still a copy of every container, a shared child still shared once
    query = {"query": "weather", "top_k": 5}
    message = {"role": "user", "content": "hi"}
    for arguments in ({"arguments": query}, {"a": query, "b": query, "n": 1}, {"messages": [message, message]}):
        copied = snapshot(arguments)
        assert copied == arguments
        query["query"], message["content"] = "changed", "changed"
        assert "changed" not in json.dumps(copied)
        query["query"], message["content"] = "weather", "hi"
    both = snapshot({"a": query, "b": query})
    assert both["a"] is both["b"] and both["a"] is not query
    pair = snapshot({"messages": [message, message]})["messages"]
    assert pair[0] is pair[1] and pair[0] is not message
    long = snapshot({"rows": list(range(2 * DEFAULT_MAX_NODES))})["rows"]  # still within the budget
    assert len(long) <= DEFAULT_MAX_NODES + 1 and any("items cut" in str(x) for x in long)


def test_a_huge_container_is_copied_up_to_the_budget_keeping_head_and_tail():
    big = list(range(1_000_000))
    copied = snapshot(big)
    assert len(copied) <= DEFAULT_MAX_NODES + 1
    assert copied[:3] == [0, 1, 2] and copied[-1] == 999_999  # head and tail both kept
    assert any(isinstance(x, str) and "items cut" in x for x in copied)
    rendered = jsonable(_diamond(60))  # 2**60 paths: rendering stops at its node budget
    assert len(json.dumps(rendered)) < 10_000_000


def test_recording_hostile_structures_neither_hangs_nor_loses_the_episode(configured):
    memory = configured(100, "first", max_attribute_chars=4096)
    loop: dict = {}
    loop["self"] = loop
    loop["again"] = loop
    conversation: list = []
    for i in range(3):
        conversation.append({"role": "user", "content": f"m{i}", "history": conversation})

    def record():
        with otr.episode(step=0, episode_id="hostile", metadata={"loop": loop, "dag": _diamond(25)}) as ep:
            ep.prompt(conversation)
            with ep.turn() as turn:
                with turn.tool_call("walk", arguments={"tree": _diamond(25), "loop": loop}) as call:
                    call.result(conversation)
            ep.reward(1.0)

    _in_thread(record, timeout=30)
    assert otr.flush(timeout=30)
    assert "hostile" in _roots(memory)
    (tool,) = _spans_named(memory, c.tool_span_name("walk"))
    arguments = tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]
    assert len(arguments) <= 4096 + 64  # within the attribute budget
    assert CYCLE in tool.attributes[c.GEN_AI_TOOL_CALL_RESULT]


# --- 2. user objects and exporters that raise BaseException --------------------------------------
class _Raising:
    """A value whose every conversion raises ``exc_type``."""

    def __init__(self, exc_type: type[BaseException]) -> None:
        self.exc_type = exc_type

    def __repr__(self) -> str:
        raise self.exc_type("repr")

    def __str__(self) -> str:
        raise self.exc_type("str")

    def __float__(self) -> float:
        raise self.exc_type("float")


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, GeneratorExit, RuntimeError])
def test_values_whose_repr_raises_do_not_kill_the_render_thread(configured, exc_type):
    memory = configured(100, "first")
    hostile = _Raising(exc_type)
    with otr.episode(step=0, episode_id="hostile", metadata={"obj": hostile}) as ep:
        with ep.turn() as turn:
            with turn.tool_call("t", arguments={"x": hostile, hostile: "as a key"}) as call:
                call.result(hostile)
        ep.reward(1.0)
    for i in range(7):  # what comes after is delivered too: the render thread is alive
        with otr.episode(step=0, episode_id=f"after-{i}") as ep:
            ep.reward(float(i))
    assert otr.flush(timeout=30)
    assert set(_roots(memory)) == {"hostile", *(f"after-{i}" for i in range(7))}
    (tool,) = _spans_named(memory, c.tool_span_name("t"))
    placeholder = f"<{_Raising.__qualname__}: repr raised {exc_type.__qualname__}>"
    assert placeholder in tool.attributes[c.GEN_AI_TOOL_CALL_RESULT]
    assert placeholder in tool.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]
    assert otr.stats()["totals"].get("errors.materialize", 0) == 0


class _ExitsOnce(InMemorySpanExporter):
    """An exporter whose first export raises ``SystemExit``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        if self.calls == 1:
            raise SystemExit("exporter quits")
        return super().export(spans)


def test_an_exporter_raising_system_exit_neither_kills_its_sender_nor_loses_the_batch(otr_shutdown, tmp_path):
    exporter = _ExitsOnce()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(100, "first"), spool_dir=tmp_path / "spool")
    with otr.episode(step=0, episode_id="first") as ep:
        ep.reward(1.0)
    otr.flush(timeout=10)  # the failed attempt: False, the batch is safe in the spool
    for i in range(20):
        with otr.episode(step=0, episode_id=f"later-{i}") as ep:
            ep.reward(1.0)
    assert otr.shutdown(timeout=30)
    delivered = set(_roots(exporter))  # at least once: a set, not a count
    assert delivered == {"first", *(f"later-{i}" for i in range(20))}
    totals = otr.stats()["totals"]
    assert totals["errors.export._ExitsOnce"] == 1
    assert not any(k.startswith(("dropped.", "lost.")) for k in totals), totals


class _RaisingForceFlush(InMemorySpanExporter):
    def force_flush(self, timeout_millis: int = 30000) -> bool:
        raise SystemExit("force_flush quits")

    def shutdown(self) -> None:
        raise KeyboardInterrupt("shutdown interrupted")  # on our closer thread, not the main one


def test_exporter_flush_and_shutdown_raising_base_exceptions_are_counted(otr_shutdown):
    exporter = _RaisingForceFlush()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(100, "first"))
    with otr.episode(step=0, episode_id="e") as ep:
        ep.reward(1.0)
    assert otr.flush(timeout=10) is False  # the exporter's flush failed: not claimed as flushed
    otr.shutdown(timeout=10)
    totals = otr.stats()["totals"]
    assert totals["errors.force_flush._RaisingForceFlush"] >= 1
    assert totals["errors.shutdown._RaisingForceFlush"] == 1
    assert set(_roots(exporter)) == {"e"}


def test_ctrl_c_from_a_users_float_still_interrupts_the_main_thread(configured):
    memory = configured(100, "first")
    with pytest.raises(KeyboardInterrupt):
        with otr.episode(step=0, episode_id="main") as ep:
            ep.reward(_Raising(KeyboardInterrupt))
    # on another thread it is only a refused value, recorded and flagged
    def elsewhere():
        with otr.episode(step=0, episode_id="thread") as ep:
            ep.reward(_Raising(KeyboardInterrupt))
            ep.reward(2.0)

    _in_thread(elsewhere)
    assert otr.flush(timeout=10)
    roots = _roots(memory)
    assert roots["thread"][c.RL_REWARD] == 2.0
    (flagged,) = [s for s in _spans_named(memory, c.SPAN_REWARD) if c.RL_INVALID_FIELDS in s.attributes]
    assert any("reward: not a number" in m for m in flagged.attributes[c.RL_INVALID_FIELDS])
    assert roots["main"][c.RL_STATUS] == c.STATUS_TRUNCATED  # Ctrl-C cut it short


# --- 3. user exceptions pass through exactly as raised -----------------------------------------
class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise ValueError("no repr either")


class _ExitUnprintable(SystemExit):
    def __str__(self) -> str:
        raise SystemExit("a different exit")


def _raise_in(where: str, exc: BaseException) -> None:
    with otr.episode(step=0, episode_id=where) as ep:
        if where == "episode":
            raise exc
        with ep.turn() as turn:
            if where == "turn":
                raise exc
            if where == "tool_call":
                with turn.tool_call("t"):
                    raise exc
            with turn.generation("policy"):
                raise exc


@pytest.mark.parametrize("where", ["episode", "turn", "tool_call", "generation"])
@pytest.mark.parametrize("exc_type", [_Unprintable, _ExitUnprintable])
def test_a_user_exception_leaves_as_the_same_object_and_the_episode_is_exported(configured, where, exc_type):
    memory = configured(100, "first")
    raised = exc_type()
    with pytest.raises(BaseException) as caught:
        _raise_in(where, raised)
    assert caught.value is raised
    assert otr.flush(timeout=10)
    (spans,) = traces(memory).values()
    episode = root(spans)
    expected = c.STATUS_TRUNCATED if isinstance(raised, SystemExit) else c.STATUS_ERROR
    assert episode.attributes[c.RL_STATUS] == expected
    events = [e for s in spans for e in s.events if e.name == c.EVENT_EXCEPTION]
    if isinstance(raised, SystemExit) and where == "episode":
        return  # an exit truncates the episode; nothing failed
    assert events and events[0].attributes[c.EXCEPTION_TYPE] == exc_type.__qualname__
    assert "raised" in events[0].attributes[c.EXCEPTION_MESSAGE]  # a placeholder, not a crash


def test_a_traced_function_outside_an_episode_passes_an_unprintable_exception_through(configured):
    memory = configured(100, "first")
    raised = _ExitUnprintable()

    @otr.traced
    def step():
        raise raised

    with pytest.raises(SystemExit) as caught:
        step()
    assert caught.value is raised
    assert otr.flush(timeout=10)
    (span,) = memory.get_finished_spans()
    assert span.events[0].attributes[c.EXCEPTION_TYPE] == _ExitUnprintable.__qualname__


# --- 5. a second configure() with episodes still open -------------------------------------------
def test_reconfiguring_ends_and_delivers_the_old_pipelines_open_episodes(configured):
    first = configured(100, "first")
    open_episodes = [otr.episode(step=0, episode_id=f"open-{i}").start() for i in range(5)]
    for ep in open_episodes:
        ep.prompt("still running")
    second = configured(100, "first")
    roots = _roots(first)
    assert set(roots) == {f"open-{i}" for i in range(5)}
    assert {r[c.RL_STATUS] for r in roots.values()} == {c.STATUS_TRUNCATED}
    for ep in open_episodes:  # the old handles stay harmless
        ep.reward(1.0)
        ep.end()
    with otr.episode(step=0, episode_id="new") as ep:
        ep.reward(1.0)
    assert otr.flush(timeout=10)
    assert set(_roots(second)) == {"new"}


# --- 8. stats outlive shutdown ------------------------------------------------------------------
def test_stats_keep_the_final_totals_after_shutdown(configured):
    configured(2, "first")
    for i in range(5):
        with otr.episode(step=0) as ep:
            ep.reward(float(i))
    assert otr.shutdown(timeout=10)
    after = otr.stats()
    assert after["totals"]["kept"] == 2 and after["totals"]["seen"] == 5
    assert after["delivery"]["InMemorySpanExporter"]["delivered"] == 2
    configured(2, "first")
    assert otr.stats()["totals"] == {}  # a new run counts from zero


class _MetricsExitOnce(InMemorySpanExporter):
    """An exporter with Trackio's ``log_metrics`` hook whose first call raises ``SystemExit``."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[int] = []

    def log_metrics(self, step, values) -> None:
        self.logged.append(step)
        if len(self.logged) == 1:
            raise SystemExit("metrics sink quits")


def test_a_metrics_sink_raising_system_exit_does_not_stop_step_summaries(otr_shutdown):
    exporter = _MetricsExitOnce()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(10, "first"))
    for step in range(3):
        with otr.episode(step=step) as ep:
            ep.reward(1.0)
        otr.end_step(step)
    assert otr.flush(timeout=10)
    assert exporter.logged == [0, 1, 2]  # the thread went on after the first call raised
    assert otr.stats()["totals"]["errors.log_metrics._MetricsExitOnce"] == 1


class _LibraryBug(RuntimeError):
    """Stands for a defect of the library itself, raised deep inside a recording call."""


@pytest.mark.parametrize("strict", [False, True])
def test_a_library_failure_inside_each_per_span_call_is_contained(otr_shutdown, monkeypatch, strict):
    """The per-span calls guard inline (no wrapper): a failure inside any of them is counted and
    gives back a handle the caller can go on with; in strict mode it reaches the caller."""
    from otel_rollouts.record import episode as episode_module

    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], strict=strict)

    def broken(*args, **kwargs):
        raise _LibraryBug("inside the library")

    calls = {
        "start": lambda: otr.episode(step=0).start(),
        "prompt": lambda ep, turn: ep.prompt("hi"),
        "turn": lambda ep, turn: ep.turn(),
        "record_generation": lambda ep, turn: turn.record_generation("x", model="m"),
        "tool_call": lambda ep, turn: turn.tool_call("search", arguments={"q": 1}),
        "reward": lambda ep, turn: ep.reward(1.0),
    }
    for name, call in calls.items():
        before = otr.stats()["totals"].get("errors.library", 0)
        with monkeypatch.context() as m:
            if name == "start":
                m.setattr(episode_module.Episode, "_begin", broken)
                if strict:
                    with pytest.raises(_LibraryBug):
                        call()
                    continue
                ep = call()
                assert isinstance(ep, otr.Episode) and not ep.recording  # usable, not recording
                ep.reward(1.0)
                ep.end()
            else:
                ep = otr.episode(step=0).start()
                turn = ep.turn()  # made before the defect
                before = otr.stats()["totals"].get("errors.library", 0)
                m.setattr(episode_module, "child_span", broken)
                if name == "reward":  # the common case is recorded in place: its span made there
                    m.setattr(episode_module, "_number", broken)
                    m.setattr(episode_module, "_new_span", broken)
                if strict:
                    with pytest.raises(_LibraryBug):
                        call(ep, turn)
                    continue
                handle = call(ep, turn)
                if handle is not None:  # a no-op handle the caller goes on with
                    with handle as h:
                        getattr(h, "result", getattr(h, "output", lambda *a: None))("value")
        assert otr.stats()["totals"].get("errors.library", 0) == before + 1, name


# --- 3. hostile values under the names the library reads back ------------------------------------
class _ExitInt(int):
    """A reward whose every conversion and comparison raises ``SystemExit``."""

    def __float__(self) -> float:
        raise SystemExit("float")

    def __hash__(self) -> int:
        raise SystemExit("hash")

    def __eq__(self, other: object) -> bool:
        raise SystemExit("eq")

    def __repr__(self) -> str:
        raise SystemExit("repr")

    __str__ = __repr__


class _ExitStr(str):
    """A status that raises ``SystemExit`` when hashed or compared (a set lookup does both)."""

    def __hash__(self) -> int:
        raise SystemExit("hash")

    def __eq__(self, other: object) -> bool:
        raise SystemExit("eq")


class _Summaries(InMemorySpanExporter):
    """An exporter that takes the step scalars, as Trackio's does: the step metrics run too."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, dict] = {}

    def log_metrics(self, step, values) -> None:
        self.logged.setdefault(step, {}).update(values)


def test_hostile_values_set_under_the_librarys_own_names_are_recorded_plain_and_contained(otr_shutdown):
    """``set_attribute`` with the reward, the status and the group id the sampler, the group
    health and the step metrics read back: a subclass whose ``__float__``, ``__hash__`` or
    ``__eq__`` raises ``SystemExit`` is recorded as the plain value it holds; another object
    as its guarded text, flagged. Nothing reaches the user; every episode is seen."""
    from opentelemetry import trace

    exporter = _Summaries()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(4, "top_bottom"), handle_signals=False)
    n = 40
    for i in range(n):
        with otr.episode(step=0, group_id=f"g{i // 8}", sample_index=i % 8, episode_id=f"e{i}") as ep:
            ep.reward(float(i % 5))
            if i == 3:  # the best reward of the step: kept
                ep.set_attribute(c.RL_REWARD, _ExitInt(100))
            if i == 4:  # through the OpenTelemetry API, on the current span (the root)
                trace.get_current_span().set_attribute(c.RL_STATUS, _ExitStr(c.STATUS_OK))
            if i == 5:
                ep.set_attribute(c.RL_GROUP_ID, _Raising(SystemExit))
    otr.end_step(0)
    assert otr.flush(timeout=30)
    assert exporter.logged[0]["rollouts/episodes_seen"] == n
    assert exporter.logged[0]["rollouts/reward_max"] == 100.0
    roots = _roots(exporter)
    assert type(roots["e3"][c.RL_REWARD]) is int and roots["e3"][c.RL_REWARD] == 100
    assert otr.stats()["steps"]["0/train"]["seen"] == n


def test_set_attribute_on_a_handle_that_records_nothing_is_a_no_op():
    """Unconfigured (or disabled), the handles record nothing: their ``set_attribute`` (a user's
    key or one of the library's) does nothing and raises nothing."""
    from opentelemetry import trace

    otr.shutdown()
    with otr.episode(step=0) as ep:
        with ep.turn() as turn:
            turn.set_attribute("user.key", 1)
            turn.set_attribute(c.RL_REWARD, _Raising(SystemExit))
            trace.get_current_span().set_attribute(c.RL_STATUS, _ExitStr("ok"))
        ep.set_attribute("user.key", 2)
    assert ep.root is None
