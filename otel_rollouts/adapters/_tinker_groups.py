"""Tinker cookbook: how one trajectory group becomes episodes (the reading behind
``otel_rollouts.adapters.tinker.record_trajectory_groups``, whose docstring maps each field).

Shared by the plain path (problem, rubric, tool and message environments) and
``_tinker_kinds`` (preference, multiplayer, distillation), which records linked episodes with
these readers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts import episode as new_episode
from otel_rollouts.adapters._messages import (
    Message,
    conversation,
    feedback_after,
    leading_prompt,
    record_assistant,
    token_count,
    token_ids,
)
from otel_rollouts.adapters._tinker_text import Layout
from otel_rollouts.adapters.kit import (
    ROLE_ENVIRONMENT,
    Columns,
    Deferred,
    TokenizerInfo,
    as_float,
    exception_text,
    field,
    mark_invalid,
    mark_partial,
    set_policy,
    strip_tool_responses,
    to_int,
    to_list,
    tokenizer_info,
    tool_responses,
    warn_unknown,
)

if TYPE_CHECKING:
    from otel_rollouts import ToolCall, Turn

Prompt = Sequence[Mapping[str, object]] | Deferred
"""An episode's prompt: its messages, or a ``Deferred`` that splits them only if it is kept."""

FRAMEWORK = "tinker-cookbook"
ADAPTER = "tinker"
TESTED = ("0.5.8", "0.6.1")  # the releases tests/adapters/test_real_tinker.py runs on

# Transition metrics that are reward terms in the cookbook's own environments: ProblemEnv.step
# returns metrics {"format", "correct"} with reward = format_coef * (format - 1) + correct; the
# rubric env {"format", "rubric_score"} with reward = format_coef * (format - 1) + rubric_score.
# Every other metric (stop/<reason>, parse_error, max_turns, timings...) is a diagnostic.
REWARD_METRICS = ("format", "correct", "rubric_score")

# metrics the cookbook's early returns set
_ERROR_METRICS = ("parse_error",)
_TRUNCATION_METRICS = ("max_tokens_reached", "context_overflow", "context_length_exceeded",
                       "context_window_exceeded")
# Trajectory.stop_reason (rl.types.StopReason values) -> rl.status
_STOP_STATUS = {
    "completed": c.STATUS_OK,
    "tool_stopped": c.STATUS_OK,
    "max_turns": c.STATUS_TRUNCATED,
    "max_tokens": c.STATUS_TRUNCATED,
    "max_sampled_tokens": c.STATUS_TRUNCATED,
    "max_tool_calls": c.STATUS_TRUNCATED,
    "context_overflow": c.STATUS_TRUNCATED,
    "rollout_timeout": c.STATUS_TRUNCATED,
    "parse_error": c.STATUS_ERROR,
}
_CONVERSATION_ROLES = ("system", "user", "assistant", "developer")


class _Sampled:
    """A turn whose generation also gets the sampled tokens' logprobs (``ac.maybe_logprobs``,
    the sampler's, per ``ac.tokens``): ``record_assistant`` records the generation; everything
    else goes to the turn itself. The trainer's logprobs of these tokens never reach the
    adapter (the cookbook's ``train_step`` keeps its ``forward_backward`` logprobs), so no
    ``rl.mismatch.*`` statistic comes of them: the engine's side is recorded alone."""

    __slots__ = ("_turn", "_sampled")

    def __init__(self, turn: Turn, sampled: dict[str, object]) -> None:
        self._turn = turn
        self._sampled = sampled

    def record_generation(self, content: object = None, *, model: str | None = None,
                          messages: object = None, provider: str | None = None,
                          **output: object) -> object:
        return self._turn.record_generation(content, model=model, messages=messages, provider=provider,
                                            **output, **self._sampled)

    def tool_call(self, name: str, arguments: object = None, call_id: str | None = None) -> ToolCall:
        return self._turn.tool_call(name, arguments=arguments, call_id=call_id)

    def feedback(self, content: object, role: str = "environment") -> None:
        self._turn.feedback(content, role=role)

    def __getattr__(self, name: str) -> object:
        return getattr(self._turn, name)


