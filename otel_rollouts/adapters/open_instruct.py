"""Open-Instruct (allenai/open-instruct) GRPO batches as episode traces.

Call it where Open-Instruct's data-preparation actor has a scored batch (after advantages are
computed), for train and for eval batches::

    from otel_rollouts.adapters import open_instruct
    open_instruct.record_batch(batch, result, step=training_step, advantages=advantages,
                               num_samples_per_prompt=args.num_samples_per_prompt_rollout,
                               tokenizer=tokenizer)

``batch`` is Open-Instruct's ``Batch`` (``queries``, ``raw_queries``, ``decoded_responses``,
``scores``, ``datasets``, ``indices``, ``model_steps``...), ``result`` its ``GenerationResult``
(``responses``, ``finish_reasons``, ``masks``, ``request_info`` with the tool-call stats). Any
object, dataclass or dict with those names works: Open-Instruct is never imported.

What it fixes compared with the hand-written logger (DESIGN.md §7): every sample becomes an
episode (the tail sampler applies the per-step cap, not head-of-batch); ragged per-sample lists
never raise — the samples they do not cover get ``rl.alignment=partial``; ``request_info`` is
ignored, not mis-paired, once ``mask_truncated_completions`` filtered the batch but not it;
groups come from dataset indices (blocked ``i // n`` only for complete layouts); a batch
without scores is still recorded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._guard import guarded
from otel_rollouts.adapters._common import (
    Columns,
    group_ids,
    items,
    lazy_text,
    mark_invalid,
    mark_partial,
    reward_total,
    set_span_attribute,
    split_name,
    status_for,
    to_list,
    turns_from_mask,
)

__all__ = ["record_batch"]

FRAMEWORK = "open-instruct"
_REQUEST_INFO_FIELDS = (
    "num_calls",
    "timeouts",
    "tool_errors",
    "tool_outputs",
    "tool_runtimes",
    "tool_calleds",
    "tool_call_stats",
    "rollout_states",
)
_ROLE_LINE = re.compile(r"^(system|user|assistant|tool|developer): ", re.MULTILINE)


@guarded
def record_batch(
    batch: Any,
    result: Any,
    *,
    step: int,
    advantages: Any = None,
    num_samples_per_prompt: int = 1,
    tokenizer: Any = None,
    split: str = "train",
    model: str | None = None,
) -> int:
    """Record every sample of an Open-Instruct batch as one episode; returns how many.

    * ``batch`` / ``result``: Open-Instruct's ``Batch`` and ``GenerationResult`` (duck-typed).
    * ``step``: the training step that consumes the batch (``rl.step``); each sample's
      ``model_steps`` entry is its policy version (``rl.policy.version``, staleness = step − it).
    * ``advantages``: per-sample advantages (numpy array or list), when computed.
    * ``num_samples_per_prompt``: the GRPO group size, used only when dataset indices are
      missing and the blocked layout is complete.
    * ``tokenizer``: decodes token ids when text is missing, and splits multi-turn tool
      responses by ``masks`` (decoded only for the episodes the sampler keeps).
    * ``split``: ``train`` or ``eval``.
    """
    split = split_name(split)
    responses = _get(result, "responses")
    decoded = _get(batch, "decoded_responses")
    queries = _get(batch, "queries")
    n = next((len(v) for v in (to_list(responses), to_list(decoded), to_list(queries)) if v is not None), 0)
    request_info = _get(result, "request_info")
    info = {name: _get(request_info, name) for name in _REQUEST_INFO_FIELDS}
    cols = Columns(
        n,
        # request_info is not filtered by mask_truncated_completions: ragged means mis-paired
        drop_if_ragged=_REQUEST_INFO_FIELDS,
        queries=queries,
        raw_queries=_get(batch, "raw_queries"),
        decoded_responses=decoded,
        responses=responses,
        masks=_get(result, "masks"),
        finish_reasons=_get(result, "finish_reasons"),
        scores=_get(batch, "scores"),
        advantages=advantages,
        datasets=_get(batch, "datasets"),
        indices=_get(batch, "indices"),
        model_steps=_get(batch, "model_steps"),
        ground_truths=_get(batch, "ground_truths"),
        **info,
    )
    complete = not cols.ragged and n > 0
    groups, _ = group_ids(
        n, ids=cols.columns.get("indices"), per_group=num_samples_per_prompt, complete=complete
    )
    for i in range(n):
        _record_sample(cols, i, step=step, split=split, group=groups[i], tokenizer=tokenizer,
                       model=model, n_per_group=num_samples_per_prompt if complete else 0)
    return n


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


@guarded
def _record_sample(cols: Columns, i: int, *, step: int, split: str, group: str | None,
                   tokenizer: Any, model: str | None, n_per_group: int) -> None:
    v = cols.value
    model_step = v("model_steps", i)
    if isinstance(model_step, (int, float)) and model_step < 0:
        model_step = None  # a placeholder, not a policy version
    metadata: dict[str, Any] = {}
    for name in ("num_calls", "timeouts", "tool_errors", "tool_runtimes"):
        value = v(name, i)
        if value not in (None, "", [], 0, False):
            metadata[name] = value
    truth = v("ground_truths", i)
    if isinstance(truth, (str, int, float)):
        metadata["ground_truth"] = truth
    if group is not None and n_per_group and n_per_group > 0:
        metadata["repetition"] = i % n_per_group
    with otr.episode(
        step=step,
        split=split,
        group_id=group,
        sample_index=i,
        policy_version=model_step,
        episode_id=f"{split}-{step}-{i}",
        dataset_name=v("datasets", i),
        dataset_index=v("indices", i),
        framework=FRAMEWORK,
        metadata=metadata or None,
    ) as ep:
        mark_partial(ep, cols.missing(i))
        if model_step is not None:
            try:
                ep.set_attribute(c.RL_STALENESS, int(step) - int(model_step))
            except (TypeError, ValueError):
                pass
        ep.prompt(_prompt(cols, i, tokenizer))
        finish = v("finish_reasons", i)
        _turns(ep, cols, i, tokenizer, model, finish)
        score = v("scores", i)
        total, _, problem = reward_total(score, f"scores[{i}]")
        mark_invalid(ep, problem)
        components = _env_rewards(v("rollout_states", i))
        advantage = v("advantages", i)
        if total is not None or components or advantage is not None:
            ep.reward(total, components=components or None, advantage=advantage)
        ep.finish(reason=finish, status=status_for(finish))


def _prompt(cols: Columns, i: int, tokenizer: Any) -> list[dict[str, Any]]:
    raw = cols.value("raw_queries", i)
    if isinstance(raw, str) and raw:
        return _unflatten(raw)
    query = cols.value("queries", i)
    if query is not None and tokenizer is not None:
        return [{"role": "user", "content": lazy_text(tokenizer, to_list(query) or [])}]
    if isinstance(query, str):
        return [{"role": "user", "content": query}]
    return [{"role": "user", "content": ""}]


def _unflatten(text: str) -> list[dict[str, Any]]:
    """Open-Instruct's ``raw_queries`` join messages as ``"{role}: {content}"`` lines."""
    marks = list(_ROLE_LINE.finditer(text))
    if not marks or marks[0].start() != 0:
        return [{"role": "user", "content": text}]
    out = []
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        out.append({"role": m.group(1), "content": text[m.end():end].rstrip("\n")})
    return out


