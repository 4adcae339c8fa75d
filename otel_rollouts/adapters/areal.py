"""AReaL (areal-project/AReaL) tensor trajectories as episode traces.

Call it where AReaL's trainer has the rollout batch — after ``actor.prepare_batch(...)`` for
training, after ``eval_rollout.wait(...)`` for evaluation::

    from otel_rollouts.adapters import areal
    areal.record_trajectories(rollout_batch, step=global_step, tokenizer=tokenizer)
    areal.record_trajectories(eval_batch, step=global_step, tokenizer=tokenizer, split="eval")

``trajectories`` is AReaL's list with one dict per accepted group, tensors shaped
``[group_size, seqlen]`` (``input_ids``, ``attention_mask``, ``loss_mask``, ``versions``,
``rewards`` ``[group_size]``...), or ``None`` for a rejected trajectory. Torch tensors (any
device), ``RTensor``-like objects (``.to_local()``), numpy arrays and lists work; AReaL is never
imported.

Fixes compared with the hand-written logger (DESIGN.md §7): each tensor leaves the device once
per group, not per sample; a ``None`` entry becomes an episode with ``rl.status=filtered``
instead of a crash or silence; ``rl.policy.version`` comes from generated tokens only (the
``-1`` placeholders on prompt tokens are ignored); multi-turn samples are split by the loss mask
(decoded only when kept), or taken from structured ``messages`` when the workflow stored them;
a sample without generated tokens is still recorded (as an error naming it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import otel_rollouts as otr
from otel_rollouts._guard import guarded
from otel_rollouts.adapters._common import (
    COUNT_FILTERED,
    COUNT_PARTIAL,
    count,
    field,
    generated_versions,
    mark_invalid,
    mark_partial,
    replay_messages,
    reward_total,
    split_name,
    to_list,
)
from otel_rollouts.conventions import RL_POLICY_VERSION_MAX, RL_POLICY_VERSION_MIN, STATUS_FILTERED
from otel_rollouts.decode import record_token_batch

__all__ = ["record_trajectories"]

FRAMEWORK = "areal"
_PER_SAMPLE = ("attention_mask", "loss_mask", "versions", "rewards", "logprobs")
_MESSAGE_KEYS = ("messages", "conversation")


@guarded
def record_trajectories(
    trajectories: Any,
    *,
    step: int,
    tokenizer: Any,
    split: str = "train",
    model: str | None = None,
) -> int:
    """Record every sample of every trajectory group as one episode; returns how many.

    * ``step``: AReaL's ``global_step`` (``rl.step``; the tail sampler caps per step and split).
    * ``split``: ``train`` / ``eval`` (AReaL's ``rollout`` / ``eval-rollout`` are understood).
    * ``tokenizer``: decodes token ids, only for the episodes the sampler keeps.
    """
    split = split_name(split)
    if isinstance(trajectories, Mapping):
        trajectories = [trajectories]
    recorded = 0
    sample_offset = 0
    for index, trajectory in enumerate(trajectories or []):
        if trajectory is None:
            _filtered(index, step=step, split=split)
            recorded += 1
            continue
        n = _record_group(trajectory, index, sample_offset, step=step, split=split,
                          tokenizer=tokenizer, model=model)
        recorded += n
        sample_offset += n
    return recorded


@guarded
def _filtered(index: int, *, step: int, split: str) -> None:
    """A rejected trajectory (``None`` from ``wait()``): nothing but its place is known."""
    with otr.episode(step=step, split=split, group_id=str(index),
                     episode_id=f"{split}-{step}-{index}-rejected", framework=FRAMEWORK,
                     metadata={"trajectory_index": index}) as ep:
        ep.prompt("")
        ep.finish(reason="rejected", status=STATUS_FILTERED)
    count(COUNT_FILTERED, step=step, split=split)


def _local(value: Any) -> Any:
    """RTensor-like objects (no ``.detach()``) are localized once; the rest is passed through."""
    to_local = getattr(value, "to_local", None)
    if callable(to_local) and not hasattr(value, "detach"):
        return to_local()
    return value


def _rows(value: Any) -> int | None:
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    try:
        return len(value)
    except TypeError:
        return None


@guarded
def _record_group(trajectory: Any, index: int, offset: int, *, step: int, split: str,
                  tokenizer: Any, model: str | None) -> int:
    input_ids = _local(field(trajectory, "input_ids"))
    values = {name: _local(field(trajectory, name)) for name in _PER_SAMPLE}
    messages = next((field(trajectory, k) for k in _MESSAGE_KEYS if field(trajectory, k) is not None), None)
    size = _rows(input_ids)
    if size is None:
        size = len(messages) if isinstance(messages, list) else 0
    # explicit alignment: a column with another number of rows covers only its prefix
    ragged = {name: rows for name, v in values.items() if (rows := _rows(v)) is not None and rows != size}
    metadata = []
    for j in range(size):
        entry: dict[str, Any] = {"trajectory_index": index, "sample_index_in_group": j}
        missing = [f"{name}[{rows}!={size}]" for name, rows in ragged.items() if j >= rows]
        if missing:
            # record_token_batch takes no per-sample attributes: marked in metadata, counted here
            entry["alignment"] = "partial"
            entry["alignment_missing"] = missing
        metadata.append(entry)
    episode_ids = [f"{split}-{step}-{index}-{j}" for j in range(size)]
    if _has_structured(messages, size):
        _record_messages(messages, values, index, offset, episode_ids, metadata,
                         step=step, split=split, model=model)
        return size
    if input_ids is None:
        return 0
    # record_token_batch takes no per-sample attributes: partial samples are marked in their
    # metadata (rl.metadata.alignment) and counted here
    count(COUNT_PARTIAL, sum(1 for e in metadata if "alignment" in e), step=step, split=split)
    record_token_batch(
        input_ids,
        tokenizer=tokenizer,
        step=step,
        split=split,
        loss_mask=values["loss_mask"],
        attention_mask=values["attention_mask"],
        rewards=values["rewards"],
        versions=values["versions"],
        group_ids=[str(index)] * size,
        episode_ids=episode_ids,
        sample_indices=list(range(offset, offset + size)),
        metadata=metadata,
        framework=FRAMEWORK,
        model=model,
    )
    return size


def _has_structured(messages: Any, size: int) -> bool:
    return (isinstance(messages, list) and len(messages) == size and size > 0
            and all(isinstance(m, list) for m in messages))


def _record_messages(messages: list[Any], values: dict[str, Any], index: int, offset: int,
                     episode_ids: list[str], metadata: list[dict[str, Any]], *, step: int,
                     split: str, model: str | None) -> None:
    """A workflow that stored chat messages per sample: replay them, no decoding needed."""
    # one host transfer per tensor for the whole group
    reward_list = to_list(values.get("rewards")) or []
    versions = to_list(values.get("versions")) or []
    masks = to_list(values.get("loss_mask")) or []
    for j, conversation in enumerate(messages):
        lo, hi = generated_versions(versions[j] if j < len(versions) else None,
                                    masks[j] if j < len(masks) else None)
        with otr.episode(step=step, split=split, group_id=str(index), sample_index=offset + j,
                         episode_id=episode_ids[j], framework=FRAMEWORK, policy_version=hi,
                         metadata=metadata[j]) as ep:
            if lo is not None and lo != hi:
                ep.set_attribute(RL_POLICY_VERSION_MIN, lo)
                ep.set_attribute(RL_POLICY_VERSION_MAX, hi)
            mark_partial(ep, metadata[j].get("alignment_missing", []))
            replay_messages(ep, conversation, model=model)
            if j < len(reward_list):
                total, _, problem = reward_total(reward_list[j], f"rewards[{j}]")
                mark_invalid(ep, problem)
                if total is not None:
                    ep.reward(total)