def sampled(turn: Turn, ac: object) -> Turn | _Sampled:
    """``turn``, or the turn with ``ac``'s sampling logprobs (``TokensWithLogprobs.maybe_logprobs``
    when it holds one per token of ``ac.tokens``; ``None`` or another length: none)."""
    logprobs = to_list(field(ac, "maybe_logprobs"))
    tokens = token_ids(ac)
    if not logprobs or tokens is None or len(logprobs) != len(tokens):
        if logprobs and tokens is not None:
            warn_unknown(ADAPTER, "ac.maybe_logprobs", f"{len(logprobs)} logprobs for {len(tokens)} tokens: "
                                                       "not recorded")
        return turn
    return _Sampled(turn, {"logprobs": logprobs, "tokens": tokens})


def _substeps(value: object) -> int:
    number, _ = to_int(value, "num_substeps")
    return number if number is not None and number >= 1 else 1


# --- text: the framework's renderer, else the tokenizer's own template markers ---------------
class _Reader:
    """Turns token ids into readable messages (markup and end-of-turn tokens removed).

    The layout of messages comes from the tokenizer's chat template, else from the renderer
    (given, or the one the cookbook recommends for the tokenizer's model): see ``_tinker_text``.
    """

    def __init__(self, tokenizer: object, renderer: object) -> None:
        self.tokenizer: Any = tokenizer  # duck-typed: its decode()
        self.renderer: object = renderer if callable(getattr(renderer, "parse_response", None)) else None
        self.info: TokenizerInfo | None = None
        self.layout: Layout | None = None
        if tokenizer is not None:  # learn markers and special tokens on this thread, once
            self.info = tokenizer_info(tokenizer)
            self.layout = _layout(tokenizer, self.renderer)
            if self.renderer is None and self.layout.renderer is not None:
                self.renderer = self.layout.renderer  # the cookbook's own parser for this model
            if not self.layout.understood:
                warn_unknown(ADAPTER, "tokenizer", f"{type(tokenizer).__name__}: {self.layout.problem}. "
                             "Lost: the prompt's split into messages (recorded as one user message) and "
                             "the roles of what environments add after an action (recorded as one "
                             f"{ROLE_ENVIRONMENT!r} message, or as the result of the turn's tool call)")

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt(self, ob: object, ob_len: object = None) -> Prompt:
        """The messages of the rendered first observation, split only if the episode is kept."""
        ids = _ob_ids(ob)
        if ids is None:
            return []  # no token ids (a summary record): nothing to show
        info, layout = self.info, self.layout
        if layout is None or info is None:  # both set, or neither
            return [{"role": "user", "content": f"<{len(ids)} prompt tokens; pass tokenizer= to decode>"}]

        def split() -> list[Mapping[str, object]]:
            text = str(info.decoder.decode(ids, skip_special_tokens=False))
            return layout.finish(layout.messages(text))

        return Deferred(split)

    def action(self, ac: object, k: int) -> tuple[dict[str, object], list[str]]:
        """The assistant message of action ``ac`` (tool calls parsed) and its parse problems."""
        ids = token_ids(ac)
        if ids is None or (self.tokenizer is None and self.renderer is None):
            return {"role": "assistant", "content": ""}, []
        if self.renderer is not None:
            parsed = self._parsed(ids, k)
            if parsed is not None:
                return parsed
        if self.layout is None:
            return {"role": "assistant", "content": ""}, []
        return self.layout.assistant(self.decode(ids), call_id_prefix=f"call_{k}_")

    def _parsed(self, ids: list[int], k: int) -> tuple[dict[str, object], list[str]] | None:
        parse = getattr(self.renderer, "parse_response", None)
        try:
            if not callable(parse):
                raise AttributeError(f"{type(self.renderer).__name__!r} object has no attribute 'parse_response'")
            message, _termination = parse(list(ids))
        except Exception as exc:  # noqa: BLE001 - the renderer is the user's object
            warn_unknown(ADAPTER, "renderer.parse_response", f"{exception_text(exc)}")
            return None
        content = _content_text(message.get("content"))
        calls = []
        for n, call in enumerate(message.get("tool_calls") or []):
            function = field(call, "function")
            name = field(function, "name")
            if not name:
                continue
            calls.append({"id": str(field(call, "id") or f"call_{k}_{n}"), "type": "function",
                          "function": {"name": str(name),
                                       "arguments": field(function, "arguments", default="{}")}})
        unparsed = list(message.get("unparsed_tool_calls") or [])
        errors = [str(field(u, "error") or u) for u in unparsed]
        raw = [str(field(u, "raw_text")) for u in unparsed if field(u, "raw_text")]
        if raw:  # what the model wrote stays readable, as with the tokenizer's parser
            content = "\n".join([content, *raw]).strip()
        if self.layout is not None:
            content = self.layout.unspecial(content)
        out: dict[str, object] = {"role": "assistant", "content": content}
        if calls:
            out["tool_calls"] = calls
        return out, errors

    def feedback(self, ob: object, ac: object, next_ob: object, has_calls: bool
                 ) -> Sequence[Mapping[str, object]]:
        """The messages the environment added after action ``ac``: what ``next_ob`` holds beyond
        ``ob`` + the rendered action, after the last assistant message."""
        layout = self.layout
        if layout is None:
            return []
        nxt = _ob_ids(next_ob)
        if not nxt:
            return []
        prev = _ob_ids(ob) or []
        if not layout.understood:
            return self._raw_feedback(prev, token_ids(ac) or [], nxt, has_calls)
        if prev and nxt[: len(prev)] == prev:  # a message env re-renders the whole history
            messages = layout.messages(self.decode(nxt[len(prev):]), default_role="assistant")
        else:
            messages = layout.messages(self.decode(nxt))
        added = feedback_after(messages, len([m for m in messages if m["role"] == "assistant"]) - 1)
        return layout.finish(_tool_messages(added, has_calls))

    def _raw_feedback(self, prev: list[int], ac: list[int], nxt: list[int],
                      has_calls: bool) -> Sequence[Mapping[str, object]]:
        """Without a known layout: the tokens the observation adds after ``ob`` + action, as one
        message (the tool result when the turn called a tool); special tokens removed."""
        layout = self.layout
        assert layout is not None
        if nxt[: len(prev) + len(ac)] == prev + ac:
            added = nxt[len(prev) + len(ac):]
        elif nxt[: len(prev)] == prev:
            added = nxt[len(prev):]
        else:
            added = nxt
        text = layout.unspecial(self.decode(added)).strip()
        if not text:
            return []
        blocks = tool_responses(text)
        if has_calls and not blocks:
            return [{"role": "tool", "content": text}]
        return _tool_messages([{"role": ROLE_ENVIRONMENT, "content": text}], has_calls)


