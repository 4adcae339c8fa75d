"""A step's samples recorded as columns: ``otr.record_batch``.

    summary = otr.record_batch(
        len(rewards), step=step, rewards=rewards, group_ids=prompt_ids, statuses=statuses,
        record=lambda i, ep: ep.prompt(prompts[i]) or ep.turn().record_generation(completions[i]),
    )

Frameworks hold a step's rollouts as columns (per-sample rewards, group ids, statuses, texts).
Recording them one ``otr.episode`` at a time costs every sample an episode object, spans, ids
and a sampler offer, although the tail sampler keeps a few dozen of thousands. Here the sampler
is offered the batch as columns, in one call (``sampling.batch``): it picks the rows it could
still keep, and only those are recorded as episodes; ``record(i, episode)`` adds a row's content
(prompt, turns, tool calls) to its episode, so content is built only for those rows. The rest
are counted in one update. What is kept is exactly what the per-episode API would have kept.

``record_token_batch`` (token-id tensors) records through the same path.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import exception_text, text, type_name
from otel_rollouts._core.guard import InvalidValue, guarded_or, report, takes_instance
from otel_rollouts._core.logprobs import (
    MismatchOptions,
    RowTotals,
    TokenView,
    read_array,
    read_tokens,
    row_totals,
)
from otel_rollouts._core.spans import EpisodeRecord
from otel_rollouts._core.values import to_float, to_int
from otel_rollouts.record.episode import (
    Episode,
    claim_trace_id,
    flag,
    new_episode_id,
    repeated_note,
    status_value,
    trace_id_int,
)
from otel_rollouts.sampling.batch import BatchRow, RowBatch

__all__ = ["record_batch", "BatchSummary", "Rows"]

Recorder = Callable[[int, Episode], None]


@dataclass
class BatchSummary:
    """What ``record_batch`` did with a batch."""

    offered: int = 0  # samples offered to the tail sampler
    recorded: int = 0  # samples recorded as episodes (the sampler's candidates)
    failed: list[tuple[int, str]] = field(default_factory=list)  # (sample, reason): record() raised
    problems: list[str] = field(default_factory=list)  # batch-level notes (e.g. misaligned columns)


@dataclass
class Rows:
    """The per-sample columns of one batch, aligned (one value per sample, None: none).

    Internal form shared by ``record_batch`` and ``record_token_batch``: ``statuses`` are the
    final ``rl.status`` of each sample (None: ``ok``), ``finish_reasons`` as given."""

    size: int
    step: int | None
    split: str = "train"
    rewards: Sequence[Any] | None = None
    advantages: Sequence[Any] | None = None
    group_ids: Sequence[Any] | None = None
    sample_indices: Sequence[Any] | None = None
    episode_ids: Sequence[Any] | None = None
    policy_versions: Sequence[Any] | None = None
    dataset_indices: Sequence[Any] | None = None
    durations: Sequence[Any] | None = None  # seconds each sample ran, as the framework measured
    statuses: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    dataset_name: str | list[Any] | None = None  # one name, or one per sample
    framework: str | None = None
    metadata: Mapping[str, Any] | Sequence[Any] | None = None  # one mapping, or one per sample
    # statistics computed for the whole batch at once (attribute -> float array, NaN: none), e.g.
    # the train–inference mismatch: what the sampler may rank by
    scores: Mapping[str, Any] | None = None

    def episode(self, i: int, episode_id: str | None) -> Episode:
        """Sample ``i``'s episode, as ``otr.episode`` would make it."""
        meta = self.metadata
        if meta is not None and not isinstance(meta, Mapping):
            meta = meta[i]
        name = self.dataset_name
        if isinstance(name, list):
            name = name[i]
        return Episode(
            self.step, self.split,
            group_id=_at(self.group_ids, i),
            sample_index=i if _at(self.sample_indices, i) is None else _at(self.sample_indices, i),
            policy_version=_at(self.policy_versions, i),
            episode_id=episode_id,
            dataset_name=name,
            dataset_index=_at(self.dataset_indices, i),
            framework=self.framework,
            metadata=meta,
        )


