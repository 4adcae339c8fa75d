"""Tinker cookbook: preference, multiplayer and prompt-only distillation groups as linked episodes.

The three kinds whose reward is not one trajectory's own business:

* **preference** (``rl/preference_envs.py``: ``PairwisePreferenceGroupBuilder``): each
  ``PreferenceEnv`` answers once with reward 0; ``compute_group_rewards`` pairs the answers
  (``tournament_pattern``, in chunks of ``matchup_group_size``), asks the preference model for
  each pair (a float in [-1, 1], positive: the second answer, B, preferred) and gives each answer
  ``win_minus_loss`` (mean over its matchups) + ``format − 1``. The ``TrajectoryGroup`` keeps
  only those two numbers (``metrics_G``): which pairs were compared follows from the builder's
  pattern; what the model said about each pair is kept only when the preference model was
  wrapped in ``PreferenceVerdicts`` (the cookbook logs it to its logtree, nowhere else).
* **multiplayer** (``recipes/multiplayer_rl/text_arena``: ``TwoPlayerEnvGroupBuilder``): with
  ``self_play`` its environments come in games of ``num_players`` consecutive players sharing
  one coordinator (``make_envs``): trajectory ``t`` is player ``t % num_players`` of game
  ``t // num_players``. Without self-play each player meets a fixed opponent (no trace of its
  own): one game per trajectory.
* **prompt-only distillation** (``distillation/datasets.py``: ``PromptOnlyEnv``, reward 0;
  ``distillation/train_on_policy.py``: ``incorporate_kl_penalty``): the teacher scores the
  student's answer by its own log-probabilities of the sampled tokens; the advantage is
  ``−kl_penalty_coef × (student − teacher logprob)``. The cookbook keeps only the batch mean
  (``teacher_kl``): the per-answer score is read from the teacher client wrapped in
  ``TeacherLogprobs``.

All episodes of one group are begun before any is recorded, so each knows the others' trace ids
and root spans: a preference answer's reward span names its opponents and links to them, a
player's root names and links to the other players. The episodes of a preference chunk or a
game share ``rl.companions.id``: the tail sampler keeps them together.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from otel_rollouts import Episode
from otel_rollouts import conventions as c
from otel_rollouts import episode as new_episode
from otel_rollouts.adapters import _tinker_groups as _tinker
from otel_rollouts.adapters._messages import record_assistant, token_count, token_ids
from otel_rollouts.adapters.kit import (
    COUNT_FILTERED,
    Columns,
    InvalidValue,
    as_float,
    check_release,
    count,
    exception_text,
    field,
    guarded_or,
    mark_invalid,
    mark_partial,
    report,
    set_policy,
    to_list,
    warn_unknown,
)

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

__all__ = [
    "PreferenceVerdicts",
    "TeacherLogprobs",
    "kind_of",
    "record_distillation_groups",
    "record_multiplayer_groups",
    "record_preference_groups",
]

PREFERENCE, MULTIPLAYER, DISTILLATION = "preference", "multiplayer", "distillation"
_ADAPTER = _tinker.ADAPTER
_MAX_REMEMBERED = 4096  # prompts (verdicts) / sequences (teacher logprobs) kept for the adapter


# --- what the cookbook does not keep: recorded where it is computed --------------------------
class PreferenceVerdicts:
    """A preference model that remembers each verdict for the adapter (wraps the cookbook's
    ``PreferenceModel``; pass it as the builder's ``preference_model``).

    ``compute_group_rewards`` asks for the pairs of one group in order, with the group's own
    ``convo_prefix`` list as the comparison's ``prompt_conversation``: verdicts are kept per that
    list (identity), in call order, for the last 4096 prompts."""

    def __init__(self, model: Callable[..., Awaitable[float]]) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._calls: OrderedDict[int, tuple[object, list[tuple[object, float]]]] = OrderedDict()

    async def __call__(self, comparison: object) -> float:
        verdict = await self.model(comparison)
        try:
            prompt = field(comparison, "prompt_conversation")
            with self._lock:
                entry = self._calls.get(id(prompt))
                if entry is None or entry[0] is not prompt:
                    entry = self._calls[id(prompt)] = (prompt, [])
                    while len(self._calls) > _MAX_REMEMBERED:
                        self._calls.popitem(last=False)
                entry[1].append((comparison, verdict))
        except Exception as exc:  # noqa: BLE001 - never in the way of the reward
            report(f"tinker adapter: PreferenceVerdicts: {exception_text(exc)}", exc=exc)
        return verdict

    def take(self, prompt: object) -> list[tuple[object, float]] | None:
        """The (comparison, verdict) pairs asked with ``prompt``, in order (forgotten then)."""
        with self._lock:
            entry = self._calls.get(id(prompt))
            if entry is None or entry[0] is not prompt:
                return None
            del self._calls[id(prompt)]
            return entry[1]

    def __getattr__(self, name: str) -> Any:  # a stand-in for the wrapped model: its attributes
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


class _Future(Protocol):
    """What ``_Pending`` reads of a ``tinker`` ``APIFuture`` of logprobs."""

    def coroutine(self) -> Awaitable[Iterable[object]]: ...

    def result(self, *args: object, **kwargs: object) -> Iterable[object]: ...


_Keep = Callable[[Iterable[object]], Iterable[object]]


class _Pending:
    """``compute_logprobs``'s future, its result remembered when it arrives."""

    def __init__(self, future: _Future, keep: _Keep) -> None:
        self._future, self._keep = future, keep

    async def coroutine(self) -> Iterable[object]:
        return self._keep(await self._future.coroutine())

    def result(self, *args: object, **kwargs: object) -> Iterable[object]:
        return self._keep(self._future.result(*args, **kwargs))

    def __getattr__(self, name: str) -> object:
        return getattr(self._future, name)


class TeacherLogprobs:
    """A teacher sampling client that remembers the log-probabilities it computed, per token
    sequence, for the adapter (wraps a ``tinker.SamplingClient``; ``compute_logprobs`` (0.6) and
    ``compute_logprobs_async`` (0.5) as the cookbook calls them). ``name``: the teacher's name
    on the episodes (default: the client's ``model_name`` / ``base_model`` when it has one)."""

    def __init__(self, client: object, name: str | None = None) -> None:
        self.client: Any = client  # duck-typed: compute_logprobs (0.6) or compute_logprobs_async (0.5)
        self.name = name or field(client, "model_name", "base_model")
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[int, ...], list[object]] = OrderedDict()

    def _remember(self, model_input: object) -> _Keep:
        ids = token_ids(model_input)

        def keep(logprobs: Iterable[object]) -> Iterable[object]:
            try:
                if ids is not None:
                    with self._lock:
                        self._seen[tuple(ids)] = list(logprobs)
                        while len(self._seen) > _MAX_REMEMBERED:
                            self._seen.popitem(last=False)
            except Exception as exc:  # noqa: BLE001 - never in the way of training
                report(f"tinker adapter: TeacherLogprobs: {exception_text(exc)}", exc=exc)
            return logprobs

        return keep

    def compute_logprobs(self, model_input: object, *args: object, **kwargs: object) -> _Pending:
        return _Pending(self.client.compute_logprobs(model_input, *args, **kwargs),
                        self._remember(model_input))

    async def compute_logprobs_async(self, model_input: object, *args: object, **kwargs: object
                                     ) -> Iterable[object]:
        keep = self._remember(model_input)
        return keep(await self.client.compute_logprobs_async(model_input, *args, **kwargs))

    def logprobs(self, ids: Sequence[int]) -> list[object] | None:
        with self._lock:
            return self._seen.get(tuple(ids))

    def __getattr__(self, name: str) -> Any:  # a stand-in for the wrapped client: its attributes
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)


