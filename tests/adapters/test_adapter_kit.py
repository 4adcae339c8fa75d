"""The public adapter kit (``otel_rollouts.adapters.kit``) is enough to write an adapter.

An adapter for a made-up framework ("quokka") is written here the way one would be outside this
repository, with ``otel_rollouts.adapters.kit`` and the public ``otel_rollouts`` names only. It
is fed what the frameworks hand over in practice (a good record, a reward that is not a number,
an object whose ``__float__`` and ``__repr__`` raise ``SystemExit``, a batch whose columns
disagree in length) and what it recorded is read back from the real OpenTelemetry SDK's
in-memory exporter.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
from dataclasses import dataclass
from typing import Any

import pytest
from adapter_fixtures import configure_memory, episodes

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import kit

FRAMEWORK = "quokka"


# --- the adapter under test: public names only ----------------------------------------------------
@kit.guarded
def record_results(results: Any, *, step: int, split: str = "train", model: str | None = None,
                   trained_version: int | None = None) -> int:
    """Quokka's results (one object per sample) as episodes: the AdapterEntryPoint contract."""
    rows = kit.to_list(results) or []
    for i, row in enumerate(rows):
        reward, problem = kit.as_float(kit.field(row, "score", "reward"), "reward")
        finish = kit.field(row, "finish_reason")
        with otr.episode(step=step, split=kit.split_name(kit.field(row, "phase", default=split)),
                         sample_index=i, framework=FRAMEWORK,
                         episode_id=str(kit.field(row, "uid", default=f"{step}-{i}"))) as ep:
            kit.mark_invalid(ep, problem)
            kit.set_policy(ep, kit.field(row, "version"), trained_version)
            kit.set_times(ep, kit.field(row, "seconds"), {c.STAGE_GENERATION: kit.field(row, "gen_seconds")})
            ep.prompt(kit.field(row, "prompt", default=""))
            with ep.turn() as turn:
                turn.record_generation({"role": "assistant", "content": kit.field(row, "answer", default="")},
                                       model=model, finish_reason=finish)
            if reward is not None:
                ep.reward(reward)
            ep.finish(finish, status=kit.status_for(finish))
    return len(rows)


@kit.guarded
def record_columns(batch: Any, *, step: int, split: str = "train", model: str | None = None) -> int:
    """Quokka's columnar batches (parallel lists) through the batch path: the sampler sees every
    sample's reward, the content is recorded only for the samples it keeps."""
    uids = kit.to_list(kit.field(batch, "uids")) or []
    cols = kit.Columns(len(uids), scores=kit.field(batch, "scores"), answers=kit.field(batch, "answers"))

    def read(i: int) -> kit.Sample:
        reward, problem = kit.as_float(cols.value("scores", i), "reward")
        answer = cols.value("answers", i, "")

        def content(ep: Any) -> None:
            with ep.turn() as turn:
                turn.record_generation({"role": "assistant", "content": answer}, model=model)

        return kit.Sample(content=content, episode_id=str(uids[i]), sample_index=i, reward=reward,
                          missing=cols.missing(i), problems=[problem] if problem else [])

    samples = kit.read_samples(range(len(uids)), read, FRAMEWORK)
    return kit.record_samples(samples, step=step, split=kit.split_name(split), framework=FRAMEWORK)


# --- what the framework hands over ---------------------------------------------------------------
class Hostile:
    """A value whose conversions raise what no library should let through."""

    def __float__(self) -> float:
        raise SystemExit("from __float__")

    def __index__(self) -> int:
        raise SystemExit("from __index__")

    def __repr__(self) -> str:
        raise SystemExit("from __repr__")


@dataclass
class Result:
    uid: str
    score: Any
    prompt: str = "2+2?"
    answer: str = "4"
    version: Any = None
    seconds: Any = None
    gen_seconds: Any = None
    phase: str = "rollout"
    finish_reason: str | None = "stop"


