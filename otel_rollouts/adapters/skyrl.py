"""SkyRL (NovaSky-AI/SkyRL) generator batches as episode traces.

Call it right after ``generator.generate(input_batch)`` — in the synchronous trainer, and in the
fully asynchronous trainer once per mini-batch or once per group, as is convenient::

    from otel_rollouts.adapters import skyrl
    skyrl.record_generator_output(generator_input, generator_output,
                                  step=trainer.global_step, tokenizer=tokenizer)

``generator_input`` is SkyRL's ``GeneratorInput`` (``prompts`` as chat messages, already expanded
per sample; ``env_classes``, ``env_extras``, ``trajectory_ids``, ``batch_metadata``),
``generator_output`` its ``GeneratorOutput`` (``response_ids``, ``rewards`` — scalar or per
token —, ``loss_masks``, ``stop_reasons``, step-wise rows with ``is_last_step``...). TypedDicts,
dicts or objects all work; SkyRL is never imported.

Fixes compared with the hand-written logger (DESIGN.md §7):

* ``step`` is the *training* step that consumes the rollouts. The tail sampler's cap holds per
  (step, split), so calling this once per group in the fully-async trainer cannot log
  groups × cap traces; each group's own scheduling step (``batch_metadata.global_step``) is its
  policy version, and ``rl.staleness`` = step − it.
* rows map to prompts and groups by ``trajectory_ids``; without ids, the blocked layout is
  used only when it is complete; step-wise rows of one trajectory become one episode.
* eval batches (``training_phase="eval"``) are recorded under the ``eval`` split.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._guard import guarded
from otel_rollouts.adapters._common import (
    COUNT_DUPLICATE,
    Columns,
    count,
    field,
    first_occurrences,
    group_ids,
    mark_invalid,
    mark_partial,
    reward_total,
    split_name,
    status_for,
    to_list,
    turns_from_mask,
)

__all__ = ["record_generator_output"]

FRAMEWORK = "skyrl"


@guarded
def record_generator_output(
    generator_input: Any,
    generator_output: Any,
    *,
    step: int,
    tokenizer: Any = None,
    split: str = "train",
    n_samples_per_prompt: int | None = None,
    model: str | None = None,
) -> int:
    """Record each trajectory of a SkyRL generation as one episode; returns how many.

    * ``step``: the training step that consumes these rollouts (``rl.step``; the cap's unit).
    * ``tokenizer``: decodes ``response_ids`` (only for kept episodes); turns are split by
      ``loss_masks`` (1 = policy tokens, 0 = environment observations).
    * ``split``: ``train`` or ``eval``; ``batch_metadata.training_phase == "eval"`` means eval.
    * ``n_samples_per_prompt``: group size, used only when ``trajectory_ids`` are missing and
      the blocked layout is complete.
    """
    meta = field(generator_input, "batch_metadata")
    phase = field(meta, "training_phase")
    split = "eval" if split_name(phase, "") == "eval" else split_name(split)
    scheduled = field(meta, "global_step")
    prompts = to_list(field(generator_input, "prompts")) or []
    in_ids = to_list(field(generator_input, "trajectory_ids"))
    out = generator_output
    response_ids = to_list(field(out, "response_ids")) or []
    n = len(response_ids)
    cols = Columns(
        n,
        response_ids=response_ids,
        loss_masks=field(out, "loss_masks"),
        rewards=field(out, "rewards"),
        stop_reasons=field(out, "stop_reasons"),
        trajectory_ids=field(out, "trajectory_ids"),
        is_last_step=field(out, "is_last_step"),
        env_metrics=field(out, "env_metrics"),
        prompt_token_ids=field(out, "prompt_token_ids"),
    )
    # trajectory id of each row (input ids stand in when the output has none and rows == inputs)
    row_tids = cols.columns.get("trajectory_ids")
    if row_tids is None and in_ids is not None and len(in_ids) == n:
        row_tids = in_ids
    keys = [_tid_string(t) for t in row_tids] if row_tids is not None else [None] * n
    keys += [None] * (n - len(keys))
    # row -> prompt index: by trajectory id, else blocked when complete
    input_index = {_tid_string(t): j for j, t in enumerate(in_ids or [])}
    per_prompt = n // len(prompts) if prompts and n % len(prompts) == 0 else None
    # step-wise mode: rows of one trajectory (one per turn) form one episode; otherwise a
    # repeated trajectory id is a duplicate, recorded once
    stepwise = cols.has("is_last_step")
    if stepwise:
        rows_of: dict[Any, list[int]] = {}
        for i in range(n):
            rows_of.setdefault(keys[i] if keys[i] is not None else ("row", i), []).append(i)
        episodes = list(rows_of.values())
    else:
        keep, dups = first_occurrences(keys)
        count(COUNT_DUPLICATE, dups, step=step, split=split)
        episodes = [[i] for i in keep]
    groups, _ = group_ids(
        n,
        ids=row_tids,
        key=lambda t: field(t, "instance_id") if not isinstance(t, str) else t.rsplit("_", 1)[0],
        per_group=n_samples_per_prompt,
        complete=not cols.ragged and bool(n_samples_per_prompt),
    )
    recorded = 0
    for number, rows in enumerate(episodes):
        first = rows[0]
        j = input_index.get(keys[first]) if keys[first] is not None else None
        if j is None and per_prompt is not None and not stepwise:
            j = first // per_prompt
        prompt = prompts[j] if j is not None and j < len(prompts) else None
        _record(
            cols, rows, step=step, split=split, scheduled=scheduled, prompt=prompt,
            prompt_found=j is not None and j < len(prompts), input_index=j,
            episode_id=keys[first] if keys[first] is not None else f"{split}-{step}-{first}",
            group=groups[first], env_class=_at(field(generator_input, "env_classes"), j),
            env_extras=_at(field(generator_input, "env_extras"), j), tokenizer=tokenizer,
            model=model, sample_index=number,
        )
        recorded += 1
    return recorded


def _tid_string(tid: Any) -> str | None:
    if tid is None:
        return None
    if isinstance(tid, str):
        return tid
    to_string = getattr(tid, "to_string", None)
    if callable(to_string):
        return str(to_string())
    instance, rep = field(tid, "instance_id"), field(tid, "repetition_id")
    return None if instance is None else f"{instance}_{rep}"


def _at(values: Any, j: int | None) -> Any:
    values = to_list(values)
    if values is None or j is None or j >= len(values):
        return None
    return values[j]


@guarded
def _record(cols: Columns, rows: list[int], *, step: int, split: str, scheduled: Any, prompt: Any,
            prompt_found: bool, input_index: int | None, episode_id: str, group: str | None,
            env_class: Any, env_extras: Any, tokenizer: Any, model: str | None,
            sample_index: int) -> None:
    v = cols.value
    last = rows[-1]
    metadata: dict[str, Any] = {"rows": len(rows)} if len(rows) > 1 else {}
    if input_index is not None:
        metadata["input_index"] = input_index
    if scheduled is not None:
        metadata["scheduled_step"] = scheduled
    if isinstance(env_extras, Mapping):
        metadata.update({f"env_extras.{k}": x for k, x in env_extras.items()
                         if isinstance(x, (str, int, float, bool))})
    with otr.episode(
        step=step,
        split=split,
        group_id=group,
        sample_index=sample_index,
        policy_version=scheduled,
        episode_id=episode_id,
        dataset_name=env_class,
        framework=FRAMEWORK,
        metadata=metadata or None,
    ) as ep:
        missing = [m for i in rows for m in cols.missing(i)]
        if not prompt_found:
            missing.append("prompts")
        mark_partial(ep, sorted(set(missing)))
        if scheduled is not None:
            try:
                ep.set_attribute(c.RL_STALENESS, int(step) - int(scheduled))
            except (TypeError, ValueError):
                pass
        ep.prompt(prompt if prompt is not None else "")
        finish = v("stop_reasons", last)
        total: float | None = None
        per_row: dict[str, float] = {}
        for k, i in enumerate(rows):
            ids = to_list(v("response_ids", i)) or []
            mask = to_list(v("loss_masks", i))
            if mask is None or len(mask) != len(ids):
                mask = [1] * len(ids)
            turns_from_mask(ep, ids, mask, tokenizer, model=model,
                            finish_reason=v("stop_reasons", i))
            reward, _, problem = reward_total(v("rewards", i), f"rewards[{i}]")
            mark_invalid(ep, problem)
            if reward is not None:
                total = reward if total is None else total + reward
                if len(rows) > 1:
                    per_row[f"turn_{k}"] = reward
        components = dict(per_row)
        metrics = v("env_metrics", last)
        if isinstance(metrics, Mapping):
            for name, value in metrics.items():
                number, _, problem = reward_total(value)
                if number is not None and problem is None:
                    components[str(name)] = number
        if total is not None or components:
            ep.reward(total, components=components or None)
        ep.finish(reason=finish, status=status_for(finish))