# --- which kind ----------------------------------------------------------------------------------
def kind_of(group: object, *, teacher: object = None) -> str | None:
    """The kind of a group (a ``WrappedTrajectoryGroup``, or a group with its builder), or None
    for one ``record_trajectory_groups`` records itself. Distillation needs ``teacher``."""
    builder = field(group, "env_group_builder")
    if builder is not None and hasattr(builder, "preference_model") and hasattr(builder, "tournament_pattern"):
        return PREFERENCE
    if builder is not None and hasattr(builder, "self_play") and hasattr(builder, "num_players"):
        return MULTIPLAYER
    if teacher is not None:
        return DISTILLATION
    return None


# --- entry points -----------------------------------------------------------------------------
@guarded_or(list)
def record_preference_groups(trajectory_groups: Sequence[object], *, step: int, split: str = "train",
                             env_group_builders: Sequence[object] | None = None,
                             verdicts: PreferenceVerdicts | None = None, **options: Any) -> list[str]:
    """Record pairwise-preference groups: one episode per answer, its matchups on its reward
    span (opponents' trace ids, verdicts from its side, span links both ways). ``verdicts``:
    the ``PreferenceVerdicts`` the builders compared with (without it: pairs, no verdicts).
    ``env_group_builders``: the builders, when the groups are plain ``TrajectoryGroup``s.
    ``options``: as ``record_trajectory_groups`` (tokenizer, renderer, model, advantages,
    sampling_client_steps, taglist, num_substeps, group_start)."""
    return _record(PREFERENCE, trajectory_groups, step, split, env_group_builders,
                   {"verdicts": verdicts}, options)


