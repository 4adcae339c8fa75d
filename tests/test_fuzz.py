"""Bad input, fuzzed with hypothesis across the public API and every adapter.

The rule under test: the traced code never sees an exception from the library (unless strict
mode was asked for), and what the library refused is reported with a message naming the field.
Inputs: wrong types, ragged arrays, NaN/inf, giant and binary strings, deeply nested and cyclic
containers, objects with no JSON form (or whose ``__repr__``/``__str__`` raise), invalid token
ids, negative steps; and concurrent ``end_step`` calls.
"""

from __future__ import annotations

import ast
import importlib
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from profiles import examples

import otel_rollouts as otr
from otel_rollouts import conventions as c

FUZZ = settings(
    max_examples=examples(180), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


class Hostile:
    """An object whose repr, str, float, len and iteration all raise."""

    def __repr__(self):
        raise RuntimeError("repr exploded")

    __str__ = __repr__

    def __float__(self):
        raise RuntimeError("float exploded")

    def __len__(self):
        raise RuntimeError("len exploded")

    def __iter__(self):
        raise RuntimeError("iter exploded")


def _cyclic():
    d: dict = {"name": "cycle"}
    d["self"] = d
    lst: list = [1]
    lst.append(lst)
    d["list"] = lst
    return d


def _deep(n: int = 400):
    d: dict = {}
    cur = d
    for _ in range(n):
        cur["x"] = {}
        cur = cur["x"]
    return d


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=50),
    st.binary(max_size=50),
    st.just("\x00\ud800 surrogate and NUL"),
    st.just("x" * 200_000),  # giant
    st.just(b"\xff\xfe" * 1000),  # binary, not UTF-8
    st.builds(Hostile),
    st.builds(object),
    st.builds(_cyclic),
    st.just(_deep()),
    st.just(np.array([[1.0, float("nan")], [2.0, 3.0]])),
    st.just(np.array([1, 2, 3], dtype=np.int64)),
    st.just(np.float32("inf")),
    st.just(np.array([[1], [2, 3]], dtype=object)),  # ragged
    st.just(float("nan")),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.none()), inner, max_size=4),
        st.tuples(inner, inner),
    ),
    max_leaves=8,
)


@pytest.fixture
def fuzz_memory(configured):
    return configured(1000, "first")


def _contained(fn):
    """Run user code that calls the library: any exception is the library's fault."""
    try:
        fn()
    except otr.InvalidValue:  # only raised in strict mode
        raise
    except Exception as exc:
        pytest.fail(f"the library let {type(exc).__name__}: {exc!r} reach user code")


@FUZZ
@given(
    step=values, split=values, group=values, sample=values, version=values, metadata=values,
    prompt=values, reward=values, components=values, advantage=values, reason=values, status=values,
    content=values, arguments=values, result=values, tokens=values,
)
def test_episode_api_never_raises_on_bad_input(
    fuzz_memory, step, split, group, sample, version, metadata, prompt, reward, components, advantage,
    reason, status, content, arguments, result, tokens,
):
    def user_code():
        with otr.episode(step=step, split=split, group_id=group, sample_index=sample,
                         policy_version=version, metadata=metadata, episode_id=content) as ep:
            ep.prompt(prompt)
            with ep.turn() as turn:
                turn.record_generation(content, model=content, messages=prompt, input_tokens=tokens,
                                       output_tokens=tokens, finish_reason=reason, tool_calls=arguments)
                with turn.tool_call(content, arguments=arguments, call_id=content) as call:
                    call.result(result)
                turn.tool_call(content, arguments).error(content)
                turn.feedback(content, role=content)
            ep.set_attribute(content, metadata)
            ep.reward(reward, components=components, advantage=advantage)
            ep.finish(reason=reason, status=status)
        otr.end_step(step)
        otr.set_step(step)

    _contained(user_code)
    _contained(lambda: otr.flush(timeout=10))


@FUZZ
@given(args=st.lists(values, max_size=3), kwargs=st.dictionaries(st.text(max_size=5), values, max_size=3),
       ret=values, kind=st.sampled_from(c.TRACED_KINDS))
