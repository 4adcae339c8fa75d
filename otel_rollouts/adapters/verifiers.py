"""Prime Intellect's ``verifiers`` rollouts (its ``Trace`` / ``Episode`` objects) as episode traces.

verifiers (0.4, the ``verifiers.v1`` stack) records every rollout itself, as a ``Trace``: the
message graph (``nodes``), each model call (``calls``: model, finish reason, usage, wall time,
error), the named weighted ``rewards`` and unweighted ``metrics`` of the task's ``@reward`` /
``@metric`` functions, ``timing`` per phase, the stop condition and every error. An
``Env.run_episode`` returns an ``Episode`` holding its agents' traces (one per agent run), with
the consumer's ``group`` and ``run``. This adapter reads those objects after the fact::

    from otel_rollouts.adapters import verifiers as otr_verifiers
    episodes = await asyncio.gather(*(env.run_episode(task, ctx) for task in tasks))
    otr_verifiers.record_traces(episodes, step=step)          # Episodes, Traces, or lists of them

Without editing verifiers' source: ``traced(env, step=...)`` wraps that env instance's
``run_episode`` (the method every verifiers runner calls: ``vf-eval``'s slots, the env server
prime-rl talks to, GEPA) so each finished ``Episode`` is recorded as it returns; ``step`` is an
int or a callable read at each episode (a trainer's current step). prime-rl runs environments
in env-server processes, so there the wrapper goes where the env is built, or the trainer calls
``record_traces`` on the episodes it receives (docs/adapters/verifiers.md).

verifiers is never imported: its objects are read by field name (``kit.field``). Tested on
verifiers 0.4.0; a newer release is warned once (``check_release``).

Field → attribute mapping (one otel-rollouts episode per verifiers ``Trace``):

=====================================  =========================================================
verifiers                              otel-rollouts
=====================================  =========================================================
``Trace.id``                           ``rl.episode.id``
``Episode.group.id``, else             ``rl.group.id`` (verifiers groups the rollouts of one
``Trace.task.key``                     task; a consumer's ``GroupInfo`` wins)
``Episode.env.id``                     ``rl.dataset.name``
``Trace.task.data.idx``                ``rl.dataset.index``
final branch (``Trace.branches[-1]``)  ``prompt`` (messages before the first sampled assistant
                                       message), one ``turn`` per assistant message: ``chat``
                                       span with the call's model, finish reason and usage; its
                                       ``tool_calls`` → ``execute_tool`` spans with the tool
                                       messages' results; other messages → feedback; no
                                       message (the first call failed): ``task.data.prompt``
``rewards[name]`` (score × weight)     ``rl.reward.component.<name>`` (weighted: the
                                       components sum to the reward); ``rl.reward.score`` =
                                       ``Trace.reward``; none when any reward is ``None``
                                       (scoring did not run)
``metrics[name]``                      ``rl.metadata.metric.<name>`` (never rewards)
``stop_condition``                     ``rl.metadata.stop_condition``; the finish reason when the
                                       last model call has none
last model call's ``finish_reason``    finish reason (``length`` → ``rl.status=truncated``)
``errors`` / ``ok``                    ``rl.status=error``, the last error in
                                       ``rl.metadata.error`` (``Type: message``)
``is_truncated`` / ``is_timeout``      ``rl.status=truncated``
``timing``                             ``rl.duration.seconds`` (start to the last phase's end);
                                       ``rl.stage.generation.seconds`` = ``agent.model``,
                                       ``rl.stage.environment.seconds`` = ``boot`` + ``setup`` +
                                       ``agent.harness`` + ``finalize``,
                                       ``rl.stage.reward.seconds`` = ``scoring``
``agent.name`` / ``verifiers.version``  ``rl.metadata.agent`` / ``rl.metadata.verifiers_version``
=====================================  =========================================================

Not recorded: token ids, masks and logprobs of the nodes (empty unless a renderer-backed
``TrainClient`` filled them), the other branches of a branched graph (the final one is the
episode), ``info``, ``extra_usage`` (judge calls), ``request_rewrites`` / ``response_rewrites``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts.adapters.kit import (
    Sample,
    as_float,
    check_release,
    describe_framework,
    field,
    guarded,
    read_samples,
    record_samples,
    report,
    seconds,
    split_name,
    status_for,
    to_list,
)

if TYPE_CHECKING:
    from otel_rollouts import Episode

__all__ = ["record_prime_rl_rollouts", "record_traces", "traced"]

FRAMEWORK = "verifiers"
DISTRIBUTION = "verifiers"
TESTED = ("0.4.0",)
# verifiers' stop conditions that mean the rollout was cut short by a limit (Trace.is_truncated)
TRUNCATING_STOPS = frozenset({"max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens",
                              "compaction_failed"})


@guarded
def record_traces(rollouts: object, *, step: int, split: str = "train", model: str | None = None) -> int:
    """Record each verifiers ``Trace`` in ``rollouts`` as one episode; returns how many.

    ``rollouts``: an ``Episode`` (its traces, with its group and env), a ``Trace``, or a list of
    them (what ``asyncio.gather`` over ``Env.run_episode`` returns). ``step``: the training step
    (``rl.step``); ``split``: ``train`` or ``eval``; ``model``: the policy's name where a model
    call does not say."""
    return _record(_flatten(rollouts), step=step, split=split, model=model)


@guarded
def record_prime_rl_rollouts(run_dir: str | os.PathLike[str], *, step: int, kind: str = "train",
                             model: str | None = None) -> int:
    """Record one step of the episodes prime-rl wrote (its ``FileMonitor``); returns how many.

    prime-rl appends each ``vf.Episode.to_record()`` as a JSON line to
    ``<run_dir>/rollouts/step_<step>/<kind>/<cohort>/traces.jsonl``: cohort ``all`` (every
    episode, errored ones included) and ``effective`` (the traces it trains on: admitted,
    sampled, not cancelled, no error, trainable; a subset of ``all``). Each trace of ``all`` is
    recorded once, ``kind`` (``train`` / ``eval``) as the split, and
    ``rl.metadata.prime_rl.effective`` says whether it is in ``effective`` (absent when that
    file is not there). Read as JSON: verifiers is not needed to read the files."""
    base = Path(run_dir) / "rollouts" / f"step_{step}" / kind
    rows = _flatten(_json_lines(base / "all" / "traces.jsonl"))
    effective_path = base / "effective" / "traces.jsonl"
    extra: dict[str, object] = {}
    if effective_path.exists():
        effective = {field(trace, "id") for trace, _ in _flatten(_json_lines(effective_path))}
        extra = {str(field(trace, "id")): field(trace, "id") in effective for trace, _ in rows}
    return _record(rows, step=step, split=kind, model=model,
                   metadata=lambda trace: {} if not extra else {"prime_rl.effective": extra[str(field(trace, "id"))]})


def _json_lines(path: Path) -> list[object]:
    """The JSON records of a JSONL file (a line that does not parse is reported, not raised)."""
    out: list[object] = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as exc:
                    report(f"verifiers adapter: {path} line {n}: not JSON ({exc})")
    return out


def _record(rows: list[tuple[object, object]], *, step: int, split: str, model: str | None,
            metadata: Callable[[object], Mapping[str, object]] | None = None) -> int:
    """Record the (trace, episode) rows as one step's samples."""
    check_release(FRAMEWORK, DISTRIBUTION, TESTED)
    describe_framework(FRAMEWORK, DISTRIBUTION, model_name=model)

    def read(i: int) -> Sample:
        sample = _sample(rows[i], i, model)
        if metadata is not None:
            sample.metadata = {**(sample.metadata or {}), **metadata(rows[i][0])}
        return sample

    samples = read_samples(range(len(rows)), read, FRAMEWORK)
    return record_samples(samples, step=step, split=split_name(split), framework=FRAMEWORK)