@guarded_or(list)
def record_multiplayer_groups(trajectory_groups: Sequence[object], *, step: int, split: str = "train",
                              env_group_builders: Sequence[object] | None = None,
                              num_players: int | None = None, self_play: bool | None = None,
                              **options: Any) -> list[str]:
    """Record multiplayer groups: one episode per player, ``rl.game.*`` on its root, the game's
    players linked to each other and kept together. ``num_players`` / ``self_play`` override
    the builder's."""
    return _record(MULTIPLAYER, trajectory_groups, step, split, env_group_builders,
                   {"num_players": num_players, "self_play": self_play}, options)


@guarded_or(list)
def record_distillation_groups(trajectory_groups: Sequence[object], *, step: int, split: str = "train",
                               teacher: object = None, kl_penalty_coef: object = None,
                               env_group_builders: Sequence[object] | None = None,
                               **options: Any) -> list[str]:
    """Record prompt-only distillation groups: the student's answer, the teacher's score of it
    (``rl.distill.reverse_kl``: mean student − teacher logprob over the answer tokens, the
    cookbook's per-answer ``teacher_kl``) and both per-token logprobs on the reward span.
    ``teacher``: a ``TeacherLogprobs``, or one per group (``dataset_indices_P`` → teacher)."""
    return _record(DISTILLATION, trajectory_groups, step, split, env_group_builders,
                   {"teacher": teacher, "kl_penalty_coef": kl_penalty_coef}, options)


_OPTIONS = ("tokenizer", "renderer", "model", "advantages", "sampling_client_steps", "taglist",
            "num_substeps", "group_start")


def _record(kind: str, trajectory_groups: Iterable[object] | None, step: int, split: str,
            builders: Sequence[object] | None, extra: dict[str, Any], options: dict[str, Any]
            ) -> list[str]:
    # extra / options: keywords handed on to record_group's typed parameters, as given
    check_release(_ADAPTER, _tinker.FRAMEWORK, _tinker.TESTED)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        warn_unknown(_ADAPTER, "options", f"{', '.join(unknown)}: not options of this adapter, ignored")
    tokenizer, renderer = options.get("tokenizer"), options.get("renderer")
    if tokenizer is None and renderer is not None:
        tokenizer = getattr(renderer, "tokenizer", None)
    try:
        reader = _tinker._Reader(tokenizer, renderer)
    except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot be read: numbers only
        report(f"tinker adapter: tokenizer: {exception_text(exc)}", exc=exc)
        reader = _tinker._Reader(None, None)
    groups = list(trajectory_groups or [])
    per_group = Columns(len(groups), tags=options.get("taglist"),
                        versions=options.get("sampling_client_steps"),
                        advantages=options.get("advantages"), builders=builders)
    substeps = _tinker._substeps(options.get("num_substeps", 1))
    start = int(options.get("group_start") or 0)
    ids: list[str] = []
    for gi, group in enumerate(groups):
        if group is None:
            count(COUNT_FILTERED, step=step, split=split)
            continue
        try:
            ids.extend(record_group(kind, group, gi, start + gi, per_group, step=step, split=split,
                                    reader=reader, model=options.get("model"), substeps=substeps,
                                    **extra))
        except InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the training loop
            report(f"tinker adapter: {kind} group {start + gi}: {exception_text(exc)}", exc=exc)
    return ids