def _at(column: Sequence[Any] | None, i: int) -> Any:
    return None if column is None else column[i]


def _seconds(column: Sequence[Any]) -> list[float | None]:
    """Measured durations: a finite non-negative float, else None (not measured)."""
    return [v if v is not None and v >= 0 else None for v in _floats(column)]


def _floats(column: Sequence[Any]) -> list[float | None]:
    """What ``Episode.reward`` records of each value: a finite float, else None (refused)."""
    return [v if type(v) is float and v - v == 0.0 else None if v is None else to_float(v, "value")[0]
            for v in column]


def record_rows(rows: Rows, build: Callable[[int, Episode], None]) -> tuple[int, list[tuple[int, str]]]:
    """Offer ``rows`` to the tail sampler as a batch and record the episodes of the rows it
    may keep, ``build(i, episode)`` adding each one's spans. Returns (episodes recorded,
    [(sample, reason)] where ``build`` raised). A policy that must read whole records (it needs
    an attribute the columns lack) gets every sample as an ``otr.episode``, as before."""
    rt = _runtime.current()
    if not rt.enabled or rt.pipeline is None or rows.size <= 0:
        return 0, []
    pipeline = rt.pipeline
    step = rt.current_step if rows.step is None else to_int(rows.step, "step")[0]
    step = rt.current_step if step is None or step < 0 else step
    split = text(rows.split) if rows.split is not None else "train"
    episode_ids: list[str | None] = [None] * rows.size
    if rows.episode_ids is not None:
        episode_ids = [None if v is None else text(v) for v in rows.episode_ids]

    repeated: dict[int, str] = {}  # sample -> its rl.invalid note (a repeated episode id)

    def trace_id_of(i: int) -> int:
        if not rt.deterministic_ids:
            return _runtime.new_id128()
        episode_id = episode_ids[i]
        if episode_id is None:
            episode_id = episode_ids[i] = new_episode_id(step)
        trace_id, n = claim_trace_id(
            rt, trace_id_int(rt.run_id, step, episode_id), (step, split),
            lambda n: trace_id_int(rt.run_id, step, f"{episode_id}#{n}"),
        )
        if n:
            repeated[i] = repeated_note(episode_id, step, n)
        return trace_id

    columns: dict[str, Any] = {}
    made: list[list[float | None]] = []  # the reward column, made once for the two columns that read it

    def rewards() -> list[float | None]:
        if not made:
            made.append(_floats(rows.rewards or ()))
        return made[0]

    if rows.rewards is not None:
        columns[c.RL_REWARD] = rewards
    if rows.advantages is not None:
        columns[c.RL_ADVANTAGE] = lambda: _floats(rows.advantages or ())
    columns[c.RL_STATUS] = _statuses(rows, rewards)
    if rows.dataset_indices is not None:  # the watch list's key
        columns[c.RL_DATASET_INDEX] = rows.dataset_indices
    if rows.durations is not None:  # what the slowest part ranks by
        columns[c.RL_DURATION_SECONDS] = lambda: _seconds(rows.durations or ())
    columns[c.RL_GROUP_ID] = lambda: [None if g is None else text(g) for g in (rows.group_ids or [None] * rows.size)]
    columns[c.RL_SAMPLE_INDEX] = lambda: [
        i if v is None else to_int(v, "sample_index")[0]
        for i, v in enumerate(rows.sample_indices or [None] * rows.size)
    ]
    if rows.scores:
        columns.update(rows.scores)
    batch = RowBatch(step, split, rows.size, columns, trace_id_of)
    chosen = pipeline.offer_batch(batch)

    failed: list[tuple[int, str]] = []
    if chosen is None:  # every sample as an episode, offered one by one
        recorded = 0
        for i in range(rows.size):
            ep = rows.episode(i, episode_ids[i])
            with ep:
                if _build(build, i, ep, failed):
                    recorded += 1
        return recorded, failed
    recorded_rows: list[tuple[BatchRow, EpisodeRecord | None]] = []
    try:
        for row in chosen:
            ep = rows.episode(row.index, episode_ids[row.index])
            record = ep.begin_offered(rt, row.trace_id)
            if record is not None and record.root is not None:
                note = repeated.get(row.index)
                if note is not None:
                    flag(record.root, note)
                if not _build(build, row.index, ep, failed):
                    record = None
                else:
                    ep.end()
            recorded_rows.append((row, record))
    finally:
        # the user's own KeyboardInterrupt / SystemExit from ``build`` goes on to the user, but
        # first every row the sampler holds or kept gets its end: the rows recorded so far are
        # attached as usual, the rest as failed (dropped under ``batch_record_failed`` if
        # chosen), so no row is left held for an episode that will never come
        recorded_rows.extend((row, None) for row in chosen[len(recorded_rows):])
        pipeline.attach(recorded_rows)
    return sum(1 for _, r in recorded_rows if r is not None), failed