def traced(env: Any, *, step: int | Callable[[], int], split: str = "train",
               model: str | None = None) -> Any:
    """Record every ``Episode`` that ``env.run_episode`` returns (this instance only; verifiers'
    source is not edited); returns ``env``. ``step``: an int, or a callable read per episode."""
    run_episode = getattr(env, "run_episode", None)
    if not callable(run_episode):
        report(f"verifiers adapter: traced: {type(env).__name__} has no run_episode; nothing is recorded")
        return env

    async def recording_run_episode(*args: Any, **kwargs: Any) -> Any:
        episode = await run_episode(*args, **kwargs)
        try:
            current = step() if callable(step) else step
        except Exception as exc:  # noqa: BLE001 - the user's step callable never breaks the rollout
            report(f"verifiers adapter: traced: step() raised: {exc!r}; episode not recorded", exc=exc)
            return episode
        record_traces(episode, step=current, split=split, model=model)
        return episode

    env.run_episode = recording_run_episode
    return env


def _flatten(rollouts: object) -> list[tuple[object, object]]:
    """(trace, its Episode or None) for each trace in ``rollouts``, in order."""
    if field(rollouts, "traces") is not None or field(rollouts, "nodes") is not None:
        items: Iterable[object] = [rollouts]
    else:
        items = to_list(rollouts) or []
    out: list[tuple[object, object]] = []
    for item in items:
        traces = field(item, "traces")
        if traces is not None and field(item, "nodes") is None:
            out.extend((trace, item) for trace in to_list(traces) or [])
        else:
            out.append((item, None))
    return out