def test_a_kit_adapter_records_good_values_and_marks_bad_and_hostile_ones(memory):
    results = [
        Result("good", 0.5, version=3, seconds=1.5, gen_seconds=1.25),
        Result("bad", "n/a", version="three", seconds=float("nan"), finish_reason="length"),
        Result("hostile", Hostile(), version=Hostile(), seconds=Hostile(), gen_seconds=Hostile()),
    ]

    assert record_results(results, step=2, model="quokka-1b", trained_version=5) == 3
    otr.end_step(2)
    assert otr.flush()

    got = episodes(memory)
    assert set(got) == {"good", "bad", "hostile"}
    good, bad, hostile = got["good"]["root"], got["bad"]["root"], got["hostile"]["root"]
    assert good[c.RL_REWARD] == 0.5
    assert good[c.RL_POLICY_VERSION] == 3 and good[c.RL_STALENESS] == 2
    assert good[c.RL_DURATION_SECONDS] == 1.5 and good[c.stage_seconds(c.STAGE_GENERATION)] == 1.25
    assert good[c.RL_SPLIT] == "train" and good[c.RL_SYSTEM_NAME] == FRAMEWORK
    assert good[c.RL_STATUS] == c.STATUS_OK and c.RL_INVALID_FIELDS not in good

    # refused, named, never guessed: no reward, no version, no duration
    assert c.RL_REWARD not in bad and c.RL_POLICY_VERSION not in bad and c.RL_DURATION_SECONDS not in bad
    assert list(bad[c.RL_INVALID_FIELDS]) == ["reward: not a number: str 'n/a'"]
    assert bad[c.RL_STATUS] == c.STATUS_TRUNCATED

    # SystemExit from __float__ / __index__ / __repr__ is contained by the kit's coercions: the
    # value is refused and described by its type, and the test process is still running
    assert c.RL_REWARD not in hostile and c.RL_POLICY_VERSION not in hostile
    assert c.RL_DURATION_SECONDS not in hostile and c.stage_seconds(c.STAGE_GENERATION) not in hostile
    (reason,) = hostile[c.RL_INVALID_FIELDS]
    assert reason.startswith("reward: not a number: ")
    assert "Hostile" in reason and "SystemExit" in reason
    # every span of every episode was exported: the episodes are whole
    assert all(ep["by_kind"][c.KIND_GENERATION] for ep in got.values())

    assert otr.stats()["totals"][kit.COUNT_INVALID] == 2


def test_a_kit_adapter_failure_is_contained_and_counted(memory):
    class Exploding:
        def __iter__(self):
            raise RuntimeError("the framework's container broke")

        def tolist(self):
            raise RuntimeError("the framework's container broke")

    assert record_results(Exploding(), step=0) is None  # the guarded fallback
    assert otr.flush()
    assert memory.get_finished_spans() == ()
    assert otr.stats()["totals"]["errors.library"] == 1


def test_strict_mode_raises_the_refused_value_through_the_kit(otr_shutdown):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    otr.configure(exporters=[InMemorySpanExporter()], strict=True)
    with pytest.raises(kit.InvalidValue, match="reward: not a number"):
        record_results([Result("bad", "n/a")], step=0)
    assert kit.InvalidValue is otr.InvalidValue


def test_a_kit_adapter_on_the_batch_path_marks_ragged_columns(otr_shutdown):
    exporter = configure_memory()
    batch = {"uids": ["a", "b", "c"], "scores": [1.0, Hostile()], "answers": ["x", "y", "z"]}

    assert record_columns(batch, step=4, split="eval-rollout", model="quokka-1b") == 3
    otr.end_step(4, split="eval")
    assert otr.flush()

    got = episodes(exporter)
    assert set(got) == {"a", "b", "c"}
    a, b, cc = got["a"]["root"], got["b"]["root"], got["c"]["root"]
    assert a[c.RL_REWARD] == 1.0 and a[c.RL_SPLIT] == "eval"
    assert c.RL_ALIGNMENT_KIND not in a  # a short column's prefix is used: it covers a and b
    assert c.RL_REWARD not in b and "Hostile" in b[c.RL_INVALID_FIELDS][0]
    assert c.RL_REWARD not in cc and cc[c.RL_ALIGNMENT_KIND] == "partial"
    assert list(cc[c.RL_ALIGNMENT_MISSING]) == ["scores[2!=3]"]
    totals = otr.stats()["totals"]
    assert totals[kit.COUNT_PARTIAL] == 1 and totals[kit.COUNT_INVALID] == 1


def test_current_instance_is_the_installed_one(otr_shutdown):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    otr.shutdown()
    assert kit.current_instance() is None
    instance = otr.configure(exporters=[InMemorySpanExporter()])
    assert kit.current_instance() is instance
    otr.shutdown()
    assert kit.current_instance() is None


def test_the_kit_follows_the_adapter_contract():
    assert isinstance(record_results, kit.AdapterEntryPoint)
    assert isinstance(record_columns, kit.AdapterEntryPoint)


def _attribute_docstrings(path: pathlib.Path) -> set[str]:
    """Module-level names assigned and followed by a string (an attribute docstring, as
    mkdocstrings reads it)."""
    body = ast.parse(path.read_text()).body
    out = set()
    for node, after in zip(body, body[1:], strict=False):
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str) and after.value.value.strip()):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def test_every_name_the_kit_exports_is_documented():
    assert kit.__doc__ and "kit." in kit.__doc__
    assert len(set(kit.__all__)) == len(kit.__all__)
    constants = _attribute_docstrings(pathlib.Path(kit.__file__))
    undocumented = []
    for name in kit.__all__:
        obj = getattr(kit, name)
        if inspect.isclass(obj):
            documented = bool(vars(obj).get("__doc__"))  # its own, not inherited
        elif callable(obj):
            documented = bool(inspect.getdoc(obj))
        else:
            documented = name in constants
        if not documented:
            undocumented.append(name)
    assert not undocumented