def record_group(kind: str, group: object, gi: int, g: int, per_group: Columns, *, step: int,
                 split: str, reader: _tinker._Reader, model: str | None, substeps: int,
                 verdicts: PreferenceVerdicts | None = None, num_players: object = None,
                 self_play: object = None, teacher: object = None, kl_penalty_coef: object = None
                 ) -> list[str]:
    """One group of ``kind`` (what ``record_trajectory_groups`` dispatches to)."""
    inner = field(group, "trajectory_group", default=group)
    trajectories = list(field(inner, "trajectories_G", "trajectories", default=[]) or [])
    builder = field(group, "env_group_builder", default=per_group.value("builders", gi))
    sampled = _tinker._version(field(group, "sampling_client_step",
                                     default=per_group.value("versions", gi)))
    version = None if sampled is None else sampled * substeps
    trained = step * substeps if split == "train" and sampled is not None else None
    cols = Columns(len(trajectories), final_rewards=field(inner, "final_rewards_G"),
                   metrics=field(inner, "metrics_G"),
                   advantages=to_list(per_group.value("advantages", gi)))
    group_id = f"{split}:{step}:{g}"
    tags = _tinker._tags(group, per_group, gi)
    episodes: list[Episode] = []
    ids: list[str] = []
    try:
        for t, trajectory in enumerate(trajectories):  # all begun first: their trace ids known
            episode_id = f"{group_id}:{field(trajectory, 'traj_idx', default=t)}"
            metadata: dict[str, object] = {}
            if tags is not None:
                metadata["tags"] = tags
            if cols.value("metrics", t):
                metadata["trajectory_metrics"] = dict(cols.value("metrics", t))
            ep = new_episode(step=step, split=split, group_id=group_id, sample_index=t,
                             episode_id=episode_id, framework=_tinker.FRAMEWORK,
                             metadata=metadata).start()
            set_policy(ep, version, trained)
            mark_partial(ep, cols.missing(t))
            episodes.append(ep)
            ids.append(episode_id)
        if kind == PREFERENCE:
            _preference(episodes, ids, trajectories, cols, builder, verdicts, reader, model, group_id)
        elif kind == MULTIPLAYER:
            _multiplayer(episodes, ids, trajectories, cols, builder, reader, model, group_id,
                         num_players, self_play)
        else:
            tutor = teacher
            if isinstance(teacher, (list, tuple)):
                tutor = teacher[gi] if gi < len(teacher) else None
            _distillation(episodes, trajectories, cols, tutor, kl_penalty_coef, reader, model)
    finally:
        for ep in episodes:
            ep.end()
    for r, error in enumerate(field(inner, "rollout_errors", default=[]) or []):
        episode_id = f"{group_id}:error{r}"
        _tinker._record_rollout_error(error, episode_id=episode_id, group_id=group_id, step=step,
                                      split=split, version=version, tags=tags, prompt=None)
        ids.append(episode_id)
    return ids


