"""Tinker cookbook: trajectory groups (transitions and their ``RolloutTrace``) as episodes.

    from otel_rollouts.adapters.tinker import record_trajectory_groups

    # in the RL loop, once a batch of groups is rolled out (and optionally its advantages)
    record_trajectory_groups(wrapped_groups, step=i_batch, split="train", tokenizer=tokenizer)
    otr.end_step(i_batch)

One episode per trajectory, grouped by ``(step, group index)``. Input is duck-typed, the
cookbook is never imported:

* groups: ``WrappedTrajectoryGroup`` (``trajectory_group``, ``env_group_builder``,
  ``sampling_client_step``), ``TrajectoryGroup`` (``trajectories_G``, ``final_rewards_G``,
  ``metrics_G``, ``rollout_errors``), ``None`` for a skipped group, or the per-trajectory records
  of the rollout-summary JSONL (``group_idx``, ``traj_idx``, ``steps``, ``total_reward``…);
* transitions: ``ob`` (``ModelInput``), ``ac`` (``TokensWithLogprobs`` with ``stop_reason``),
  ``reward``, ``episode_done``, ``metrics``, and the optional ``trace`` (``RolloutTrace``:
  ``prompt``, ``policy_response``, ``reward_data``, ``env_state``, ``extra``).

What the cookbook's own trace logging got wrong in review, handled here:

* ``reward_data`` values formatted as text (``"0.500"``) become numbers
  (``rl.reward.<key>``); the raw payload is kept as metadata;
* an environment that logged its live message list (mutated after the step) cannot rewrite
  the prompt: the prompt is the leading messages before the first assistant message, recorded
  (copied) when this function runs;
* steps that returned early (parse error, context overflow, ``length``) — often without a
  trace — still give an episode, with ``rl.status`` ``error`` or ``truncated``, the action
  decoded from its tokens when a ``tokenizer`` is given; failed rollouts (``rollout_errors``)
  give error episodes; skipped groups are counted;
* preference environments fill the trace after the rollout, per trajectory: each trajectory's
  own response is read from its own transitions;
* ragged per-group lists (``final_rewards_G``, ``metrics_G``, advantages) never raise: the
  samples they miss carry ``rl.alignment=partial``;
* the policy version is ``sampling_client_step`` (negative placeholders ignored); the cap of the
  tail sampler holds per (step, split), not per group or per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._content import to_int
from otel_rollouts._guard import guarded_or, report
from otel_rollouts.adapters._common import (
    COUNT_FILTERED,
    Columns,
    as_float,
    count,
    field,
    mark_invalid,
    mark_partial,
    to_list,
)
from otel_rollouts.adapters._messages import (
    conversation,
    decoded,
    feedback_after,
    leading_prompt,
    record_assistant,
    token_count,
    token_ids,
)

__all__ = ["record_trajectory_groups"]

FRAMEWORK = "tinker-cookbook"

# reward_data entries that describe the task, not a reward term
_NOT_REWARD = frozenset({"reference_answer", "answer", "ground_truth", "target", "expected",
                         "solution", "criterion", "grader_response"})
# metrics the cookbook's early returns set
_ERROR_METRICS = ("parse_error",)
_TRUNCATION_METRICS = ("max_tokens_reached", "context_overflow", "context_length_exceeded",
                       "context_window_exceeded")


@guarded_or(list)
def record_trajectory_groups(
    trajectory_groups: Sequence[Any],
    *,
    step: int,
    split: str = "train",
    tokenizer: Any = None,
    taglist: Sequence[Any] | None = None,
    sampling_client_steps: Sequence[Any] | None = None,
    advantages: Sequence[Any] | None = None,
    model: str | None = None,
    group_start: int = 0,
) -> list[str]:
    """Record every trajectory of ``trajectory_groups`` as one episode of training step ``step``.

    * ``split``: ``"train"`` or the cookbook's ``"eval/<label>"``;
    * ``tokenizer``: decodes observations/actions of steps that carry no trace (lazily, only
      for kept episodes);
    * ``taglist`` / ``sampling_client_steps``: per-group tags and policy versions, as given to
      ``serialize_rollout_summaries`` (a ``WrappedTrajectoryGroup`` carries its own);
    * ``advantages``: per group, the per-trajectory advantages (``compute_advantages`` output);
    * ``group_start``: index of the first group, when one step's groups arrive in several calls.

    Returns the episode ids recorded. Never raises (unless otel_rollouts runs in strict mode).
    """
    groups = _as_groups(trajectory_groups)
    per_group = Columns(len(groups), tags=taglist, versions=sampling_client_steps,
                        advantages=advantages)
    ids: list[str] = []
    for gi, group in enumerate(groups):
        g = group_start + gi
        if group is None:
            count(COUNT_FILTERED, step=step, split=split)
            continue
        try:
            ids.extend(_record_group(group, gi, g, per_group, step=step, split=split,
                                     tokenizer=tokenizer, model=model))
        except otr.InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the training loop
            report(f"tinker adapter: group {g}: {type(exc).__name__}: {exc}", exc=exc)
    return ids


# --- input shapes --------------------------------------------------------------------------
class _SummaryGroup:
    """Rollout-summary JSONL records of one group, read like a ``TrajectoryGroup``."""

    def __init__(self, records: list[Mapping[str, Any]]) -> None:
        self.trajectories_G = records
        self.final_rewards_G = [r.get("final_reward") for r in records]
        self.metrics_G = [r.get("trajectory_metrics") for r in records]
        self.sampling_client_step = records[0].get("sampling_client_step")
        self.tags = records[0].get("tags")


def _as_groups(trajectory_groups: Any) -> list[Any]:
    """The groups to record; summary records (one per trajectory) are gathered by group."""
    groups = list(trajectory_groups or [])
    if groups and all(isinstance(x, Mapping) and "steps" in x for x in groups):
        by_group: dict[Any, list[Mapping[str, Any]]] = {}
        for record in groups:
            by_group.setdefault(record.get("group_idx"), []).append(record)
        return [_SummaryGroup(records) for records in by_group.values()]
    return groups


def _tags(group: Any, per_group: Columns, gi: int) -> Any:
    tags = field(group, "tags")
    builder = field(group, "env_group_builder")
    logging_tags = getattr(builder, "logging_tags", None)
    if tags is None and callable(logging_tags):
        try:
            tags = list(logging_tags())
        except Exception:  # noqa: BLE001 - a builder's tag hook is the user's code
            tags = None
    return tags if tags is not None else per_group.value("tags", gi)


def _version(value: Any) -> int | None:
    """A policy version, or None for a missing value or a negative placeholder."""
    if value is None:
        return None
    number, _ = to_int(value, "sampling_client_step")
    return number if number is not None and number >= 0 else None


# --- one group ------------------------------------------------------------------------------
def _record_group(group: Any, gi: int, g: int, per_group: Columns, *, step: int, split: str,
                  tokenizer: Any, model: str | None) -> list[str]:
    inner = field(group, "trajectory_group", default=group)
    trajectories = list(field(inner, "trajectories_G", "trajectories", default=[]) or [])
    version = _version(field(group, "sampling_client_step",
                             default=per_group.value("versions", gi)))
    tags = _tags(group, per_group, gi)
    cols = Columns(
        len(trajectories),
        final_rewards=field(inner, "final_rewards_G"),
        metrics=field(inner, "metrics_G"),
        advantages=to_list(per_group.value("advantages", gi)),
    )
    group_id = f"{split}:{step}:{g}"
    ids = []
    group_prompt: list[dict[str, Any]] | None = None
    for t, trajectory in enumerate(trajectories):
        episode_id = f"{group_id}:{field(trajectory, 'traj_idx', default=t)}"
        prompt = _record_trajectory(
            trajectory, t, cols, episode_id=episode_id, group_id=group_id, step=step,
            split=split, version=version, tags=tags, tokenizer=tokenizer, model=model,
        )
        group_prompt = group_prompt or prompt
        ids.append(episode_id)
    for r, error in enumerate(field(inner, "rollout_errors", default=[]) or []):
        episode_id = f"{group_id}:error{r}"
        _record_rollout_error(error, episode_id=episode_id, group_id=group_id, step=step,
                              split=split, version=version, tags=tags, prompt=group_prompt)
        ids.append(episode_id)
    return ids


def _record_rollout_error(error: Any, *, episode_id: str, group_id: str, step: int, split: str,
                          version: int | None, tags: Any, prompt: list | None) -> None:
    """A rollout that raised (``RolloutError``): an error episode, with the group's prompt."""
    kind = str(field(error, "error_type", default=type(error).__name__))
    message = field(error, "error_message", default=None)
    if message is None and isinstance(error, BaseException):
        message = str(error)
    metadata = {"error_message": str(message or "")}
    if tags is not None:
        metadata["tags"] = tags
    with otr.episode(step=step, split=split, group_id=group_id, policy_version=version,
                     episode_id=episode_id, framework=FRAMEWORK, metadata=metadata) as ep:
        if prompt:
            ep.prompt(prompt)
        ep.finish(reason=kind, status=c.STATUS_ERROR)


