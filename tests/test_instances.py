"""Instances are truly separate: every entry point records into, counts in and takes its
strictness from the instance given to it (argument) or bound to the context
(``Rollouts.activate()``, an instance's own episode), never silently from the installed one.

Three real instances side by side: the installed one is strict, ``strict`` is strict too and
``lenient`` is not; each exports to its own in-memory exporter (the real SDK's).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rollouts as otr
from otel_rollouts import conventions as c


class Run:
    def __init__(self, *, strict: bool, install: bool) -> None:
        self.exporter = InMemorySpanExporter()
        self.rollouts = otr.configure(exporters=[self.exporter], sampler=otr.TailSampler(16, "first"),
                                      strict=strict, install=install, handle_signals=False)

    def roots(self) -> list:
        return [s for s in self.exporter.get_finished_spans() if s.parent is None]

    def totals(self) -> dict:
        return self.rollouts.stats()["totals"]


@pytest.fixture
def runs(otr_shutdown) -> Iterator[tuple[Run, Run, Run]]:
    installed = Run(strict=True, install=True)
    strict = Run(strict=True, install=False)
    lenient = Run(strict=False, install=False)
    yield installed, strict, lenient
    strict.rollouts.shutdown(10.0)
    lenient.rollouts.shutdown(10.0)


def _close(*runs: Run, step: int = 0) -> None:
    for run in runs:
        run.rollouts.end_step(step)
        assert run.rollouts.flush(10.0)


def test_record_batch_records_into_and_takes_strictness_from_its_argument(runs) -> None:
    installed, strict, lenient = runs
    summary = otr.record_batch(2, step=0, rewards=[1.0, 0.0], rollouts=lenient.rollouts)
    assert summary.recorded == 2
    # a refused size: the lenient instance counts it, although the installed one is strict
    otr.record_batch(-1, rollouts=lenient.rollouts)
    with pytest.raises(otr.InvalidValue, match="size"):
        otr.record_batch(-1, rollouts=strict.rollouts)
    _close(installed, strict, lenient)
    assert sorted(s.attributes[c.RL_REWARD] for s in lenient.roots()) == [0.0, 1.0]
    assert installed.roots() == [] and strict.roots() == []
    assert lenient.totals().get("invalid_values") == 1
    assert strict.totals().get("invalid_values") == 1
    assert "invalid_values" not in installed.totals()


def test_record_token_batch_records_into_and_fails_by_its_instance(runs) -> None:
    installed, strict, lenient = runs
    ok = otr.record_token_batch([[1, 2, 3]], tokenizer=None, step=0, loss_mask=[[0, 1, 1]],
                                rewards=[0.5], rollouts=lenient.rollouts)
    assert ok.recorded == 1
    # a mask that does not match its ids: counted by the lenient instance, raised by the strict
    otr.record_token_batch([[1, 2, 3]], tokenizer=None, step=0, loss_mask=[[0, 1]],
                           rollouts=lenient.rollouts)
    with pytest.raises(otr.InvalidValue, match="sample 0: loss_mask"):
        otr.record_token_batch([[1, 2, 3]], tokenizer=None, step=0, loss_mask=[[0, 1]],
                               rollouts=strict.rollouts)
    _close(installed, lenient)
    assert 0.5 in [s.attributes.get(c.RL_REWARD) for s in lenient.roots()]
    assert lenient.totals().get("invalid_values") == 1
    assert installed.roots() == [] and "invalid_values" not in installed.totals()


def test_traced_episode_records_into_its_argument(runs) -> None:
    installed, strict, lenient = runs

    @otr.traced(kind="episode", rollouts=lenient.rollouts)
    def rollout(step: int, group_id: str) -> float:
        with otr.current_episode() as ep:  # the episode the decorator opened
            ep.reward(0.25)
        return 0.25

    assert rollout(step=0, group_id="g") == 0.25
    _close(installed, lenient)
    assert [s.attributes[c.RL_REWARD] for s in lenient.roots()] == [0.25]
    assert installed.roots() == []
    with pytest.raises(TypeError, match="rollouts"):
        otr.traced(kind="episode", rollouts="not an instance")  # type: ignore[arg-type]


def test_activate_binds_every_entry_point_and_control_to_the_instance(runs) -> None:
    installed, strict, lenient = runs
    with lenient.rollouts.activate():
        with otr.episode(step=0, group_id="a") as ep:
            ep.reward(0.5)
        otr.record_batch(1, step=0, rewards=[0.75])
        otr.record_batch(-1)  # lenient: counted, not raised, though the installed one is strict
        otr.end_step(0)  # the module-level controls act on the bound instance
        assert otr.flush(10.0)
        assert otr.stats() == lenient.rollouts.stats()
    assert sorted(s.attributes[c.RL_REWARD] for s in lenient.roots()) == [0.5, 0.75]
    assert lenient.totals().get("invalid_values") == 1
    # outside the block the installed (strict) instance is back
    with pytest.raises(otr.InvalidValue):
        otr.record_batch(-1)
    with otr.episode(step=0) as ep:
        ep.reward(1.0)
    _close(installed)
    assert [s.attributes[c.RL_REWARD] for s in installed.roots()] == [1.0]
    assert len(lenient.roots()) == 2


def test_an_instances_episode_binds_it_for_the_calls_inside(runs) -> None:
    installed, strict, lenient = runs
    with lenient.rollouts.episode(step=0, group_id="g") as ep:
        otr.record_batch(-1)  # reported to the lenient instance: no raise
        ep.reward(2.0)
    with pytest.raises(otr.InvalidValue):
        with strict.rollouts.episode(step=0, group_id="h") as ep:
            otr.record_batch(-1)
    _close(installed, strict, lenient)
    assert [s.attributes[c.RL_REWARD] for s in lenient.roots()] == [2.0]
    assert lenient.totals().get("invalid_values") == 1
    assert strict.totals().get("invalid_values") == 1
    assert "invalid_values" not in installed.totals()


def test_a_binding_stays_in_its_own_thread(runs) -> None:
    installed, strict, lenient = runs
    seen: list[object] = []
    inside = threading.Event()
    done = threading.Event()

    def other_thread() -> None:
        inside.wait(10)
        with otr.episode(step=0) as ep:  # not bound here: the installed instance
            ep.reward(3.0)
        seen.append(ep)
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with lenient.rollouts.activate():
        inside.set()
        assert done.wait(10)
    worker.join(10)
    _close(installed, lenient)
    assert [s.attributes[c.RL_REWARD] for s in installed.roots()] == [3.0]
    assert lenient.roots() == []