def _layout(tokenizer: object, renderer: object) -> Layout:
    """The layout of ``tokenizer`` (+ ``renderer``), learned once per pair."""
    key = id(renderer)
    try:
        cache = _LAYOUTS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: learned for this call only
        return Layout(tokenizer, renderer)
    layout = cache.get(key)
    if layout is None or (renderer is not None and layout.given is not renderer):
        layout = cache[key] = Layout(tokenizer, renderer)
    return layout


_LAYOUTS: weakref.WeakKeyDictionary[object, dict[int, Layout]] = weakref.WeakKeyDictionary()


def _ob_ids(ob: object) -> list[int] | None:
    if ob is None:
        return None
    ids = token_ids(ob)
    if ids is None and callable(getattr(ob, "to_ints", None)):
        warn_unknown(ADAPTER, "ob", "an observation whose chunks are not all text tokens (images?): "
                     "not decoded")
    return ids


def _content_text(content: object) -> str:
    """A renderer message's content as text: text parts, thinking kept as ``<think>`` blocks."""
    if isinstance(content, str) or content is None:
        return content or ""
    out = []
    for part in content if isinstance(content, (list, tuple)) else [content]:
        kind = field(part, "type")
        if kind == "text":
            out.append(str(field(part, "text", default="")))
        elif kind == "thinking":
            out.append(f"<think>{field(part, 'thinking', default='')}</think>")
        elif kind is not None:
            warn_unknown(ADAPTER, "message.content", f"a {kind!r} part: left out of the text")
    return "".join(out).strip()