# --- one trajectory's content ----------------------------------------------------------------------
def _fill(ep: Episode, trajectory: object, t: int, cols: Columns, reader: _tinker._Reader,
          model: str | None, *, prompt: object = None, terms: Mapping[str, object] | None = None
          ) -> _Span | None:
    """Prompt, turns, status and reward of one trajectory into ``ep`` (begun, still open);
    returns the reward span (for what the kind adds to it)."""
    transitions = list(field(trajectory, "transitions", default=[]) or [])
    obs = [field(tr, "ob") for tr in transitions] + [field(trajectory, "final_ob")]
    ep.prompt(prompt if prompt is not None else reader.prompt(obs[0]))
    status, reason, parse_errors = c.STATUS_OK, None, []
    step_rewards: list[float] = []
    steps_meta: list[dict[str, object]] = []
    last = None  # the last transition's stop_reason
    for k, tr in enumerate(transitions):
        ac = field(tr, "ac")
        stop_reason = field(ac, "stop_reason")
        metrics = field(tr, "metrics", default={}) or {}
        reward, problem = as_float(field(tr, "reward"), f"transitions[{k}].reward")
        mark_invalid(ep, problem)
        meta = {"episode_done": field(tr, "episode_done"), "stop_reason": stop_reason,
                "metrics": dict(metrics) if isinstance(metrics, Mapping) else metrics,
                "logs": _tinker._plain(field(tr, "logs")), "reward": reward}
        steps_meta.append({key: v for key, v in meta.items() if v is not None})
        last = stop_reason
        if reward is not None:
            step_rewards.append(reward)
        message, errors = reader.action(ac, k)
        feedback = reader.feedback(obs[k], ac, obs[k + 1], bool(message.get("tool_calls")))
        with ep.turn() as turn:
            errors += record_assistant(_tinker.sampled(turn, ac), message, feedback, model=model,
                                       finish_reason=stop_reason,
                                       input_tokens=token_count(obs[k]),
                                       output_tokens=token_count(ac))
        parse_errors.extend(errors)
        status, reason = _tinker._worse((status, reason),
                                        _tinker._step_status(stop_reason, metrics, errors))
    ended = field(trajectory, "stop_reason")
    if ended is not None:
        status, reason = _tinker._worse((status, reason), _tinker._trajectory_status(ended))
    if not transitions:
        status, reason = c.STATUS_ERROR, "empty trajectory"
    ep.set_attribute(c.RL_TURN_COUNT, len(transitions))
    ep.set_attribute(c.RL_METADATA_PREFIX + "steps", steps_meta)
    if parse_errors:
        ep.set_attribute(c.RL_TOOL_PARSE_ERROR, parse_errors)
    final, problem = as_float(cols.value("final_rewards", t), f"final_rewards_G[{t}]")
    mark_invalid(ep, problem)
    components: dict[str, float] = {}
    for key, value in (terms or {}).items():
        number, _ = as_float(value)
        if number is not None:
            components[str(key)] = number
    components["transitions"] = sum(step_rewards)
    if final is not None:
        components["final"] = final
    total = sum(step_rewards) + (final or 0.0) if step_rewards or final is not None else None
    advantage, problem = as_float(cols.value("advantages", t), f"advantage[{t}]")
    mark_invalid(ep, problem)
    ep.reward(total, components=components, advantage=advantage)
    ep.finish(reason=reason or (str(ended) if ended is not None else last), status=status)
    return ep.reward_span


class _Span(Protocol):
    """What the kinds write to a span of an episode (its root, its reward span)."""

    def set_attribute(self, key: str, value: object) -> None: ...

    def add_link(self, context: SpanContext, attributes: Mapping[str, object] | None = None) -> None: ...


def _link(span: _Span | None, other: Episode, kind: str, episode_id: str) -> None:
    root = other.root
    if span is not None and root is not None:
        span.add_link(root.get_span_context(), {c.RL_LINK_KIND: kind, c.RL_EPISODE_ID: episode_id})


def _put(span: _Span | None, key: str, value: object) -> None:
    if span is not None:
        span.set_attribute(key, value)


# --- preference ------------------------------------------------------------------------------------
def _pairs(n: int, pattern: object, chunk: object) -> list[tuple[int, int]] | None:
    """The matchups ``compute_group_rewards`` asks for (``get_pairs_chunked``), or None."""
    name = str(getattr(pattern, "value", pattern))
    size = chunk if isinstance(chunk, int) and chunk > 0 else n
    out: list[tuple[int, int]] = []
    for lo in range(0, n, max(size, 1)):
        hi = min(lo + size, n)
        if name == "all_pairs_both_ways":
            out.extend((i, j) for i in range(lo, hi) for j in range(lo, hi) if i != j)
        elif name == "all_pairs_one_way":
            out.extend((i, j) for i in range(lo, hi) for j in range(i + 1, hi))
        else:
            warn_unknown(_ADAPTER, "tournament_pattern", f"{name!r}: matchups not recorded")
            return None
    return out


class _Match(TypedDict):
    """One matchup of an answer, as its reward span shows it."""

    opponent: str
    opponent_trace_id: str | None
    position: str
    verdict: float | None