def _turns(ep: Any, cols: Columns, i: int, tokenizer: Any, model: str | None, finish: Any) -> None:
    v = cols.value
    stats = [items(s) for s in (v("tool_call_stats", i) or [])]
    response = to_list(v("responses", i))
    mask = to_list(v("masks", i))
    if tokenizer is not None and response and mask and len(mask) == len(response) and 0 in mask:
        def tool(turn: Any, k: int, output: Any) -> None:
            # the k-th tool output inserted into the response answers the k-th recorded call
            if k < len(stats):
                _tool(turn, stats[k], k, output)
            else:
                turn.feedback(output, role="tool")

        turns_from_mask(ep, response, mask, tokenizer, model=model, finish_reason=finish,
                        on_observation=tool)
        return
    text = v("decoded_responses", i)
    if text is None and response is not None and tokenizer is not None:
        text = lazy_text(tokenizer, response)
    with ep.turn() as turn:
        turn.record_generation(
            {"role": "assistant", "content": "" if text is None else text},
            model=model,
            finish_reason=finish,
            output_tokens=len(response) if response is not None else None,
        )
        outputs = v("tool_outputs", i)
        for k, stat in enumerate(stats):
            # per-call outputs are not kept (they are concatenated); one call owns them all
            result = outputs if len(stats) == 1 else None
            _tool(turn, stat, k, result)
        if len(stats) != 1 and outputs:
            turn.feedback(outputs, role="tool")


def _tool(turn: Any, stat: dict[str, Any], k: int, result: Any) -> None:
    name = stat.get("tool_name") or stat.get("name") or "tool"
    call = turn.tool_call(str(name), call_id=f"call_{k}")
    set_span_attribute(call, c.RL_TOOL_RUNTIME, _float_or_none(stat.get("runtime")))
    if stat.get("success") is False:
        call.error(f"{name} failed")
    else:
        call.result("" if result is None else result)


def _float_or_none(value: Any) -> float | None:
    total, _, problem = reward_total(value)
    return None if problem else total


def _env_rewards(state: Any) -> dict[str, Any]:
    """Per-environment-step rewards of a tool rollout (``RolloutState.rewards``) as components."""
    rewards = to_list(_get(state, "rewards")) if state is not None else None
    if not rewards:
        return {}
    return {f"env_step_{j}": r for j, r in enumerate(rewards)}
