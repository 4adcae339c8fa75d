"""The public API is exactly what the public modules declare, and every part of it is documented.

As httpx's test of its exported names: each public module's ``__all__`` is sorted, unique and
equal to the public names the module binds (so a name cannot be exported by accident, or
forgotten), every exported name is importable, every exported class and function has a docstring,
and none lives in a private module (a dotted part starting with ``_``) unless it is listed below
with the reason. The root's sampling names are the objects of ``otel_rollouts.sampling``, their
canonical home.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import types

import pytest

import otel_rollouts as otr
import otel_rollouts.sampling as sampling
from otel_rollouts.exporters import MetricsSink, NotStoredReporter, PendingViewer, TrackioExporter

# The public modules and their sources (``exporters`` is installed as ``otel_rollouts.exporters``).
PUBLIC_MODULES = ["otel_rollouts", "otel_rollouts.sampling", "otel_rollouts.exporters",
                  "otel_rollouts.exporters.extras", "otel_rollouts.adapters.kit"]

# Root names defined in a private module and documented at the root: the run's entry points live
# in ``_rollouts`` (the assembly of the stages), the guard's and log-prob options in ``_core``.
PRIVATE_HOMES = {
    "otel_rollouts": {
        "InvalidValue", "MismatchOptions", "Rollouts", "configure", "describe_run", "end_step", "flush",
        "gateway", "set_step", "shutdown", "stats", "tracer_provider",
    },
}
# The adapter kit is the public face of the shared helpers of ``_core``: it re-exports them.
PRIVATE_PACKAGES = {"otel_rollouts.adapters.kit": ("otel_rollouts._core.",)}


def _load(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # the adapter kit is built by another change of the same issue
        pytest.skip(f"{name} is not importable here: {exc}")


def _bound_public_names(module: types.ModuleType) -> tuple[set[str], set[str]]:
    """The public names a module binds at its top level: (what it defines, what it imports).
    Not the submodules Python binds on a package as a side effect of importing them."""
    path = pathlib.Path(module.__file__ or "")
    tree = ast.parse(path.read_text(), str(path))
    defined: set[str] = set()
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    imported.discard("annotations")  # from __future__ import annotations

    def public(names: set[str]) -> set[str]:
        return {n for n in names if not n.startswith("_") or n == "__version__"}

    return public(defined), public(imported)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_sorted_unique_and_is_every_public_name(name: str) -> None:
    module = _load(name)
    exported = list(module.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    assert len(exported) == len(set(exported)), f"{name}.__all__ names a name twice"
    defined, imported = _bound_public_names(module)
    if module.__name__ == module.__package__:
        # a package's __init__ only gathers its public names: all it binds is exported
        bound = defined | imported
        assert set(exported) == bound, (
            f"{name}: exported but not bound: {sorted(set(exported) - bound)}; "
            f"bound but not exported (make it private or export it): {sorted(bound - set(exported))}"
        )
    else:
        # a module exports what it defines (and may re-export what it imports)
        assert defined <= set(exported), f"{name}: defined, not exported: {sorted(defined - set(exported))}"
        assert set(exported) <= defined | imported, f"{name}: exported, not bound: {sorted(set(exported) - defined - imported)}"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_exported_name_is_documented_and_lives_in_a_public_module(name: str) -> None:
    module = _load(name)
    allowed = PRIVATE_HOMES.get(name, set())
    assert module.__doc__, f"{name} has no docstring"
    for export in module.__all__:
        obj = getattr(module, export)  # importable: `from <module> import <export>` works
        if isinstance(obj, types.ModuleType):
            assert obj.__doc__, f"{name}.{export} (a module) has no docstring"
            assert not any(p.startswith("_") for p in obj.__name__.split(".")), export
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # values (__version__, Decision, constants) are documented in their module
        assert obj.__doc__ and obj.__doc__.strip(), f"{name}.{export} has no docstring"
        home = obj.__module__
        private = any(p.startswith("_") for p in home.split("."))
        if home.startswith(PRIVATE_PACKAGES.get(name, ("\0",))):
            continue
        if export in allowed:
            assert private, f"{name}.{export} lives in {home} now: take it off PRIVATE_HOMES"
        else:
            assert not private, f"{name}.{export} lives in the private module {home}"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from otel_rollouts import *", namespace)  # noqa: S102 - the import a user writes
    namespace.pop("__builtins__")
    assert set(namespace) == set(otr.__all__)


def test_the_roots_sampling_names_are_the_objects_of_otel_rollouts_sampling() -> None:
    assert otr.sampling is sampling
    at_root = [n for n in sampling.__all__ if n in otr.__all__]
    assert {"Bucket", "Compose", "DegenerateGroups", "Errors", "First", "Groups", "Mismatch",
            "Policy", "Slowest", "TailSampler", "TopBottom", "Uniform"} <= set(at_root)
    for n in at_root:
        assert getattr(otr, n) is getattr(sampling, n), n
        assert getattr(otr, n).__module__.startswith("otel_rollouts.sampling."), n


def test_the_sampling_protocols_are_checkable_and_the_built_ins_satisfy_them() -> None:
    for policy in (sampling.First(), sampling.Uniform(), sampling.Errors(), sampling.TopBottom(),
                   sampling.Slowest(), sampling.Groups(), sampling.DegenerateGroups(),
                   sampling.Mismatch(), sampling.Compose(sampling.Errors(1), "uniform")):
        assert isinstance(policy, sampling.Policy), policy
        assert isinstance(policy, sampling.BasePolicy), policy
        assert isinstance(policy.bucket(4, (0, "train")), sampling.Bucket), policy
    assert isinstance(sampling.TailSampler().bucket((0, "train")), sampling.Bucket)
    assert isinstance(sampling.Uniform().bucket(4, (0, "train")), sampling.BatchBucket)
    assert isinstance(sampling.Groups().bucket(4, (0, "train")), sampling.WholeBatchBucket)
    assert not isinstance(sampling.Uniform().bucket(4, (0, "train")), sampling.WholeBatchBucket)

    class Plain:  # a custom policy needs no base class
        def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
                   margin: int = 0) -> sampling.Bucket:
            return sampling.First().bucket(cap, key, margin=margin)

        def needs(self) -> set[str]:
            return set()

    assert isinstance(Plain(), sampling.Policy)
    assert sampling.make_policy(Plain()).needs() == set()  # type: ignore[arg-type]


def test_a_candidate_is_anything_with_a_trace_id_and_attributes() -> None:
    class Row:
        def __init__(self, trace_id: int, reward: float) -> None:
            self.trace_id, self.reward, self.reason = trace_id, reward, None

        def attribute(self, name: str) -> object:
            return self.reward if name == otr.conventions.RL_REWARD else None

    rows = [Row(i + 1, float(i)) for i in range(6)]
    assert all(isinstance(r, sampling.Candidate) for r in rows)
    bucket = sampling.TopBottom(top=1, bottom=1).bucket(2, (0, "train"))
    for r in rows:
        bucket.offer(r)
    assert sorted(r.trace_id for r in bucket.decide()) == [1, 6]


def test_the_exporter_extras_are_declared_and_checkable() -> None:
    for protocol in (MetricsSink, NotStoredReporter, PendingViewer):
        assert issubclass(TrackioExporter, protocol), protocol
    from otel_rollouts.exporters import ConsoleExporter

    console = ConsoleExporter()
    assert not isinstance(console, (MetricsSink, NotStoredReporter, PendingViewer))


class _Offered:
    """A policy that keeps the first ``cap`` and remembers every candidate it was offered."""

    def __init__(self) -> None:
        self.offered: list[object] = []

    def bucket(self, cap: int, key: tuple[int, str], *, stream: bool = False,
               margin: int = 0) -> sampling.Bucket:
        inner = sampling.First().bucket(cap, key, margin=margin)
        offered = self.offered

        class Recording:
            def offer(self, record: sampling.Candidate) -> sampling.Decision:
                offered.append(record)
                return inner.offer(record)

            def decide(self, limit: int | None = None, exclude: set[int] | None = None) -> list[object]:
                return inner.decide(limit, exclude)

            def held(self) -> list[object]:
                return inner.held()

        return Recording()

    def needs(self) -> set[str]:
        return set()


def test_what_the_pipeline_offers_a_bucket_is_a_candidate(configured) -> None:

    policy = _Offered()
    exporter = configured(8, policy, sampler_options={"step_lag": None})
    with otr.episode(step=0) as ep:  # an episode record
        ep.prompt("2+2?")
        ep.reward(1.0)
    otr.record_batch(2, step=0, rewards=[0.0, 1.0])  # rows of a batch
    otr.end_step(0)
    assert otr.flush()
    assert len(policy.offered) == 3
    for candidate in policy.offered:
        assert isinstance(candidate, sampling.Candidate), type(candidate)
        assert isinstance(candidate.trace_id, int)
    assert sorted(c.attribute(otr.conventions.RL_REWARD) for c in policy.offered) == [0.0, 1.0, 1.0]
    assert len({s.context.trace_id for s in exporter.get_finished_spans() if s.context}) == 3


def test_a_hostile_extra_is_contained_and_reported() -> None:
    """``take_not_stored`` found by ``isinstance`` and called: what it raises is a reason with no
    episode (said once, nothing dropped), what it answers is checked, never trusted."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    from otel_rollouts.delivery.layers import CountingExporter, take_not_stored

    class Raises:
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

        def take_not_stored(self) -> dict[str, list[int]]:
            raise SystemExit(3)

    class Garbage(Raises):
        def take_not_stored(self) -> dict[str, list[int]]:
            return {"disk full": ["not an id", 7]}  # type: ignore[list-item]

    assert isinstance(Raises(), NotStoredReporter) and not isinstance(object(), NotStoredReporter)
    assert take_not_stored(object(), []) == {}
    (reason, ids), = take_not_stored(Raises(), []).items()
    assert reason.startswith("take_not_stored raised SystemExit") and ids == set()
    assert take_not_stored(Garbage(), []) == {"disk full": {7}}
    counting = CountingExporter(Raises())  # type: ignore[arg-type]
    assert counting.export([]) is SpanExportResult.SUCCESS  # contained: the export still counts