def test_traced_functions_see_only_their_own_values_and_exceptions(fuzz_memory, args, kwargs, ret, kind):
    @otr.traced(kind=kind)
    def fn(*a, **k):
        return ret

    @otr.traced(kind=kind)
    def failing(*a, **k):
        raise KeyError("the user's own error")

    def user_code():
        with otr.episode(step=0) as ep:
            assert fn(*args, **kwargs) is ret
            with pytest.raises(KeyError, match="the user's own error"):
                failing(*args, **kwargs)
            ep.reward(1.0)
        assert fn(*args, **kwargs) is ret  # outside any episode: an SDK span

    _contained(user_code)
    _contained(lambda: otr.flush(timeout=10))


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda ep: ep.reward(float("nan")), "reward"),
        (lambda ep: ep.reward(1.0, components={"math": float("inf")}), "reward.math"),
        (lambda ep: ep.reward("a lot"), "reward"),
        (lambda ep: ep.reward(1.0, advantage=Hostile()), "advantage"),
        (lambda ep: ep.reward(1.0, components=[1, 2]), "components"),
        (lambda ep: ep.finish(status="exploded"), "status"),
    ],
)
def test_refused_values_are_flagged_with_the_field_name(fuzz_memory, call, field):
    with otr.episode(step=0) as ep:
        call(ep)
        ep.reward(0.5)
    otr.end_step(0)
    otr.flush(timeout=10)
    flagged = [
        m for s in fuzz_memory.get_finished_spans() for m in (s.attributes or {}).get(c.RL_INVALID_FIELDS, ())
    ]
    assert any(m.startswith(f"{field}:") for m in flagged), flagged
    assert otr.stats()["totals"]["invalid_values"] >= 1


def test_negative_steps_are_flagged(fuzz_memory):
    with otr.episode(step=-3) as ep:
        ep.reward(1.0)
    otr.flush(timeout=10)
    root = next(s for s in fuzz_memory.get_finished_spans() if s.name == c.SPAN_EPISODE)
    assert any(m.startswith("step:") for m in root.attributes[c.RL_INVALID_FIELDS])


def test_strict_mode_raises_a_clear_error_naming_the_field(otr_shutdown):
    otr.configure(exporters=[InMemorySpanExporter()], strict=True)
    with pytest.raises(otr.InvalidValue, match="^reward: not finite"):
        with otr.episode(step=0) as ep:
            ep.reward(float("nan"))


def test_concurrent_end_step_calls_keep_the_cap_and_never_raise(configured):
    memory = configured(5, "top_bottom")
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(k: int) -> None:
        try:
            for step in range(20):
                with otr.episode(step=step, sample_index=k) as ep:
                    ep.reward(float(k))
                barrier.wait()
                otr.end_step(step)  # all eight threads close the same step at once
                otr.end_step(step)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    otr.flush(timeout=10)
    roots = [s for s in memory.get_finished_spans() if s.name == c.SPAN_EPISODE]
    per_step: dict[int, int] = {}
    for r in roots:
        per_step[r.attributes[c.RL_STEP]] = per_step.get(r.attributes[c.RL_STEP], 0) + 1
    assert all(n <= 5 for n in per_step.values()), per_step
    assert len({r.context.trace_id for r in roots}) == len(roots)  # none exported twice
    totals = otr.stats()["totals"]
    assert totals["seen"] == 160  # every episode accounted for: kept, or dropped with a reason
    assert totals["kept"] + totals.get("dropped.sampled_out", 0) + totals.get("dropped.late", 0) == 160, totals
    assert totals["kept"] == len(roots)


# --- adapters ---------------------------------------------------------------------------------------
ADAPTERS = {
    "areal": "record_trajectories",
    "open_instruct": "record_batch",
    "skyrl": "record_generator_output",
    "tinker": "record_trajectory_groups",
    "torchforge": "record_episodes",
    "verifiers": "record_traces",
    "verl": "record_batch",
}
ADAPTER_DIR = Path(__file__).resolve().parent.parent / "otel_rollouts" / "adapters"