def _build(build: Callable[[int, Episode], None], i: int, ep: Episode, failed: list[tuple[int, str]]) -> bool:
    try:
        build(i, ep)
        return True
    except InvalidValue:
        raise
    except Exception as exc:  # noqa: BLE001 - one bad sample never stops the batch
        # the message may quote the sample's content: left out when content is not captured
        record = ep._record
        shown = record is None or record.capture_content
        reason = f"sample {i}: {type_name(exc)}" + (f": {exception_text(exc)}" if shown else "")
        failed.append((i, reason))
        report(f"record_batch: {reason}", exc=exc if shown else None)  # no traceback text either
        return False


def _statuses(rows: Rows, rewards: Callable[[], list[float | None]]) -> Callable[[], list[Any]]:
    """The status column the sampler reads: as given (``ok`` where none is), and ``error`` where
    an ``ok`` sample's reward is refused (NaN, infinite, not a number), as ``Episode.reward``
    records it on the sample's root: the group counts it lost, the sampler sees a broken episode.
    ``rewards``: the reward column (made once, shared with the sampler's reward column)."""
    def column() -> list[Any]:
        given = rows.statuses() if callable(rows.statuses) else rows.statuses
        if given is None:
            statuses = [c.STATUS_OK] * rows.size
        else:
            statuses = [status_value(s) or c.STATUS_OK for s in given]
        raw = rows.rewards
        if raw is not None:
            for i, (value, number) in enumerate(zip(raw, rewards(), strict=True)):
                if number is None and value is not None and statuses[i] == c.STATUS_OK:
                    statuses[i] = c.STATUS_ERROR
        return statuses

    return column


def _column(name: str, value: Any, size: int, problems: list[str]) -> list[Any] | None:
    """A per-sample column aligned to the batch: a short or long one is cut or padded with
    None, and noted. A single value (a 0-d tensor or array, a number, a string: anything that
    is not a sequence of values) is the same for every sample: broadcast, and noted, never a
    reason to lose the batch."""
    if value is None:
        return None
    tolist = getattr(value, "tolist", None)  # numpy arrays, torch tensors: plain values
    plain = tolist() if callable(tolist) else value
    if isinstance(plain, (str, bytes, Mapping)) or not isinstance(plain, Iterable):
        problems.append(f"{name}: one value for {size} samples (a 0-d or scalar column), broadcast")
        return [plain] * size
    column = list(plain)
    if len(column) != size:
        problems.append(f"{name}: {len(column)} values for {size} samples (alignment partial)")
        column = (column + [None] * size)[:size]
    return column