def _preference(episodes: list[Episode], ids: list[str], trajectories: list[object], cols: Columns,
                builder: object, verdicts: PreferenceVerdicts | None, reader: _tinker._Reader,
                model: str | None, group_id: str) -> None:
    n = len(trajectories)
    pattern = field(builder, "tournament_pattern")
    chunk = field(builder, "matchup_group_size", default=n)
    pairs = _pairs(n, pattern, chunk) if builder is not None else None
    if builder is None:
        warn_unknown(_ADAPTER, "env_group_builder", "a preference group without its builder: "
                     "matchups not recorded")
    prompt_list = field(builder, "convo_prefix")
    said = verdicts.take(prompt_list) if verdicts is not None and prompt_list is not None else None
    if said is not None and pairs is not None and len(said) != len(pairs):
        warn_unknown(_ADAPTER, "PreferenceVerdicts", f"{len(said)} verdicts for {len(pairs)} "
                     "matchups: verdicts not recorded")
        said = None
    size = chunk if isinstance(chunk, int) and chunk > 0 else max(n, 1)
    matches: list[list[_Match]] = [[] for _ in range(n)]
    for m, (i, j) in enumerate(pairs or []):
        raw = float(said[m][1]) if said is not None else None
        # the model's verdict is for B (j): j gains it, i loses it (win_minus_loss)
        matches[i].append({"opponent": ids[j], "opponent_trace_id": episodes[j].trace_id,
                           "position": "A", "verdict": None if raw is None else -raw})
        matches[j].append({"opponent": ids[i], "opponent_trace_id": episodes[i].trace_id,
                           "position": "B", "verdict": raw})
    prompt = [dict(m) for m in prompt_list] if isinstance(prompt_list, (list, tuple)) else None
    for t, (ep, trajectory) in enumerate(zip(episodes, trajectories, strict=True)):
        metrics = cols.value("metrics", t)
        terms = {k: v for k, v in (metrics or {}).items() if k in ("win_minus_loss", "format")}
        if pairs is not None:
            ep.set_attribute(c.RL_COMPANIONS_ID, f"{group_id}:m{t // size}")
            ep.set_attribute(c.RL_COMPANIONS_KIND, c.COMPANIONS_PREFERENCE)
        span = _fill(ep, trajectory, t, cols, reader, model, prompt=prompt, terms=terms)
        if pairs is None:
            continue
        _put(span, c.RL_PREFERENCE_PATTERN, str(getattr(pattern, "value", pattern)))
        _put(span, c.RL_PREFERENCE_COMPARISONS, json.dumps(matches[t]))
        opponents: list[int] = []
        for i in (ids.index(x["opponent"]) for x in matches[t]):
            if i not in opponents:
                opponents.append(i)
        _put(span, c.RL_PREFERENCE_OPPONENT_EPISODE_IDS, [ids[i] for i in opponents])
        _put(span, c.RL_PREFERENCE_OPPONENT_TRACE_IDS, [episodes[i].trace_id or "" for i in opponents])
        if said is not None:
            _put(span, c.RL_PREFERENCE_VERDICTS, [x["verdict"] for x in matches[t]])
        for i in opponents:
            _link(span, episodes[i], c.LINK_OPPONENT, ids[i])


# --- multiplayer -----------------------------------------------------------------------------------
def _multiplayer(episodes: list[Episode], ids: list[str], trajectories: list[object], cols: Columns,
                 builder: object, reader: _tinker._Reader, model: str | None, group_id: str,
                 num_players: object, self_play: object) -> None:
    players = num_players if num_players is not None else field(builder, "num_players", default=2)
    players = players if isinstance(players, int) and players > 0 else 2
    selfplay = self_play if self_play is not None else bool(field(builder, "self_play", default=True))
    opponent = field(builder, "opponent_policy")
    n = len(trajectories)
    if selfplay and n % players:
        warn_unknown(_ADAPTER, "num_envs", f"{n} trajectories for games of {players} players: "
                     "the last game is incomplete")
    for t, (ep, trajectory) in enumerate(zip(episodes, trajectories, strict=True)):
        player = t % players
        game = t // players if selfplay else t
        game_id = f"{group_id}:game{game}"
        others = [u for u in range(game * players, min(game * players + players, n)) if u != t] if selfplay else []
        ep.set_attribute(c.RL_GAME_ID, game_id)
        ep.set_attribute(c.RL_GAME_PLAYER, player)
        ep.set_attribute(c.RL_GAME_ROLE, f"player_{player}")
        ep.set_attribute(c.RL_GAME_PLAYERS, players)
        if not selfplay:
            ep.set_attribute(c.RL_GAME_OPPONENT, type(opponent).__name__ if opponent is not None else "fixed")
        if others:
            ep.set_attribute(c.RL_COMPANIONS_ID, game_id)
            ep.set_attribute(c.RL_COMPANIONS_KIND, c.COMPANIONS_GAME)
            ep.set_attribute(c.RL_GAME_TRACE_IDS, [episodes[u].trace_id or "" for u in others])
            for u in others:
                _link(ep.root, episodes[u], c.LINK_PLAYER, ids[u])
        _fill(ep, trajectory, t, cols, reader, model)