# --- one trajectory --------------------------------------------------------------------------
def _record_trajectory(trajectory: Any, t: int, cols: Columns, *, episode_id: str, group_id: str,
                       step: int, split: str, version: int | None, tags: Any, tokenizer: Any,
                       model: str | None) -> list[dict[str, Any]] | None:
    transitions = list(field(trajectory, "transitions", "steps", default=[]) or [])
    traces = [field(tr, "trace") for tr in transitions]
    prompts = [conversation(field(tc, "prompt")) for tc in traces]
    responses = [conversation(field(tc, "policy_response")) for tc in traces]
    nexts = [conversation(field(field(tc, "extra"), "next_messages")) for tc in traces]

    steps_meta: list[dict[str, Any]] = []
    metadata: dict[str, Any] = {}
    if tags is not None:
        metadata["tags"] = tags
    trajectory_metrics = cols.value("metrics", t)
    if trajectory_metrics:
        metadata["trajectory_metrics"] = dict(trajectory_metrics)
    staleness = step - version if version is not None else None
    with otr.episode(step=step, split=split, group_id=group_id, sample_index=t,
                     policy_version=version, episode_id=episode_id, framework=FRAMEWORK,
                     metadata=metadata) as ep:
        if staleness is not None:
            ep.set_attribute(c.RL_STALENESS, staleness)
        mark_partial(ep, cols.missing(t))

        prompt = _prompt(prompts, transitions, tokenizer)
        ep.prompt(prompt)

        status, reason, parse_errors = c.STATUS_OK, None, []
        step_rewards: list[float] = []
        reward_data: list[tuple[int, Mapping[str, Any]]] = []
        extras: list[Any] = []
        for k, tr in enumerate(transitions):
            ac = field(tr, "ac")
            stop_reason = field(ac, "stop_reason", default=field(tr, "stop_reason"))
            metrics = field(tr, "metrics", default={}) or {}
            info = {
                "episode_done": field(tr, "episode_done"),
                "stop_reason": stop_reason,
                "metrics": dict(metrics) if isinstance(metrics, Mapping) else metrics,
                "env_state": field(traces[k], "env_state"),
            }
            steps_meta.append({key: v for key, v in info.items() if v is not None})
            reward, problem = as_float(field(tr, "reward"),
                                       f"sample {episode_id}: transitions[{k}].reward")
            mark_invalid(ep, problem)
            if reward is not None:
                step_rewards.append(reward)
                steps_meta[-1]["reward"] = reward
            data = field(traces[k], "reward_data")
            if isinstance(data, Mapping) and data:
                reward_data.append((k, data))
            extra = field(traces[k], "extra")
            if isinstance(extra, Mapping) and extra.get("rubric_grades") is not None:
                extras.append(extra.get("rubric_grades"))

            following = nexts[k] or (prompts[k + 1] if k + 1 < len(prompts) else [])
            with ep.turn() as turn:
                errors = record_assistant(
                    turn,
                    _response(responses[k], ac, tokenizer),
                    feedback_after(following, k) if following else [],
                    model=model,
                    finish_reason=stop_reason,
                    input_tokens=token_count(field(tr, "ob")) or field(tr, "ob_len"),
                    output_tokens=token_count(ac) or field(tr, "ac_len"),
                )
            parse_errors.extend(errors)
            status, reason = _worse((status, reason), _step_status(stop_reason, metrics, errors))

        if not transitions:
            status, reason = c.STATUS_ERROR, "empty trajectory"
        ep.set_attribute(c.RL_METADATA_PREFIX + "steps", steps_meta)
        if parse_errors:
            ep.set_attribute(c.RL_TOOL_PARSE_ERROR, parse_errors)
        if reward_data:
            ep.set_attribute(c.RL_METADATA_PREFIX + "reward_data", [dict(d) for _, d in reward_data])
        if extras:
            ep.set_attribute(c.RL_METADATA_PREFIX + "rubric_grades", extras)

        final, problem = as_float(cols.value("final_rewards", t),
                                  f"sample {episode_id}: final_rewards_G[{t}]")
        mark_invalid(ep, problem)
        total, problem = as_float(field(trajectory, "total_reward"),
                                  f"sample {episode_id}: total_reward")
        mark_invalid(ep, problem)
        if total is None and (step_rewards or final is not None):
            total = sum(step_rewards) + (final or 0.0)
        components = _components(reward_data, ep, episode_id)
        components["transitions"] = sum(step_rewards)
        if final is not None:
            components["final"] = final
        advantage, problem = as_float(cols.value("advantages", t),
                                      f"sample {episode_id}: advantage")
        mark_invalid(ep, problem)
        ep.reward(total, components=components, advantage=advantage)
        last_stop = steps_meta[-1].get("stop_reason") if steps_meta else None
        ep.finish(reason=reason or last_stop, status=status)
    return prompt