def _field_names(module: str) -> list[str]:
    """String literals of an adapter's source that look like field names: fuzzed dicts use these
    keys, so the adapter's real code paths see the bad values."""
    tree = ast.parse((ADAPTER_DIR / f"{module}.py").read_text())
    names = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier()
        and len(node.value) < 40
    }
    return sorted(names)


class Obj:
    """Attribute access to a dict, as the frameworks' dataclasses and DataProto give."""

    def __init__(self, data):
        self.__dict__.update({k: v for k, v in data.items() if isinstance(k, str)})

    def __getitem__(self, key):
        return self.__dict__[key]

    def keys(self):
        return self.__dict__.keys()


def _tokenizer():
    from adapter_fixtures import tokenizer

    return tokenizer()


def _payload(module: str):
    names = _field_names(module)
    token_ids = st.one_of(
        st.lists(st.integers(min_value=-5, max_value=10**9), max_size=8),  # invalid token ids
        st.just(np.array([[1, 2, 3], [4, 5, 6]])),
        st.just(np.array([2**40, -1])),
        values,
    )
    leaf = st.one_of(values, token_ids)
    record = st.dictionaries(st.sampled_from(names), leaf, max_size=10)
    shaped = st.one_of(record, record.map(Obj), st.lists(st.one_of(record, record.map(Obj)), max_size=3))
    return st.one_of(shaped, st.lists(shaped, max_size=3), values)


# no shrinking: a known failure is reported as found (shrinking giant inputs takes minutes)
ADAPTER_FUZZ = settings(FUZZ, max_examples=examples(90), phases=[Phase.explicit, Phase.reuse, Phase.generate],
                        report_multiple_bugs=False)
# found by this test and reported to the adapters' authors; not strict: a random search may miss
# the bug in a given run
KNOWN: dict[str, str] = {}  # adapter -> known bug (xfail) while one is open


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(m, marks=pytest.mark.xfail(strict=False, reason=KNOWN[m])) if m in KNOWN else m
        for m in sorted(ADAPTERS)
    ],
)
def test_adapters_never_raise_on_bad_input(module, configured):
    adapter = getattr(importlib.import_module(f"otel_rollouts.adapters.{module}"), ADAPTERS[module])
    configured(1000, "first")
    tok = _tokenizer()

    @ADAPTER_FUZZ
    @given(a=_payload(module), b=_payload(module), step=values, split=values, use_tokenizer=st.booleans())
    def run(a, b, step, split, use_tokenizer):
        kwargs = {"step": step, "split": split}
        if "tokenizer" in adapter.__code__.co_varnames:
            kwargs["tokenizer"] = tok if use_tokenizer else Hostile()
        positional = adapter.__code__.co_argcount
        args = (a, b)[:positional]
        _contained(lambda: adapter(*args, **kwargs))
        _contained(lambda: otr.flush(timeout=10))

    run()
    totals = otr.stats()["totals"]
    assert not math.isnan(sum(v for v in totals.values() if isinstance(v, (int, float))))


def test_trl_callback_never_raises_on_bad_trainer_logs(configured):
    from otel_rollouts.adapters.trl import RolloutTraceCallback

    configured(1000, "first")
    names = _field_names("trl")

    class State:
        is_world_process_zero = True
        global_step = 1

    @ADAPTER_FUZZ
    @given(logs=st.dictionaries(st.sampled_from(names), st.one_of(values, st.lists(values, max_size=4)), max_size=8),
           step=values)
    def run(logs, step):
        trainer = Obj({"_logs": logs, "_textual_logs": logs, "processing_class": _tokenizer()})
        callback = RolloutTraceCallback(trainer)
        state = State()
        state.global_step = step
        _contained(lambda: callback.on_step_begin(Obj({}), state, Obj({})))
        _contained(lambda: callback.on_step_end(Obj({}), state, Obj({})))
        _contained(lambda: callback.on_evaluate(Obj({}), state, Obj({}), metrics=logs))

    run()