def _tool_messages(messages: Sequence[Mapping[str, object]], has_calls: bool) -> Sequence[Mapping[str, object]]:
    """After a turn with tool calls, each ``<tool_response>`` block (and a message of a role the
    template renders like ``user`` but is not one, e.g. ``tool``/``ipython``) is a tool result."""
    if not has_calls:
        return messages
    out: list[Mapping[str, object]] = []
    for m in messages:
        content = m.get("content")
        blocks = tool_responses(content) if isinstance(content, str) else []
        if blocks:
            out.extend({"role": "tool", "content": b} for b in blocks)
            rest = strip_tool_responses(str(content))  # a str: it had blocks
            if rest:
                out.append({"role": m.get("role") or "user", "content": rest})
        elif m.get("role") not in _CONVERSATION_ROLES:
            out.append({"role": "tool", "content": content})
        else:
            out.append(m)
    return out


# --- input shapes --------------------------------------------------------------------------
class _SummaryGroup:
    """Rollout-summary JSONL records of one group, read like a ``TrajectoryGroup``."""

    def __init__(self, records: list[Mapping[str, object]]) -> None:
        self.trajectories_G = records
        self.final_rewards_G = [r.get("final_reward") for r in records]
        self.metrics_G = [r.get("trajectory_metrics") for r in records]
        self.sampling_client_step = records[0].get("sampling_client_step")
        self.tags = records[0].get("tags")


def _as_groups(trajectory_groups: Iterable[object] | None) -> list[object]:
    """The groups to record; summary records (one per trajectory) are gathered by group."""
    groups = list(trajectory_groups or [])
    records = [x for x in groups if isinstance(x, Mapping)]
    if groups and len(records) == len(groups) and all("steps" in x for x in records):
        by_group: dict[object, list[Mapping[str, object]]] = {}
        for record in records:
            by_group.setdefault(record.get("group_idx"), []).append(record)
        return [_SummaryGroup(records) for records in by_group.values()]
    return groups


def _tags(group: object, per_group: Columns, gi: int) -> object:
    tags = field(group, "tags")
    builder = field(group, "env_group_builder")
    logging_tags = getattr(builder, "logging_tags", None)
    if tags is None and callable(logging_tags):
        try:
            tags = list(logging_tags())
        except Exception:  # noqa: BLE001 - a builder's tag hook is the user's code
            tags = None
    return tags if tags is not None else per_group.value("tags", gi)


def _version(value: object) -> int | None:
    """A policy version, or None for a missing value or a negative placeholder."""
    if value is None:
        return None
    number, _ = to_int(value, "sampling_client_step")
    return number if number is not None and number >= 0 else None


# --- one group ------------------------------------------------------------------------------
def _record_group(group: object, gi: int, g: int, per_group: Columns, *, step: int, split: str,
                  reader: _Reader, model: str | None, substeps: int,
                  reward_keys: tuple[str, ...]) -> list[str]:
    inner = field(group, "trajectory_group", default=group)
    trajectories = field(inner, "trajectories_G", "trajectories")
    if trajectories is None:
        warn_unknown(ADAPTER, "trajectory_group",
                     f"a {type(inner).__name__} without trajectories_G: not recorded")
        trajectories = []
    trajectories = list(trajectories)
    sampled = _version(field(group, "sampling_client_step", default=per_group.value("versions", gi)))
    version = None if sampled is None else sampled * substeps
    # only training consumes the samples: the weights that train on them are step's
    trained = step * substeps if split == "train" and sampled is not None else None
    tags = _tags(group, per_group, gi)
    cols = Columns(
        len(trajectories),
        final_rewards=field(inner, "final_rewards_G"),
        metrics=field(inner, "metrics_G"),
        advantages=to_list(per_group.value("advantages", gi)),
    )
    group_id = f"{split}:{step}:{g}"
    ids = []
    group_prompt: Prompt | None = None
    policy = (version, trained)
    for t, trajectory in enumerate(trajectories):
        episode_id = f"{group_id}:{field(trajectory, 'traj_idx', default=t)}"
        prompt = _record_trajectory(
            trajectory, t, cols, episode_id=episode_id, group_id=group_id, step=step,
            split=split, policy=policy, tags=tags, reader=reader, model=model,
            reward_keys=reward_keys,
        )
        group_prompt = group_prompt or prompt
        ids.append(episode_id)
    for r, error in enumerate(field(inner, "rollout_errors", default=[]) or []):
        episode_id = f"{group_id}:error{r}"
        _record_rollout_error(error, episode_id=episode_id, group_id=group_id, step=step,
                              split=split, version=version, tags=tags, prompt=group_prompt)
        ids.append(episode_id)
    return ids