def _prompt(prompts: list[list[dict[str, Any]]], transitions: list[Any], tokenizer: Any
            ) -> list[dict[str, Any]]:
    """The initial prompt: the first trace's leading messages, else the first observation."""
    for messages in prompts[:1]:
        if messages:
            return leading_prompt(messages) or messages
    ob = field(transitions[0], "ob") if transitions else None
    text = decoded(tokenizer, token_ids(ob))
    if text is None:
        n = token_count(ob) or field(transitions[0], "ob_len") if transitions else None
        text = f"<{n} prompt tokens; pass tokenizer= to decode>" if n else ""
    return [{"role": "user", "content": text}]


def _response(messages: list[dict[str, Any]], ac: Any, tokenizer: Any) -> dict[str, Any]:
    """The assistant message of a step: from its trace, else its action tokens decoded."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return m
    if messages:
        return dict(messages[-1], role="assistant")
    text = decoded(tokenizer, token_ids(ac))
    return {"role": "assistant", "content": "" if text is None else text}


def _positive(metrics: Any, key: str) -> bool:
    if not isinstance(metrics, Mapping) or key not in metrics:
        return False
    number, _ = as_float(metrics.get(key))
    return bool(number)


def _step_status(stop_reason: Any, metrics: Any, parse_errors: list[str]) -> tuple[str, str | None]:
    for key in _ERROR_METRICS:
        if _positive(metrics, key):
            return c.STATUS_ERROR, key
    if parse_errors:
        return c.STATUS_ERROR, "tool_parse_error"
    for key in _TRUNCATION_METRICS:
        if _positive(metrics, key):
            return c.STATUS_TRUNCATED, "length" if key == "max_tokens_reached" else key
    if stop_reason is not None and str(stop_reason) == "length":
        return c.STATUS_TRUNCATED, "length"
    return c.STATUS_OK, None


_RANK = {c.STATUS_OK: 0, c.STATUS_TRUNCATED: 1, c.STATUS_ERROR: 2}


def _worse(a: tuple[str, str | None], b: tuple[str, str | None]) -> tuple[str, str | None]:
    return b if _RANK[b[0]] > _RANK[a[0]] else a


def _components(reward_data: list[tuple[int, Mapping[str, Any]]], ep: Any, episode_id: str
                ) -> dict[str, float]:
    """Numbers of ``reward_data`` (text like ``"0.500"`` and booleans included) as components;
    prefixed ``t<k>.`` when several steps carry reward data."""
    out: dict[str, float] = {}
    several = len(reward_data) > 1
    for k, data in reward_data:
        for key, value in data.items():
            if key in _NOT_REWARD or value is None or isinstance(value, (Mapping, list, tuple)):
                continue
            number, problem = as_float(value, f"sample {episode_id}: reward_data[{key!r}]")
            if number is None:
                if not isinstance(value, str):
                    mark_invalid(ep, problem)
                continue  # a diagnostic string: kept raw in rl.metadata.reward_data
            out[f"t{k}.{key}" if several else str(key)] = number
    return out
