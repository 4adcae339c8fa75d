"""The adapter kit: everything a framework adapter needs, public and typed.

An *adapter* turns a training framework's own objects (a batch, a generator output, trajectory
groups) into otel_rollouts episodes, after the fact, from the framework's hook points. Every
built-in adapter (``otel_rollouts.adapters.trl``, ``verl``, ``skyrl`` ...) is written with this
module and the public ``otel_rollouts`` API only, so an adapter for another framework can be
written the same way, outside this repository.

An entry point (the contract: ``AdapterEntryPoint``) takes the framework's objects positionally
and a keyword-only ``step``; it reads them with ``field`` / ``Columns`` / ``to_list`` (never
trusting a shape), coerces numbers with ``as_float`` / ``to_int`` (a refused value is marked,
never guessed), records through ``otr.episode`` or ``record_samples``, and is wrapped in
``guarded`` so a failure is reported and counted instead of raised into the training loop::

    import otel_rollouts as otr
    from otel_rollouts.adapters import kit

    @kit.guarded
    def record_results(results, *, step: int, split: str = "train", model=None) -> int:
        rows = kit.to_list(results) or []
        for i, row in enumerate(rows):
            reward, problem = kit.as_float(kit.field(row, "reward", "score"), "reward")
            with otr.episode(step=step, split=kit.split_name(split), framework="myfw",
                             sample_index=i) as ep:
                kit.mark_invalid(ep, problem)
                if reward is not None:
                    ep.reward(reward)
        return len(rows)

``tests/adapters/test_adapter_kit.py`` is a complete small adapter written this way.

What the frameworks' own rollout loggers got wrong in review (DESIGN.md §7) is fixed here once:

* ``field`` / ``items`` read dicts, dataclasses, TypedDicts and plain objects alike;
* ``Columns`` aligns parallel per-sample arrays explicitly: a ragged array never raises
  ``IndexError``; the samples it cannot cover are marked ``rl.alignment.kind=partial`` and counted;
* ``to_cpu`` / ``host_lists`` move each tensor to the CPU once per batch, never per sample;
* ``as_float`` / ``reward_total`` coerce rewards (numpy/torch scalars, legacy strings,
  token-level lists) to floats;
* ``group_ids`` maps samples to prompts by ids, and by blocked ``i // n`` only when the layout is
  known to be complete;
* ``first_occurrences`` de-duplicates by episode id;
* ``generated_versions`` takes the policy version from generated tokens only (−1 placeholders
  ignored);
* ``count`` / ``mark_partial`` / ``mark_invalid`` / ``warn_unknown`` record what went wrong on
  the episode and in ``otr.stats()``;
* ``Sample`` / ``record_samples`` record a step's samples through the batch path: what the
  sampler reads (reward, status, group) is collected for every sample, the content only for
  the samples it may keep;
* ``guarded`` / ``guarded_or`` / ``report`` contain failures; ``lazy_text`` / ``Deferred`` /
  ``tokenizer_info`` defer decoding to the export thread; ``parse_tool_calls`` and friends read
  tool calls out of generated text.

Nothing here imports a framework, torch or numpy: tensors are recognised by their methods. This
is the one module of ``otel_rollouts.adapters`` that reaches into the library's internals
(``tests/test_architecture.py`` checks it): the adapters stand above the public root, as a
user's training loop does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast, runtime_checkable

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import Deferred, exception_text, scalar, snapshot
from otel_rollouts._core.content import text as _text
from otel_rollouts._core.guard import InvalidValue, first_time, guarded, guarded_or, report
from otel_rollouts._core.spans import SpanRecord
from otel_rollouts._core.values import to_float, to_int
from otel_rollouts.decode.batch import ROLE_ENVIRONMENT as _ROLE_ENVIRONMENT
from otel_rollouts.decode.batch import TokenizerInfo, tokenizer_info, tokenizer_knowledge
from otel_rollouts.decode.chat_roles import RoleMarkers
from otel_rollouts.decode.toolcalls import HERMES_OPEN as _HERMES_OPEN
from otel_rollouts.decode.toolcalls import (
    ParsedMessage,
    parse_tool_calls,
    strip_tool_responses,
    tool_responses,
)

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

    from otel_rollouts import Rollouts
    from otel_rollouts.record.episode import Episode, Turn

__all__ = [
    "AdapterEntryPoint",
    "COUNT_DUPLICATE",
    "COUNT_FILTERED",
    "COUNT_INVALID",
    "COUNT_NEWER_RELEASE",
    "COUNT_PARTIAL",
    "COUNT_UNGROUPED",
    "COUNT_UNKNOWN",
    "Columns",
    "Deferred",
    "HERMES_OPEN",
    "InvalidValue",
    "ParsedMessage",
    "ROLE_ENVIRONMENT",
    "RoleMarkers",
    "Sample",
    "TokenizerInfo",
    "as_float",
    "captures_content",
    "check_release",
    "count",
    "current_instance",
    "describe_framework",
    "end_step",
    "exception_text",
    "field",
    "first_occurrences",
    "first_time",
    "generated_versions",
    "group_ids",
    "guarded",
    "guarded_or",
    "host_lists",
    "installed_version",
    "items",
    "lazy_text",
    "mark_invalid",
    "mark_partial",
    "mask_runs",
    "parse_tool_calls",
    "read_samples",
    "record_samples",
    "replay_messages",
    "report",
    "reward_total",
    "scalar",
    "seconds",
    "set_policy",
    "set_span_attribute",
    "set_times",
    "snapshot",
    "split_name",
    "status_for",
    "strip_tool_responses",
    "to_cpu",
    "to_float",
    "to_int",
    "to_list",
    "tokenizer_info",
    "tokenizer_knowledge",
    "tool_responses",
    "turns_from_mask",
    "warn_unknown",
]

ROLE_ENVIRONMENT: str = _ROLE_ENVIRONMENT
"""The role of text an environment (not the policy, not a tool) put into a conversation."""

HERMES_OPEN: str = _HERMES_OPEN
"""The tag that opens a Hermes-style tool call in generated text (``<tool_call>``)."""

_MISSING = object()

# stats counter names (totals and per (step, split)), as ``otr.stats()`` shows them
COUNT_PARTIAL = "adapters.alignment_partial"
"""``otr.stats()`` counter: samples recorded with ``rl.alignment.kind=partial`` (a ragged column)."""
COUNT_DUPLICATE = "adapters.duplicates"
"""``otr.stats()`` counter: samples left out as duplicates of an episode already recorded."""
COUNT_FILTERED = "adapters.filtered"
"""``otr.stats()`` counter: samples the framework filtered out before training."""
COUNT_UNGROUPED = "adapters.ungrouped"
"""``otr.stats()`` counter: samples recorded without a group (no id and no known layout)."""
COUNT_INVALID = "adapters.invalid_values"
"""``otr.stats()`` counter: values an adapter refused (each also in the episode's ``rl.invalid``)."""
COUNT_UNKNOWN = "adapters.unknown_structure"
"""``otr.stats()`` counter: structures an adapter did not understand (``warn_unknown``)."""
COUNT_NEWER_RELEASE = "adapters.newer_release"
"""``otr.stats()`` counter: calls on a framework release newer than the adapter is tested on."""


def current_instance() -> Rollouts | None:
    """The otel_rollouts instance active here: the one bound to this context
    (``Rollouts.activate()``, an instance's own episode, an entry point's ``rollouts=``), else
    the one installed in this process; None before ``configure()`` and after ``otr.shutdown()``.

    Adapters use it for two things: to tell runs apart (state an adapter keeps across calls, such
    as the steps it has open, belongs to one instance and is dropped when another one is
    installed: compare with ``is``), and to configure from the environment where nothing did (a
    trainer in a Ray actor: ``if kit.current_instance() is None: otr.configure()``). It never
    warns, never builds an instance and never rebuilds a forked child's.
    """
    return cast("Rollouts | None", _runtime.active())


_VERSIONS: dict[str, str | None] = {}  # distribution -> its installed version, read once


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``importlib.metadata``), read once; None when
    it is not installed as a distribution (a framework run from its source tree)."""
    if distribution not in _VERSIONS:
        try:
            from importlib.metadata import version

            _VERSIONS[distribution] = version(distribution)
        except Exception:  # noqa: BLE001 - not installed, or metadata unreadable
            _VERSIONS[distribution] = None
    return _VERSIONS[distribution]


@guarded
def describe_framework(system: str, distribution: str | None = None, *, algorithm: object = None,
                       model_name: object = None, environment_name: object = None) -> None:
    """Describe the active run as an adapter sees it (``otr.describe_run``): the framework
    ``system`` and the installed version of ``distribution``, and what the framework's
    configuration says of the algorithm, the policy model and the environment (None: not
    known). Cheap to call at every entry point: only a changed value goes to the renderer."""
    rollouts = current_instance()
    if rollouts is None:
        return
    rollouts.describe_run(system=system, system_version=installed_version(distribution) if distribution else None,
                          algorithm=algorithm, model_name=model_name, environment_name=environment_name)


class _AttributeTarget(Protocol):
    """What ``set_policy`` / ``set_times`` / ``mark_partial`` write to: an episode, or a
    per-sample attribute dict an adapter hands to ``record_token_batch``."""

    def set_attribute(self, key: str, value: AttributeValue) -> None: ...


# --- the extension point -----------------------------------------------------------------------
@runtime_checkable
class AdapterEntryPoint(Protocol):
    """What every adapter entry point is (``verl.record_batch``, ``tinker.record_trajectory_groups``
    ...): the contract a new adapter follows.

    It takes:

    * positionally, the framework's own objects exactly as the training loop has them (a batch,
      a generator output, trajectory groups): never a copy made for us, never converted first;
    * keyword-only ``step`` (required: the training step the episodes belong to, what the tail
      sampler keys on), and the optional ``split`` (default ``"train"``), ``model``, ``tokenizer``
      (to decode token ids lazily, on the export thread) and ``trained_version``, plus
      framework-specific options.

    It records one episode per sample through ``otel_rollouts.record`` (and ``decode`` for token
    batches) and returns what it recorded: the number of episodes, or their trace ids (a list of
    32-hex-digit strings), whichever the framework's loop can use. It never raises into the
    training loop (it is wrapped in ``guarded``/``guarded_or``: a library failure
    is reported and the fallback, ``None`` or ``[]``, returned), never blocks (decoding is
    deferred), moves each tensor to the CPU once per batch, and marks what it could not read
    (``mark_partial``, ``mark_invalid``, ``warn_unknown``) instead of guessing.

    The signature is written loosely (each framework's objects differ), so mypy checks only
    that an entry point is callable and returns a count, trace ids or None; the keyword-only
    ``step`` is checked by the adapter tests.
    """

    __name__: str

    def __call__(self, *args: Any, **kwargs: Any) -> int | list[str] | None: ...


def end_step(step: int, split: str | None = None) -> None:
    """Close ``step`` (of ``split``) on the installed instance, as ``otr.end_step`` does, for
    adapters that hook a trainer's step boundary: the tail sampler decides the step's episodes
    now instead of waiting for a later step. No instance installed: nothing to close."""
    close = getattr(_runtime.current(), "end_step", None)
    if callable(close):
        close(step, split)


# --- reading duck-typed inputs -----------------------------------------------------------------
def field(obj: object, *names: str, default: object = None) -> Any:
    """The first of ``names`` that ``obj`` holds with a non-None value (key or attribute).

    Works for dicts / TypedDicts (keys), dataclasses and plain objects (attributes); ``default``
    when none is present.
    """
    if obj is None:
        return default
    for name in names:
        if isinstance(obj, Mapping):
            value = obj.get(name, _MISSING)
        else:
            value = getattr(obj, name, _MISSING)
        if value is not _MISSING and value is not None:
            return value
    return default


def items(obj: object) -> dict[str, object]:
    """A shallow ``{name: value}`` view of a dict, dataclass or object (for extra columns)."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return {str(k): v for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        return {k: v for k, v in attrs.items() if not k.startswith("_")}
    return {}


# --- tensors -------------------------------------------------------------------------------------
def to_cpu(value: object) -> Any:
    """``value`` on the host, moved once: torch tensors ``.detach().cpu()``, remote/sharded
    tensors (AReaL ``RTensor``) ``.to_local()`` first; numpy arrays and lists are returned as is.

    Call it once per tensor per batch (before the per-sample loop), never per sample.
    """
    if value is None or isinstance(value, (str, bytes, int, float, bool, list, tuple, dict)):
        return value
    to_local = getattr(value, "to_local", None)
    if callable(to_local) and not hasattr(value, "detach"):
        value = to_local()
    detach = getattr(value, "detach", None)
    if callable(detach):
        value = detach()
    device = getattr(value, "device", None)
    cpu = getattr(value, "cpu", None)
    if callable(cpu) and device is not None and getattr(device, "type", "cpu") != "cpu":
        value = cpu()
    return value


def to_list(value: object) -> list[Any] | None:
    """A Python list of ``value`` (tensor, ndarray, tuple, list); None stays None.

    Tensors are moved to the host once (``to_cpu``) and converted with ``tolist()`` in one call.
    """
    if value is None:
        return None
    if isinstance(value, list):
        return value
    if isinstance(value, (tuple, range)):
        return list(value)
    if isinstance(value, (str, bytes, Mapping)):
        return [value]
    host = to_cpu(value)  # a framework's tensor, array or iterable, on the host
    tolist = getattr(host, "tolist", None)
    if callable(tolist):
        out = tolist()
        return out if isinstance(out, list) else [out]
    try:
        return list(host)
    except TypeError:
        return [host]


def host_lists(mapping: object, names: Iterable[str]) -> dict[str, list[Any] | None]:
    """``{name: to_list(mapping[name])}`` for each name present: every tensor moved once."""
    return {name: to_list(field(mapping, name)) for name in names}


# --- numbers -------------------------------------------------------------------------------------
def as_float(value: object, field_name: str = "value") -> tuple[float | None, str | None]:
    """(float, None) for a number-like value, (None, reason naming ``field_name``) otherwise.

    Accepts Python numbers, numpy/torch scalars and 1-element tensors, and numeric strings
    (legacy loggers wrote rewards as formatted text).
    """
    if value is None:
        return None, None
    return to_float(value, field_name)


def reward_total(value: object, field_name: str = "reward") -> tuple[float | None, list[float] | None, str | None]:
    """(total, per-token values or None, problem or None) for a scalar or token-level reward.

    A per-token reward list (SkyRL) or a multi-element tensor sums to the total; the list is
    returned too so it can be kept as metadata.
    """
    value = scalar(value)
    if value is None:
        return None, None, None
    if isinstance(value, (str, bytes, int, float, bool)):
        number, problem = to_float(value, field_name)
        return number, None, problem
    values = to_list(value)
    if values is None:
        return None, None, None
    per_token: list[float] = []
    for j, v in enumerate(values):
        number, problem = to_float(v, f"{field_name}[{j}]")
        if problem is not None or number is None:
            return None, None, problem
        per_token.append(number)
    return float(sum(per_token)), per_token, None


def generated_versions(versions: Sequence[object] | None, loss_mask: Sequence[object] | None = None
                       ) -> tuple[int | None, int | None]:
    """(min, max) policy version over generated tokens only.

    Tokens with ``loss_mask == 0`` and ``-1`` placeholders (prompt / environment tokens) are
    ignored, so a sample's head version is never −1.
    """
    lo = hi = None
    if versions is None:
        return None, None
    for j, v in enumerate(versions):
        if loss_mask is not None and (j >= len(loss_mask) or not loss_mask[j]):
            continue
        v, _ = to_int(v, "version")  # a hostile __index__ is refused like any non-number
        if v is None or v < 0:
            continue
        lo = v if lo is None or v < lo else lo
        hi = v if hi is None or v > hi else hi
    return lo, hi


# --- alignment -----------------------------------------------------------------------------------
class Columns:
    """Parallel per-sample arrays aligned explicitly against ``n`` samples.

    ``Columns(n, scores=batch.scores, datasets=batch.datasets)``: a column that is None is absent
    (not an alignment problem); a column whose length differs from ``n`` is *ragged*. A ragged
    column's entries are used for the samples it covers (the prefix), unless its name is in
    ``drop_if_ragged`` (values known to belong to other samples once a framework filtered the
    batch: then the whole column is ignored). ``missing(i)`` names the ragged columns that do not
    cover sample ``i`` reliably; those samples are recorded with ``rl.alignment.kind=partial``.
    """

    def __init__(self, n: int, *, drop_if_ragged: Iterable[str] = (), **columns: object) -> None:
        self.n = max(0, int(n))
        self.columns: dict[str, list[object] | None] = {}
        self.ragged: dict[str, int] = {}
        drop = set(drop_if_ragged)
        for name, column in columns.items():
            values = to_list(column)
            if values is not None and len(values) != self.n:
                self.ragged[name] = len(values)
                if name in drop:
                    values = None
            self.columns[name] = values

    def has(self, name: str) -> bool:
        return self.columns.get(name) is not None

    def value(self, name: str, i: int, default: object = None) -> Any:
        """Entry ``i`` of column ``name`` or ``default`` when absent or not covered."""
        values = self.columns.get(name)
        if values is None or i < 0 or i >= len(values):
            return default
        return values[i]

    def missing(self, i: int) -> list[str]:
        """Names of ragged columns whose entry for sample ``i`` is missing or unreliable."""
        out = []
        for name, length in self.ragged.items():
            values = self.columns.get(name)
            if values is None or i >= len(values) or length > self.n:
                out.append(f"{name}[{length}!={self.n}]")
        return out


@dataclasses.dataclass(slots=True)
class Sample:
    """One sample of a batch as an adapter read it: the root's fields and what the sampler
    reads, and ``content(episode)``, which records its prompt and turns if it may be kept."""

    content: Callable[[Episode], None]
    episode_id: str | None = None
    group_id: object = None
    sample_index: int | None = None
    dataset_name: str | None = None
    dataset_index: object = None
    metadata: Mapping[str, object] | None = None
    reward: float | None = None
    components: Mapping[str, object] | None = None
    advantage: object = None
    finish_reason: object = None
    status: str | None = None
    missing: Sequence[str] = ()  # ragged columns that do not cover it (rl.alignment.kind=partial)
    problems: Sequence[str] = ()  # values refused while reading it (rl.invalid)
    # what the framework measured: the episode's wall time and seconds per stage (absent: not
    # measured, never 0), written on the root (rl.duration.seconds, rl.stage.<stage>.seconds)
    duration: float | None = None
    stages: Mapping[str, object] | None = None
    # the response tokens' logprobs: the inference engine's and the trainer's (1-D each, any of
    # tensor / array / list; None: not known), which tokens count, and the tokens (texts or ids)
    logprobs: object = None
    trainer_logprobs: object = None
    logprob_mask: object = None
    response_ids: object = None
    # [start, end) of each generation in those concatenated tokens, in the order ``content``
    # records the generation spans (a multi-turn response; read after ``content``, which may
    # fill the list): each generation then gets its own statistics and worst tokens (positions
    # within it), the root the sample's. None: one generation, or not known (the statistics go
    # on the last generation, ``record_batch``'s rule)
    generation_bounds: Sequence[tuple[int, int]] | None = None


def read_samples(indices: Iterable[int], read: Callable[[int], Sample], framework: str) -> list[Sample]:
    """``read(i)`` for each sample ``i``; one that fails is reported naming it and left out, and
    the rest go on (as one failing ``otr.episode`` would)."""
    out: list[Sample] = []
    for i in indices:
        try:
            out.append(read(i))
        except InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad sample never stops the batch
            report(f"{framework} adapter: sample {i}: {exception_text(exc)}", exc=exc)
    return out


def record_samples(samples: Sequence[Sample], *, step: int, split: str, framework: str,
                   tokenizer: object = None) -> int:
    """Record ``samples`` (one step) with ``record_batch``: the tail sampler chooses from their
    rewards, statuses and groups in one call, and only the samples it may keep are recorded as
    episodes. Partial and invalid ones are counted for all; returns how many were offered."""
    from otel_rollouts.record.batch import record_batch

    n = len(samples)
    partial = sum(1 for s in samples if s.missing)
    invalid = sum(len(s.problems) for s in samples)
    if partial:
        count(COUNT_PARTIAL, partial, step=step, split=split)
    if invalid:
        count(COUNT_INVALID, invalid, step=step, split=split)
    names = sorted({k for s in samples if s.components for k in s.components})
    components = {k: [None if not s.components else s.components.get(k) for s in samples] for k in names}

    split_by_generation = _GenerationMismatch.of(samples, tokenizer, framework)

    def record(i: int, ep: Episode) -> None:
        sample = samples[i]
        if sample.missing:
            _partial_attributes(ep, sample.missing)
        for problem in sample.problems:
            _flag_invalid(ep, problem)
        set_times(ep, sample.duration, sample.stages)
        sample.content(ep)
        if split_by_generation is not None:
            try:
                split_by_generation.record(sample, ep)
            except InvalidValue:
                raise
            except Exception as exc:  # noqa: BLE001 - the episode is kept, with the root's statistics
                report(f"{framework} adapter: per-generation mismatch: {exception_text(exc)}", exc=exc)

    record_batch(
        n, step=step, split=split, framework=framework, record=record,
        rewards=[s.reward for s in samples], advantages=[s.advantage for s in samples],
        reward_components=components or None,
        group_ids=[s.group_id for s in samples], sample_indices=[s.sample_index for s in samples],
        episode_ids=[s.episode_id for s in samples], statuses=[s.status for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
        dataset_name=[s.dataset_name for s in samples],
        dataset_indices=[s.dataset_index for s in samples], metadata=[s.metadata for s in samples],
        durations=[s.duration for s in samples],
        **_logprob_columns(samples, tokenizer),
    )
    return n


class _LogprobColumns(TypedDict, total=False):
    """``record_batch``'s logprob keywords (one entry per sample)."""

    logprobs: list[object]
    trainer_logprobs: list[object]
    logprob_masks: list[object]
    response_tokens: list[object]
    tokenizer: object


def _logprob_columns(samples: Sequence[Sample], tokenizer: object) -> _LogprobColumns:
    """``record_batch``'s logprob keywords, when some sample has both logprobs."""
    if not any(s.logprobs is not None and s.trainer_logprobs is not None for s in samples):
        return {}
    return {
        "logprobs": [s.logprobs for s in samples],
        "trainer_logprobs": [s.trainer_logprobs for s in samples],
        "logprob_masks": [s.logprob_mask for s in samples],
        "response_tokens": [s.response_ids for s in samples],
        "tokenizer": tokenizer,
    }


class _GenerationMismatch:
    """Per-generation train–inference mismatch for samples whose response concatenates several
    generations (``Sample.generation_bounds``): each generation span gets the statistics and
    worst tokens of its own tokens (``record_logprobs``, positions within the generation), so
    ``record_batch`` puts the sample's statistics (its vectorised pass, what the sampler ranks
    by) on the root only. Runs for kept samples only, after their ``content``."""

    def __init__(self, decode: Callable[[list[int]], list[str]] | None, framework: str) -> None:
        self.decode, self.framework = decode, framework

    @classmethod
    def of(cls, samples: Sequence[Sample], tokenizer: object, framework: str) -> _GenerationMismatch | None:
        if not any(s.generation_bounds is not None and s.logprobs is not None and s.trainer_logprobs is not None
                   for s in samples):
            return None
        from otel_rollouts.record.batch import PrivateDecoder

        # one private copy of the tokenizer for the call (made on the export thread, if needed)
        return cls(PrivateDecoder(tokenizer) if tokenizer is not None else None, framework)

    def record(self, sample: Sample, ep: Episode) -> None:
        from otel_rollouts._core.logprobs import read_tokens
        from otel_rollouts.record.episode import record_generations_mismatch

        bounds = sample.generation_bounds
        if bounds is None:
            return
        arrays = [read_tokens(v, name)[0] for name, v in (("logprobs", sample.logprobs),
                                                          ("trainer_logprobs", sample.trainer_logprobs),
                                                          ("logprob_mask", sample.logprob_mask))]
        rollout, trainer, mask = arrays
        if rollout is None or trainer is None or len(rollout) != len(trainer) \
                or (mask is not None and len(mask) != len(rollout)):
            return  # not comparable: record_batch says why, and records no statistic
        tokens = to_list(sample.response_ids)
        tokens = tokens if tokens is not None and len(tokens) >= len(rollout) else None
        problem = record_generations_mismatch(ep, bounds, rollout, trainer, tokens, mask, self.decode)
        if problem is not None:
            warn_unknown(self.framework, "generations", problem)


def _partial_attributes(ep: _AttributeTarget, missing: Sequence[str]) -> None:
    ep.set_attribute(c.RL_ALIGNMENT_KIND, "partial")
    ep.set_attribute(c.RL_ALIGNMENT_MISSING, list(missing))


def _flag_invalid(ep: object, problem: str) -> bool:
    from otel_rollouts.record.episode import flag_episode

    return flag_episode(ep, problem)


def mark_partial(ep: _AttributeTarget, missing: Sequence[str]) -> None:
    """Record ``rl.alignment.kind=partial`` (and which columns) on an episode, and count it."""
    if not missing:
        return
    _partial_attributes(ep, missing)
    count(COUNT_PARTIAL, step=getattr(ep, "step", None), split=getattr(ep, "split", None))


def mark_invalid(ep: object, problem: str | None) -> None:
    """Record a refused value on the episode root (``rl.invalid``) and count it."""
    if not problem or not _flag_invalid(ep, problem):
        return
    count(COUNT_INVALID, step=getattr(ep, "step", None), split=getattr(ep, "split", None))


def count(name: str, n: int = 1, *, step: int | None = None, split: str | None = None) -> None:
    """Add ``n`` to the active instance's ``otr.stats()`` counter ``name`` (total, and per step
    when given)."""
    rt = _runtime.active()
    if rt is None or rt.counters is None or n <= 0:
        return
    if step is not None:
        rt.counters.step((int(step), split or "train"), name, n)
    else:
        rt.counters.add(name, n)


def warn_unknown(adapter: str, field_name: str, detail: str) -> None:
    """Warn once per (adapter, field) about a structure the adapter does not understand (and
    count every time): it is recorded as far as it is understood, never guessed silently."""
    count(COUNT_UNKNOWN)
    if not first_time(f"adapters.{adapter}.{field_name}"):
        return
    import logging

    logging.getLogger("otel_rollouts").warning(
        "otel_rollouts.adapters.%s: %s: %s (recorded as far as understood; warned once)", adapter, field_name, detail
    )


def check_release(adapter: str, distribution: str, tested: Sequence[str]) -> str | None:
    """Warn once when the installed ``distribution`` is newer than every release in ``tested``
    (the versions the adapter's tests run on, oldest first); return the installed version.

    A newer release is still read as far as it is understood: what the adapter cannot map is
    warned field by field (``warn_unknown``), never guessed. Never raises: a missing or
    unparsable version is no warning.
    """
    try:
        installed = _installed_release(distribution)
        if installed is None:
            return None
        if not tested or _release_key(installed) <= max(_release_key(t) for t in tested):
            return installed
    except Exception:  # noqa: BLE001 - a version check must never break recording
        return None
    count(COUNT_NEWER_RELEASE)
    if first_time(f"adapters.{adapter}.release"):
        import logging

        logging.getLogger("otel_rollouts").warning(
            "otel_rollouts.adapters.%s: %s %s is newer than the releases this adapter is tested on (%s); "
            "it is read as far as its fields are understood and every field it cannot map is warned "
            "(adapters.unknown_structure). Warned once.",
            adapter, distribution, installed, ", ".join(tested),
        )
    return installed


@functools.lru_cache(maxsize=32)
def _installed_release(distribution: str) -> str | None:
    """The installed release of ``distribution`` (None: not installed), read once per process:
    the lookup scans the installed distributions (~2 ms) and entry points call it per batch or
    per trajectory, on the training thread."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _release_key(text: str) -> tuple[int, ...]:
    """The numeric release of a version string (``0.6.1.dev3+g1`` → ``(0, 6, 1)``)."""
    parts: list[int] = []
    for piece in str(text).split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def captures_content(ep: object) -> bool:
    """Whether episode ``ep`` records content (``capture_content``): an answer field is content."""
    root = getattr(ep, "root", None)
    return root is not None and bool(root.episode.capture_content)


def set_policy(ep: _AttributeTarget, version: object, trained_version: object = None) -> None:
    """``rl.policy.version`` and ``rl.staleness`` by the one definition in ``conventions``:
    ``version`` = optimizer updates the generating weights had received, ``trained_version`` =
    updates the weights that train on the sample have received; staleness = their difference."""
    v = None if version is None else to_int(version, "policy version")[0]
    if v is None:
        return
    ep.set_attribute(c.RL_POLICY_VERSION, v)
    t = None if trained_version is None else to_int(trained_version, "trained version")[0]
    if t is not None:
        ep.set_attribute(c.RL_STALENESS, t - v)


# --- groups and duplicates -------------------------------------------------------------------------
def group_ids(
    n: int,
    *,
    ids: Sequence[object] | None = None,
    key: Callable[[object], object] | None = None,
    per_group: int | None = None,
    complete: bool = False,
    prefix: str = "",
) -> tuple[list[str | None], str]:
    """Group id of each of ``n`` samples, and how it was found (``ids|blocked|none``).

    ``ids`` (e.g. SkyRL trajectory ids, dataset indices) win when they cover every sample;
    ``key`` extracts the group from an id (``lambda t: t.instance_id``). Otherwise the blocked
    layout ``i // per_group`` is used, but only when ``complete`` says every group is whole and
    ``n`` is a multiple of ``per_group``; else no group is claimed (never a wrong one).
    """
    if ids is not None:
        values = to_list(ids) or []
        if len(values) >= n and all(v is not None for v in values[:n]):
            out = []
            for v in values[:n]:
                g = key(v) if key is not None else v
                out.append(None if g is None else f"{prefix}{g}")
            if all(g is not None for g in out):
                return out, "ids"
    if complete and per_group and per_group > 0 and n % per_group == 0:
        return [f"{prefix}{i // per_group}" for i in range(n)], "blocked"
    return [None] * n, "none"


def first_occurrences(keys: Sequence[object]) -> tuple[list[int], int]:
    """Indices of the first occurrence of each key (order kept) and how many duplicates."""
    seen: set[object] = set()
    keep: list[int] = []
    for i, k in enumerate(keys):
        if k is not None and k in seen:
            continue
        if k is not None:
            seen.add(k)
        keep.append(i)
    return keep, len(keys) - len(keep)


# --- vocabulary ----------------------------------------------------------------------------------
_EVAL_SPLITS = {"eval", "evaluation", "eval-rollout", "validate", "validation", "val", "test"}
_TRAIN_SPLITS = {"train", "training", "rollout", "rollouts"}


def split_name(value: object, default: str = "train") -> str:
    """``train`` / ``eval`` for the frameworks' phase names (``rollout``, ``eval-rollout``,
    ``validate``, ``training_phase``); other names are kept as they are."""
    if value is None:
        return default
    if isinstance(value, bool):
        return "eval" if value else "train"
    text = _text(value).strip()
    low = text.lower()
    if low in _EVAL_SPLITS:
        return "eval"
    if low in _TRAIN_SPLITS:
        return "train"
    return text or default


_TRUNCATED = {"length", "max_tokens", "truncated", "context_overflow", "max_length"}
_ERROR = {"error", "abort", "aborted", "failed", "exception"}


def status_for(finish_reason: object) -> str:
    """``rl.status`` for a generation's finish reason: ``length`` → truncated, errors → error."""
    if finish_reason is None:
        return c.STATUS_OK
    low = _text(finish_reason).strip().lower()
    if low in _TRUNCATED:
        return c.STATUS_TRUNCATED
    if low in _ERROR:
        return c.STATUS_ERROR
    return c.STATUS_OK


# --- token ids --------------------------------------------------------------------------------------
def mask_runs(mask: Sequence[object]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask value: ``[(start, end, value)]`` with value 0 or 1."""
    out: list[tuple[int, int, int]] = []
    start = 0
    prev: int | None = None
    for j, m in enumerate(mask):
        v = 1 if m else 0
        if prev is None:
            prev = v
        elif v != prev:
            out.append((start, j, prev))
            start, prev = j, v
    if prev is not None:
        out.append((start, len(mask), prev))
    return out


def lazy_text(tokenizer: object, ids: Sequence[int]) -> Deferred:
    """Text of ``ids`` decoded only if the episode is kept (a ``Deferred`` for the exporter).

    The ids are copied now (the caller may reuse its buffers). Decoding runs on the export
    thread with a private copy of the tokenizer (a fast tokenizer used from two threads at once
    can fail in the training thread) and keeps special tokens, so chat markers and tool tags stay
    visible.
    """
    info = tokenizer_info(tokenizer)  # learned once per tokenizer, on the calling thread
    ids = [int(t) for t in ids]

    def decode() -> str:
        decoded: str = info.decoder.decode(ids, skip_special_tokens=False)
        return decoded

    # Deferred.__init__ is untyped in _core.content (it takes any zero-argument callable)
    return Deferred(decode)  # type: ignore[no-untyped-call]


# --- time the framework measured -----------------------------------------------------------------
def seconds(value: object) -> float | None:
    """``value`` as a duration in seconds when it is one (a finite number ≥ 0, numpy/torch
    scalars too), else None: a framework's missing, NaN, infinite (AReaL's ``float("inf")``
    default) or negative time is "not measured", never a number made up for it."""
    number, _ = as_float(value, "seconds")
    if number is None or not math.isfinite(number) or number < 0:
        return None
    return float(number)


def set_times(ep: _AttributeTarget, duration: object = None, stages: Mapping[str, object] | None = None) -> None:
    """Write what the framework measured on the episode's root: ``rl.duration.seconds`` (its
    wall time) and ``rl.stage.<stage>.seconds`` for each stage of ``conventions.STAGES`` it
    timed. An adapter records after the fact, so its root span's own duration is not the
    rollout's: only these say how long it took. Values that are not durations are left out
    (absent means "not measured"); a stage outside ``STAGES`` is a bug in the adapter."""
    total = seconds(duration)
    if total is not None:
        ep.set_attribute(c.RL_DURATION_SECONDS, total)
    for stage, value in (stages or {}).items():
        if stage not in c.STAGES:
            raise ValueError(f"not a stage: {stage!r} (conventions.STAGES)")
        number = seconds(value)
        if number is not None:
            ep.set_attribute(c.stage_seconds(stage), number)


def set_span_attribute(handle: object, key: str, value: object) -> None:
    """Set an attribute on the span of an episode-API handle (a turn, tool call, generation:
    each is its span); a handle that records nothing is let be."""
    if isinstance(handle, SpanRecord) and handle.episode is not None and value is not None:
        handle.attributes[key] = value


def turns_from_mask(
    ep: Episode,
    token_ids: Sequence[int],
    mask: Sequence[object],
    tokenizer: object,
    *,
    model: str | None = None,
    finish_reason: object = None,
    on_observation: Callable[[Turn, int, Deferred | str], None] | None = None,
    feedback_role: str = "environment",
) -> int:
    """Record a response of concatenated turns as turns; returns how many.

    ``mask`` 1 = policy tokens, 0 = observation tokens (tool output, environment feedback) the
    framework inserted into the response. Each run of policy tokens becomes a turn with a
    generation; the observation run after it becomes ``on_observation(turn, k, text)`` (e.g. a
    tool call paired with the framework's k-th tool record) or ``turn.feedback(text,
    feedback_role)``. Text is decoded only if the episode is kept; without a tokenizer only the
    token counts are recorded.
    """
    runs = mask_runs(mask)
    ids = list(token_ids)

    def text(start: int, end: int) -> Deferred | str:
        return lazy_text(tokenizer, ids[start:end]) if tokenizer is not None else ""

    turns = observations = 0
    j = 0
    while j < len(runs):
        start, end, value = runs[j]
        with ep.turn() as turn:
            turns += 1
            if value == 1:
                last = j + 1 >= len(runs) or (j + 2 >= len(runs) and runs[j + 1][2] == 0)
                turn.record_generation(
                    {"role": "assistant", "content": text(start, end)},
                    model=model,
                    finish_reason=finish_reason if last else None,
                    output_tokens=end - start,
                )
                j += 1
                if j >= len(runs):
                    break
                start, end, value = runs[j]
            observation = text(start, end)
            if on_observation is not None:
                on_observation(turn, observations, observation)
            else:
                turn.feedback(observation, role=feedback_role)
            observations += 1
            j += 1
    return turns


def replay_messages(ep: Episode, messages: Sequence[object], *, model: str | None = None,
                    finish_reason: object = None) -> int:
    """Record an OpenAI-style conversation: the messages before the first assistant message are
    the prompt; each assistant message opens a turn (its ``tool_calls`` become tool spans, the
    ``tool`` messages answering them their results); other messages are feedback. Returns the
    number of turns. The messages are snapshotted (later mutation does not leak in)."""
    msgs = [m if isinstance(m, Mapping) else {"role": "user", "content": _text(m)} for m in messages]
    msgs = snapshot([dict(m) for m in msgs])
    first = next((k for k, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
    ep.prompt(msgs[:first])
    assistants = [k for k, m in enumerate(msgs) if m.get("role") == "assistant"]
    turns = 0
    for a, k in enumerate(assistants):
        message = msgs[k]
        end = assistants[a + 1] if a + 1 < len(assistants) else len(msgs)
        results = {m.get("tool_call_id"): m for m in msgs[k + 1:end] if m.get("role") == "tool"}
        with ep.turn() as turn:
            turns += 1
            calls = message.get("tool_calls") or []
            content = {key: v for key, v in message.items() if key != "tool_calls"}
            turn.record_generation(content, model=model, tool_calls=calls or None,
                                   finish_reason=finish_reason if a == len(assistants) - 1 else None)
            used = set()
            for n_call, call in enumerate(calls):
                call = call if isinstance(call, Mapping) else {}
                nested = call.get("function")
                fn: Mapping[str, object] = nested if isinstance(nested, Mapping) else {}
                call_id = call.get("id") or f"call_{n_call}"
                handle = turn.tool_call(_text(fn.get("name") or call.get("name") or "tool"),
                                        arguments=fn.get("arguments"), call_id=_text(call_id))
                answer = results.get(call_id)
                if answer is not None:
                    used.add(call_id)
                handle.result("" if answer is None else answer.get("content"))
            for m in msgs[k + 1:end]:
                if m.get("role") == "tool" and m.get("tool_call_id") in used:
                    continue
                turn.feedback(m.get("content"), role=_text(m.get("role") or "environment"))
    return turns