def _sample(row: tuple[object, object], index: int, model: str | None) -> Sample:
    """One verifiers ``Trace`` (and its ``Episode``) read as a ``Sample``."""
    trace, episode = row
    problems: list[str] = []
    components: dict[str, float | None] = {}
    for name, reward in (field(trace, "rewards") or {}).items():
        if reward is None:
            components[str(name)] = None
            continue
        score, problem = as_float(field(reward, "score"), f"rewards.{name}.score")
        weight, weight_problem = as_float(field(reward, "weight", default=1.0), f"rewards.{name}.weight")
        problems += [p for p in (problem, weight_problem) if p]
        components[str(name)] = None if score is None or weight is None else score * weight
    total = sum(v for v in components.values() if v is not None) \
        if components and all(v is not None for v in components.values()) else None

    metadata: dict[str, object] = {}
    for name, value in (field(trace, "metrics") or {}).items():
        number, problem = as_float(value, f"metrics.{name}")
        if problem:
            problems.append(problem)
        elif number is not None:
            metadata[f"metric.{name}"] = number
    stop = field(trace, "stop_condition")
    if stop is not None:
        metadata["stop_condition"] = str(stop)
    errors = to_list(field(trace, "errors")) or []
    if errors:
        last = errors[-1]
        metadata["error"] = f"{field(last, 'type')}: {field(last, 'message')}"
    agent = field(trace, "agent")
    if field(agent, "name") is not None:
        metadata["agent"] = str(field(agent, "name"))
    version = field(field(trace, "verifiers"), "version")
    if version is not None:
        metadata["verifiers_version"] = str(version)

    calls = to_list(field(trace, "calls")) or []
    last_reason = next((field(call, "finish_reason") for call in reversed(calls)
                        if field(call, "error") is None and field(call, "finish_reason") is not None), None)
    finish_reason = last_reason if last_reason is not None else stop
    if errors or field(trace, "ok") is False:
        status = c.STATUS_ERROR
    elif stop in TRUNCATING_STOPS or field(trace, "is_timeout") or status_for(last_reason) == c.STATUS_TRUNCATED:
        status = c.STATUS_TRUNCATED
    else:
        status = c.STATUS_OK

    task = field(trace, "task")
    group = field(field(episode, "group"), "id")
    duration, stages = _times(field(trace, "timing"))
    return Sample(
        content=lambda ep: _record_turns(ep, trace, model),
        episode_id=str(field(trace, "id")) if field(trace, "id") is not None else None,
        group_id=group if group is not None else field(task, "key"),
        sample_index=index,
        dataset_name=field(field(episode, "env"), "id") or None,
        dataset_index=field(field(task, "data"), "idx"),
        metadata=metadata,
        reward=total,
        components=components or None,
        finish_reason=finish_reason,
        status=status,
        problems=problems,
        duration=duration,
        stages=stages,
    )


def _times(timing: object) -> tuple[float | None, dict[str, float | None]]:
    """``Trace.timing`` as the rollout's wall time and seconds per stage (absent: not measured)."""
    if timing is None:
        return None, {}
    phases = {name: field(timing, name) for name in ("boot", "setup", "agent", "finalize", "scoring")}

    def span(name: str) -> float | None:
        start, end = seconds(field(phases[name], "start")), seconds(field(phases[name], "end"))
        return end - start if start is not None and end and end >= start else None

    ends = [e for p in phases.values() if (e := seconds(field(p, "end")))]
    start = seconds(field(timing, "start"))
    duration = max(ends) - start if ends and start is not None and max(ends) >= start else None
    agent = phases["agent"]
    environment = [v for v in (span("boot"), span("setup"), seconds(field(field(agent, "harness"), "duration")),
                               span("finalize")) if v is not None]
    return duration, {
        c.STAGE_GENERATION: seconds(field(field(agent, "model"), "duration")),
        c.STAGE_ENVIRONMENT: sum(environment) if environment else None,
        c.STAGE_REWARD: span("scoring"),
    }