# --- prompt-only distillation ------------------------------------------------------------------------
def _distillation(episodes: list[Episode], trajectories: list[object], cols: Columns, teacher: object,
                  coef: object, reader: _tinker._Reader, model: str | None) -> None:
    kl_coef, _ = as_float(coef)
    name = field(teacher, "name")
    for t, (ep, trajectory) in enumerate(zip(episodes, trajectories, strict=True)):
        if name:
            ep.set_attribute(c.RL_DISTILL_TEACHER_NAME, str(name))
        span = _fill(ep, trajectory, t, cols, reader, model)
        if name:
            _put(span, c.RL_DISTILL_TEACHER_NAME, str(name))
        if kl_coef is not None:
            _put(span, c.RL_DISTILL_KL_COEF, kl_coef)
        scores = _teacher_scores(trajectory, teacher)
        if scores is None:
            continue
        student, taught = scores
        _put(span, c.RL_DISTILL_TEACHER_LOGPROBS, taught)
        if taught:
            mean_teacher = sum(taught) / len(taught)
            _put(span, c.RL_DISTILL_TEACHER_LOGPROB, mean_teacher)
            ep.set_attribute(c.RL_DISTILL_TEACHER_LOGPROB, mean_teacher)
        if student is not None and len(student) == len(taught) and taught:
            _put(span, c.RL_DISTILL_STUDENT_LOGPROBS, student)
            reverse_kl = sum(s - q for s, q in zip(student, taught, strict=True)) / len(taught)
            _put(span, c.RL_DISTILL_STUDENT_LOGPROB, sum(student) / len(student))
            _put(span, c.RL_DISTILL_REVERSE_KL, reverse_kl)
            ep.set_attribute(c.RL_DISTILL_REVERSE_KL, reverse_kl)


def _teacher_scores(trajectory: object, teacher: object) -> tuple[list[float] | None, list[float]] | None:
    """(student, teacher) logprobs of the answer tokens, from the sequence the cookbook sent
    the teacher (``ob`` + ``ac.tokens`` of a single-turn trajectory), or None."""
    transitions = list(field(trajectory, "transitions", default=[]) or [])
    if teacher is None or not transitions:
        return None
    if len(transitions) != 1:
        warn_unknown(_ADAPTER, "distillation", f"a trajectory of {len(transitions)} turns: the "
                     "teacher's score is read for single-turn (prompt-only) trajectories only")
        return None
    ob, ac = field(transitions[0], "ob"), field(transitions[0], "ac")
    prompt_ids, answer_ids = token_ids(ob), token_ids(ac)
    lookup = getattr(teacher, "logprobs", None)
    if prompt_ids is None or answer_ids is None or not callable(lookup):
        return None
    logprobs = lookup(prompt_ids + answer_ids)
    if logprobs is None:
        return None  # the teacher was not asked (kl_penalty_coef 0) or forgot it
    taught = [as_float(x)[0] for x in logprobs[len(prompt_ids):len(prompt_ids) + len(answer_ids)]]
    if any(x is None for x in taught) or len(taught) != len(answer_ids):
        return None
    student_raw = field(ac, "maybe_logprobs")
    student = [as_float(x)[0] for x in student_raw] if student_raw is not None else None
    if student is not None and any(x is None for x in student):
        student = None
    return student, taught  # type: ignore[return-value]