@takes_instance
@guarded_or(BatchSummary)
def record_batch(
    size: int,
    *,
    step: int | None = None,
    split: str = "train",
    rewards: Any = None,
    advantages: Any = None,
    reward_components: Mapping[str, Any] | None = None,
    group_ids: Any = None,
    sample_indices: Any = None,
    episode_ids: Any = None,
    policy_versions: Any = None,
    statuses: Any = None,
    finish_reasons: Any = None,
    dataset_name: str | Sequence[str | None] | None = None,
    dataset_indices: Any = None,
    durations: Any = None,
    framework: str | None = None,
    metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    record: Recorder | None = None,
    logprobs: Any = None,
    trainer_logprobs: Any = None,
    logprob_masks: Any = None,
    response_tokens: Any = None,
    tokenizer: Any = None,
    rollouts: _runtime.Runtime | None = None,
) -> BatchSummary:
    """Record ``size`` finished episodes of one step from per-sample columns; the tail sampler
    chooses in one call and only the samples it may keep are recorded as episodes.

    Each column holds one value per sample (a list, a numpy array or a tensor); None: none.
    ``reward_components``: name -> column. ``statuses``: ``ok``/``error``/``truncated``
    (``truncated`` is also inferred from a ``length`` finish reason). ``dataset_name`` and
    ``metadata``: one for all samples, or one per sample. ``durations``: seconds each sample
    ran, as the framework measured them (``rl.duration.seconds``, what the ``slowest`` part
    ranks by; without them a batch row has no duration). ``record(i, episode)`` records sample
    ``i``'s content (``episode.prompt``, ``episode.turn()``...) and is called only for the
    samples that may be kept, before the columns' reward and finish are recorded (the spans read
    in the order an episode made them); an exception from it is reported naming the sample, and
    that sample is not recorded. Returns a ``BatchSummary``.

    Every sample ends counted, per step: kept, or dropped under a named reason (a sample whose
    ``record`` raised is ``dropped.batch_record_failed`` if the sampler chose it). A
    ``KeyboardInterrupt`` or ``SystemExit`` raised by ``record`` is the user's own and goes on
    to the caller, after the batch was settled: the samples recorded so far are kept or dropped
    as usual, the rest dropped under ``batch_record_failed``; nothing is left held. A column
    given as one value (a 0-d tensor, a number) is broadcast to every sample, and noted in
    ``problems``. With ``deterministic_ids``, a repeated episode id gets its own trace id
    (counted ``duplicate_id``, flagged in ``rl.invalid``).

    ``logprobs`` / ``trainer_logprobs``: per sample, the inference engine's and the trainer's
    logprob of each response token: a 2-D ``[B, R]`` tensor or array (``logprob_masks``
    ``[B, R]``, 1 = counted, marks the real tokens; NaN counts as unknown) or one 1-D sequence
    (or None) per sample. With both, every sample's train–inference mismatch (``rl.mismatch.*``)
    is computed in one vectorised pass; a recorded sample gets it on its root and on the last
    generation ``record`` made, with its worst tokens (rendered only if kept); when ``record``
    recorded its generations' own logprobs (``Generation.output``), on its root only.
    ``response_tokens``: the same tokens' texts or ids (ids decoded with ``tokenizer``, for the
    worst few tokens of kept samples only, on the export thread, with a private copy).

    ``rollouts``: the instance to record into (``otr.configure(install=False)``); default: the
    one active in this context (``Rollouts.activate()``), else the installed one.
    """
    summary = BatchSummary()
    n, problem = to_int(size, "size")
    if n is None or n < 0:
        report(f"record_batch: {problem or f'size: negative ({size})'}")
        return summary
    problems = summary.problems
    rewards_col = _column("rewards", rewards, n, problems)
    advantages_col = _column("advantages", advantages, n, problems)
    components = {str(k): _column(f"reward_components.{k}", v, n, problems)
                  for k, v in (reward_components or {}).items()} if isinstance(reward_components, Mapping) else {}
    finish_col = _column("finish_reasons", finish_reasons, n, problems)
    status_col = _column("statuses", statuses, n, problems)
    if finish_col is not None:  # a sample cut at the length limit is truncated
        status_col = [
            (s if s is not None else c.STATUS_TRUNCATED if f == "length" else None)
            for s, f in zip(status_col or [None] * n, finish_col, strict=True)
        ]
    meta: Any = metadata
    if metadata is not None and not isinstance(metadata, Mapping):
        meta = _column("metadata", metadata, n, problems)
    names: Any = dataset_name
    if isinstance(dataset_name, (list, tuple)) or hasattr(dataset_name, "tolist"):
        names = _column("dataset_name", dataset_name, n, problems)
    for note in problems:
        report(f"record_batch: {note}")
    rows = Rows(
        n, step, split,
        rewards=rewards_col, advantages=advantages_col,
        group_ids=_column("group_ids", group_ids, n, problems),
        sample_indices=_column("sample_indices", sample_indices, n, problems),
        episode_ids=_column("episode_ids", episode_ids, n, problems),
        policy_versions=_column("policy_versions", policy_versions, n, problems),
        dataset_indices=_column("dataset_indices", dataset_indices, n, problems),
        durations=_column("durations", durations, n, problems),
        statuses=status_col, dataset_name=names, framework=framework, metadata=meta,
    )

    mismatch = _BatchMismatch.of(logprobs, trainer_logprobs, logprob_masks, response_tokens, tokenizer,
                                 n, problems) if logprobs is not None and trainer_logprobs is not None else None
    rows.scores = None if mismatch is None else mismatch.totals.columns()

    def build(i: int, ep: Episode) -> None:
        if record is not None:
            record(i, ep)
        if mismatch is not None:
            mismatch.record(i, ep)
        comps = {k: col[i] for k, col in components.items() if col is not None and col[i] is not None}
        reward, advantage = _at(rewards_col, i), _at(advantages_col, i)
        if reward is not None or advantage is not None or comps:
            ep.reward(reward, components=comps or None, advantage=advantage)
        finish, status = _at(finish_col, i), _at(status_col, i)
        if finish is not None or status is not None:
            ep.finish(reason=finish, status=status)
        if rows.durations is not None:
            seconds = _seconds([rows.durations[i]])[0]
            if seconds is not None:
                ep.set_attribute(c.RL_DURATION_SECONDS, seconds)

    summary.offered = n
    summary.recorded, summary.failed = record_rows(rows, build)
    return summary