def _branch(trace: object) -> tuple[list[object], dict[int, object]]:
    """The final branch's nodes and the model call of each sampled node (by node index)."""
    nodes = to_list(field(trace, "nodes")) or []
    leaf = len(nodes) - 1
    branches = field(trace, "branches")  # verifiers' own root-to-leaf paths
    path: list[int] = []
    listed = to_list(branches) or []
    if listed:
        last = listed[-1]
        by_identity = {id(node): k for k, node in enumerate(nodes)}
        path = [by_identity[id(n)] for n in to_list(field(last, "nodes")) or [] if id(n) in by_identity]
    if not path:
        seen: set[int] = set()
        k: object = leaf if nodes else None
        while isinstance(k, int) and 0 <= k < len(nodes) and k not in seen:
            seen.add(k)
            path.append(k)
            k = field(nodes[k], "parent")
        path.reverse()
    calls = {field(call, "node"): call for call in to_list(field(trace, "calls")) or []}
    return [nodes[k] for k in path], {k: calls[k] for k in path if k in calls}


def _message(node: object) -> dict[str, Any]:
    """A node's message as an OpenAI-style dict (verifiers' ``ToolCall`` → ``function`` form)."""
    return _message_dict(field(node, "message"))


def _message_dict(message: object) -> dict[str, Any]:
    """A verifiers message (a pydantic model or a mapping) as an OpenAI-style dict."""
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        message = dump(exclude_none=True)
    if not isinstance(message, Mapping):  # not a message: kept as text, never guessed a role
        return {"role": "environment", "content": None if message is None else str(message)}
    out: dict[str, Any] = dict(message)
    calls = out.pop("tool_calls", None)
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [{"id": call.get("id"), "type": "function",
                              "function": {"name": call.get("name"), "arguments": call.get("arguments")}}
                             for call in calls if isinstance(call, Mapping)]
    return out


def _record_turns(ep: Episode, trace: object, model: str | None) -> None:
    """The final branch as a prompt and one turn per sampled assistant message."""
    nodes, by_node = _branch(trace)
    if not nodes:  # the first model call failed before verifiers stored a message: the task's prompt
        prompt = field(field(field(trace, "task"), "data"), "prompt")
        if prompt is not None:
            listed = to_list(prompt) if not isinstance(prompt, str) else None
            ep.prompt([_message_dict(m) for m in listed] if listed else str(prompt))
        return
    indexed = list(zip(range(len(nodes)), nodes, strict=True))
    assistants = [k for k, node in indexed if field(node, "sampled") and _message(node).get("role") == "assistant"]
    first = assistants[0] if assistants else len(nodes)
    ep.prompt([_message(node) for node in nodes[:first]])
    node_index = {id(node): k for k, node in enumerate(to_list(field(trace, "nodes")) or [])}
    for a, k in enumerate(assistants):
        message = _message(nodes[k])
        end = assistants[a + 1] if a + 1 < len(assistants) else len(nodes)
        rest = [_message(node) for node in nodes[k + 1:end]]
        call = by_node.get(node_index.get(id(nodes[k]), -1))
        usage = field(call, "usage")
        with ep.turn() as turn:
            tool_calls = message.pop("tool_calls", None)
            turn.record_generation(message.get("content") or "", model=field(call, "model") or model,
                                   tool_calls=tool_calls, finish_reason=field(call, "finish_reason"),
                                   input_tokens=field(usage, "prompt_tokens"),
                                   output_tokens=field(usage, "completion_tokens"))
            results = {m.get("tool_call_id"): m for m in rest if m.get("role") == "tool"}
            for tool_call in tool_calls or []:
                fn = tool_call["function"]
                handle = turn.tool_call(str(fn.get("name") or "tool"), arguments=fn.get("arguments"),
                                        call_id=str(tool_call.get("id")))
                answer = results.pop(tool_call.get("id"), None)
                handle.result("" if answer is None else answer.get("content"))
            for m in rest:
                if m.get("role") == "tool" and m.get("tool_call_id") not in results:
                    continue
                turn.feedback(m.get("content"), role=str(m.get("role") or "environment"))