def _record_rollout_error(error: object, *, episode_id: str, group_id: str, step: int, split: str,
                          version: int | None, tags: object, prompt: Prompt | None) -> None:
    """A rollout that raised (``RolloutError``): an error episode, with the group's prompt."""
    kind = str(field(error, "error_type", default=type(error).__name__))
    message = field(error, "error_message", default=None)
    if message is None and isinstance(error, BaseException):
        message = str(error)
    metadata: dict[str, object] = {"error_message": str(message or "")}
    if tags is not None:
        metadata["tags"] = tags
    with new_episode(step=step, split=split, group_id=group_id, episode_id=episode_id,
                     framework=FRAMEWORK, metadata=metadata) as ep:
        set_policy(ep, version)
        if prompt:
            ep.prompt(prompt)
        ep.finish(reason=kind, status=c.STATUS_ERROR)


# --- one trajectory --------------------------------------------------------------------------
def _record_trajectory(trajectory: object, t: int, cols: Columns, *, episode_id: str, group_id: str,
                       step: int, split: str, policy: tuple[int | None, int | None], tags: object,
                       reader: _Reader, model: str | None, reward_keys: tuple[str, ...]) -> Prompt:
    transitions = list(field(trajectory, "transitions", "steps", default=[]) or [])
    traces = [field(tr, "trace") for tr in transitions]
    prompts = [conversation(field(tc, "prompt")) for tc in traces]
    responses = [conversation(field(tc, "policy_response")) for tc in traces]
    nexts = [conversation(field(field(tc, "extra"), "next_messages")) for tc in traces]
    obs = [field(tr, "ob") for tr in transitions] + [field(trajectory, "final_ob")]

    steps_meta: list[dict[str, object]] = []
    metadata: dict[str, object] = {}
    if tags is not None:
        metadata["tags"] = tags
    trajectory_metrics = cols.value("metrics", t)
    if trajectory_metrics:
        metadata["trajectory_metrics"] = dict(trajectory_metrics)
    with new_episode(step=step, split=split, group_id=group_id, sample_index=t,
                     episode_id=episode_id, framework=FRAMEWORK, metadata=metadata) as ep:
        set_policy(ep, *policy)
        mark_partial(ep, cols.missing(t))

        prompt = _prompt(prompts, obs[0], reader)
        ep.prompt(prompt)

        status, reason, parse_errors = c.STATUS_OK, None, []
        step_rewards: list[float] = []
        terms: list[tuple[int, str, float]] = []
        reward_data: list[Mapping[str, object]] = []
        extras: list[object] = []
        last_stop = None  # the last transition's stop_reason
        for k, tr in enumerate(transitions):
            ac = field(tr, "ac")
            stop_reason = field(ac, "stop_reason", default=field(tr, "stop_reason"))
            metrics = field(tr, "metrics", default={}) or {}
            info = {
                "episode_done": field(tr, "episode_done"),
                "stop_reason": stop_reason,
                "metrics": dict(metrics) if isinstance(metrics, Mapping) else metrics,
                "logs": _plain(field(tr, "logs")),
                "env_state": field(traces[k], "env_state"),
            }
            steps_meta.append({key: v for key, v in info.items() if v is not None})
            last_stop = stop_reason
            reward, problem = as_float(field(tr, "reward"),
                                       f"sample {episode_id}: transitions[{k}].reward")
            mark_invalid(ep, problem)
            if reward is not None:
                step_rewards.append(reward)
                steps_meta[-1]["reward"] = reward
            terms.extend(_reward_terms(metrics, k, reward_keys))
            data = field(traces[k], "reward_data")
            if isinstance(data, Mapping) and data:
                reward_data.append(dict(data))
            extra = field(traces[k], "extra")
            if isinstance(extra, Mapping) and extra.get("rubric_grades") is not None:
                extras.append(extra.get("rubric_grades"))

            errors: list[str]
            if responses[k]:
                message, errors = _response(responses[k]), []
            else:
                message, errors = reader.action(ac, k)
            following = nexts[k] or (prompts[k + 1] if k + 1 < len(prompts) else [])
            feedback: Sequence[Mapping[str, object]]
            if following:
                feedback = feedback_after(following, k)
            else:
                feedback = reader.feedback(obs[k], ac, obs[k + 1], bool(message.get("tool_calls")))
            with ep.turn() as turn:
                errors += record_assistant(
                    sampled(turn, ac),
                    message,
                    feedback,
                    model=model,
                    finish_reason=stop_reason,
                    input_tokens=token_count(obs[k]) or field(tr, "ob_len"),
                    output_tokens=token_count(ac) or field(tr, "ac_len"),
                )
            parse_errors.extend(errors)
            status, reason = _worse((status, reason), _step_status(stop_reason, metrics, errors))

        ended = field(trajectory, "stop_reason")
        if ended is not None:
            status, reason = _worse((status, reason), _trajectory_status(ended))
        if not transitions:
            status, reason = c.STATUS_ERROR, "empty trajectory"
        ep.set_attribute(c.RL_TURN_COUNT, len(transitions))
        ep.set_attribute(c.RL_METADATA_PREFIX + "steps", steps_meta)
        if parse_errors:
            ep.set_attribute(c.RL_TOOL_PARSE_ERROR, parse_errors)
        if reward_data:
            ep.set_attribute(c.RL_METADATA_PREFIX + "reward_data", reward_data)
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
        components = _components(terms)
        components["transitions"] = sum(step_rewards)
        if final is not None:
            components["final"] = final
        advantage, problem = as_float(cols.value("advantages", t),
                                      f"sample {episode_id}: advantage")
        mark_invalid(ep, problem)
        ep.reward(total, components=components, advantage=advantage)
        ep.finish(reason=reason or (str(ended) if ended is not None else last_stop), status=status)
    return prompt