class _BatchMismatch:
    """``record_batch``'s train–inference mismatch: every sample's statistics from one vectorised
    pass, and a recorded sample's attributes and (copied) logprobs for its last generation."""

    def __init__(self, rollout: Any, trainer: Any, counted: Any, starts: Any, tokens: Any,
                 tokenizer: Any, totals: RowTotals, options: MismatchOptions) -> None:
        self.rollout, self.trainer, self.counted, self.starts = rollout, trainer, counted, starts
        self.tokens, self.decode = tokens, PrivateDecoder(tokenizer) if tokenizer is not None else None
        self.totals, self.options = totals, options

    @classmethod
    def of(cls, logprobs: Any, trainer_logprobs: Any, masks: Any, tokens: Any, tokenizer: Any,
           n: int, problems: list[str]) -> _BatchMismatch | None:
        import numpy as np

        options = _runtime.current().mismatch
        # one array for the batch; a list of sequences of different lengths is read per sample
        rollout, _ = read_array(logprobs, "logprobs")
        trainer, _ = read_array(trainer_logprobs, "trainer_logprobs")
        if rollout is not None and trainer is not None and rollout.ndim == 2:
            given, problem = read_array(masks, "logprob_masks")
            counted = np.ones(rollout.shape, dtype=bool) if given is None else given != 0
            if problem is not None or rollout.shape != trainer.shape or counted.shape != rollout.shape or rollout.shape[0] != n:
                problems.append(f"logprobs: shapes {rollout.shape}, {trainer.shape}, {counted.shape} for "
                                f"{n} samples: no mismatch recorded")
                report(f"record_batch: {problems[-1]}")
                return None
            return cls(rollout, trainer, counted, None, tokens, tokenizer,
                       row_totals(rollout, trainer, counted, options), options)
        lists = [_column(name, v, n, problems) for name, v in
                 (("logprobs", logprobs), ("trainer_logprobs", trainer_logprobs), ("logprob_masks", masks))]
        parts: list[list[Any]] = [[], [], []]
        lengths = np.zeros(n, dtype=np.int64)
        before = len(problems)
        for i in range(n):
            r, p1 = read_tokens(_at(lists[0], i), "logprobs")
            t, p2 = read_tokens(_at(lists[1], i), "trainer_logprobs")
            m, p3 = read_tokens(_at(lists[2], i), "logprob_masks")
            problem = p1 or p2 or p3
            if problem is not None:  # that sample has no mismatch, said so
                problems.append(f"sample {i}: {problem}")
                continue
            if r is None or t is None or r.size != t.size or (m is not None and m.size != r.size):
                if r is not None and t is not None:
                    problems.append(f"sample {i}: logprobs has {r.size} values, trainer_logprobs {t.size}"
                                    + ("" if m is None else f", logprob_masks {m.size}") + ": no mismatch recorded")
                continue
            parts[0].append(r.reshape(-1).astype(np.float32, copy=False))
            parts[1].append(t.reshape(-1).astype(np.float32, copy=False))
            parts[2].append(np.ones(r.size, dtype=bool) if m is None else m.reshape(-1) != 0)
            lengths[i] = r.size
        starts = np.zeros(n, dtype=np.int64)
        if n > 1:
            starts[1:] = np.cumsum(lengths)[:-1]
        flat = [np.concatenate(p) if p else np.zeros(0, dtype=np.float32) for p in parts]
        flat[2] = flat[2].astype(bool)
        for note in problems[before:]:
            report(f"record_batch: {note}")
        return cls(flat[0], flat[1], flat[2], (starts, lengths), tokens, tokenizer,
                   row_totals(flat[0], flat[1], flat[2], options, starts=starts), options)

    def record(self, i: int, ep: Episode) -> None:
        totals = self.totals.row(i)
        record = ep._record
        if totals.n <= 0 or record is None or record.root is None:
            return
        record.root.attributes.update(totals.attributes(self.options))
        own = record.mismatch is not None  # ``record`` gave the generations their own statistics
        record.mismatch = totals
        span = next((s for s in reversed(record.spans) if s.kind == c.KIND_GENERATION), None)
        if span is None or own:
            return
        span.attributes.update(totals.attributes(self.options))
        if not (self.options.top_tokens and record.capture_content):
            return
        if self.starts is None:
            rollout, trainer, counted = (x[i].copy() for x in (self.rollout, self.trainer, self.counted))
        else:
            lo = int(self.starts[0][i])
            hi = lo + int(self.starts[1][i])
            rollout, trainer, counted = (x[lo:hi].copy() for x in (self.rollout, self.trainer, self.counted))
        tokens = _at(self.tokens, i) if self.tokens is not None else None
        if tokens is not None:
            tolist = getattr(tokens, "tolist", None)
            tokens = tolist() if callable(tolist) else list(tokens)
        view = TokenView(rollout, trainer, counted, self.options.top_tokens, tokens, self.decode)
        span.attributes.update(view.attributes())


class PrivateDecoder:
    """Token ids to texts with a private copy of the tokenizer, made on first use (the export
    thread): a fast tokenizer used from two threads at once can raise in the training thread."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self._lock = tokenizer, threading.Lock()
        self._copy: Any = None

    def __call__(self, ids: list[int]) -> list[str]:
        with self._lock:
            if self._copy is None:
                try:
                    self._copy = copy.deepcopy(self.tokenizer)
                except Exception:  # noqa: BLE001 - an uncopyable tokenizer is used as it is
                    self._copy = self.tokenizer
            return [str(self._copy.decode([i])) for i in ids]