def _plain(value: object) -> object:
    """A copy of a mapping (None when empty); anything else as it is."""
    if isinstance(value, Mapping):
        return dict(value) or None
    return value


def _prompt(prompts: list[list[Message]], ob: object, reader: _Reader) -> Prompt:
    """The initial prompt: the first trace's leading messages, else the first observation."""
    for messages in prompts[:1]:
        if messages:
            return leading_prompt(messages) or messages
    return reader.prompt(ob)


def _response(messages: list[Message]) -> Message:
    """The assistant message of a step's trace."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return m
    return dict(messages[-1], role="assistant")


def _positive(metrics: object, key: str) -> bool:
    if not isinstance(metrics, Mapping) or key not in metrics:
        return False
    number, _ = as_float(metrics.get(key))
    return bool(number)


def _step_status(stop_reason: object, metrics: object, parse_errors: list[str]) -> tuple[str, str | None]:
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


def _trajectory_status(stop_reason: object) -> tuple[str, str | None]:
    name = str(getattr(stop_reason, "value", stop_reason))
    status = _STOP_STATUS.get(name)
    if status is None:
        warn_unknown(ADAPTER, "Trajectory.stop_reason", f"{name!r} is not a StopReason this adapter "
                     "knows: recorded as the finish reason, status ok")
        return c.STATUS_OK, None
    return status, None if status == c.STATUS_OK else name


_RANK = {c.STATUS_OK: 0, c.STATUS_TRUNCATED: 1, c.STATUS_ERROR: 2}


def _worse(a: tuple[str, str | None], b: tuple[str, str | None]) -> tuple[str, str | None]:
    return b if _RANK[b[0]] > _RANK[a[0]] else a


def _reward_terms(metrics: object, k: int, keys: tuple[str, ...]) -> list[tuple[int, str, float]]:
    if not isinstance(metrics, Mapping):
        return []
    out = []
    for key in keys:
        if key in metrics:
            number, _ = as_float(metrics[key])
            if number is not None:
                out.append((k, key, number))
    return out


def _components(terms: list[tuple[int, str, float]]) -> dict[str, float]:
    """Reward-term metrics by key; ``t<k>.<key>`` for a key that several steps carry."""
    steps_of: dict[str, int] = {}
    for _, key, _ in terms:
        steps_of[key] = steps_of.get(key, 0) + 1
    return {(f"t{k}.{key}" if steps_of[key] > 1 else key): value for k, key, value in terms}
