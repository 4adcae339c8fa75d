"""AReaL (areal-project/AReaL) trajectories as episode traces.

Call it where AReaL's trainer has the rollout batch — after ``actor.prepare_batch(...)`` for
training, after ``eval_rollout.wait(...)`` for evaluation::

    from otel_rollouts.adapters import areal
    areal.record_trajectories(rollout_batch, step=global_step, tokenizer=tokenizer)
    areal.record_trajectories(eval_batch, step=global_step, tokenizer=tokenizer, split="eval")

``trajectories`` is AReaL's list with one dict per accepted group (``GroupedRolloutWorkflow``
concatenates the group's samples with ``concat_padded_tensors``: tensors ``[group_size, seqlen]``,
right-padded with 0), or ``None`` for a rejected trajectory. Torch tensors (any device), AReaL's
``RTensor`` (localized once with ``.to_local()``), numpy arrays and lists work; AReaL is never
imported. Each tensor leaves the device once per group, never per sample.

Field → attribute (one episode per row of a group):

================================  =====================================================================
AReaL                             recorded as
================================  =====================================================================
``input_ids`` + ``loss_mask``     first mask-0 run: the prompt, split into its messages by the chat
                                  template's role markers; each mask-1 run: a turn (``chat`` span,
                                  assistant text without template markup / EOS; Hermes ``<tool_call>``
                                  blocks become ``execute_tool`` spans); each later mask-0 run: the
                                  feedback to that turn in its real role (``MultiTurnWorkflow``'s
                                  retry prompt is a ``user`` message, a ``<tool_response>`` a tool
                                  result) — decoded only for the episodes the sampler keeps
``attention_mask``                the real tokens (padding left out)
``rewards[i]``                    ``rl.reward`` — the only reward term AReaL carries (in
                                  ``MultiTurnWorkflow`` already discounted by ``turn_discount``)
``versions`` (per token, −1 on    ``rl.policy.version`` = newest version of the generated tokens
non-generated tokens)             (``loss_mask == 1``; −1 placeholders and padding ignored);
                                  ``rl.policy.version.min/max`` when a sample spans several versions
trainer version                   ``rl.staleness`` = ``trained_version − rl.policy.version``
                                  (``trained_version`` defaults to ``step`` for training, see below)
number of mask-1 runs             ``rl.turn.count`` (AReaL's ``num_turns``: one per generation)
finish reason                     ``stop`` when the last generated token is the tokenizer's EOS
group / row                       ``rl.group.id`` = trajectory index; ``rl.metadata.trajectory_index``,
                                  ``rl.metadata.sample_index_in_group``; ``rl.sample.index`` counts
                                  rows across the groups of the call
``None`` (rejected)               an episode with ``rl.status=filtered``
``messages`` / ``conversation``   a custom workflow's chat messages, replayed instead of decoding
``interactions``                  AReaL's string-only trajectories (``concat_string_interactions``:
                                  ``request`` messages, ``response`` text, ``reward``)
================================  =====================================================================

Not recorded: ``logprobs`` (per-token numbers, not text), ``multi_modal_input`` (images),
``begin_of_trajectory``. Any other key is not understood: it is reported once with
``warn_unknown`` and left out.

Policy version and staleness (the one definition in ``conventions``): AReaL stamps each generated
token with the inference engine's version (``RemoteInfEngine.get_version()``), and
``PPOTrainer.train`` calls ``set_version(global_step + 1)`` on the actor and the rollout engine
after each step's update — so during step ``global_step`` the actor that trains on the batch has
received ``global_step`` updates, the version an on-policy token carries. ``trained_version``
therefore defaults to ``step`` for training batches; evaluation samples are not trained on, so no
staleness is recorded for them unless ``trained_version`` is given. A sample generated across a
weight update (AReaL's interruptible generation) has tokens of several versions: staleness is
measured from the newest; ``trained_version − rl.policy.version.min`` is the oldest token's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core.guard import guarded
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
    set_policy,
    split_name,
    to_list,
    warn_unknown,
)
from otel_rollouts.adapters._messages import record_assistant
from otel_rollouts.adapters._text import assistant_message
from otel_rollouts.decode.batch import record_token_batch
from otel_rollouts.record.episode import episode as new_episode

__all__ = ["record_trajectories"]

FRAMEWORK = "areal"
_TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "versions")
_PER_SAMPLE = ("attention_mask", "loss_mask", "versions", "rewards", "logprobs")
_MESSAGE_KEYS = ("messages", "conversation")
# keys AReaL's stock workflows write that are deliberately not recorded
_NOT_RECORDED = frozenset({"logprobs", "multi_modal_input", "begin_of_trajectory"})
_KNOWN = frozenset({*_TOKEN_KEYS, "rewards", *_MESSAGE_KEYS, "interactions", *_NOT_RECORDED})


class _Attributes(dict):
    """Per-sample root attributes for ``record_token_batch``, filled through the episode API."""

    def set_attribute(self, key: str, value: Any) -> None:
        self[key] = value


@guarded
def record_trajectories(
    trajectories: Any,
    *,
    step: int,
    tokenizer: Any,
    split: str = "train",
    model: str | None = None,
    trained_version: int | None = None,
) -> int:
    """Record every sample of every trajectory group as one episode; returns how many.

    * ``step``: AReaL's ``global_step`` (``rl.step``; the tail sampler caps per step and split).
    * ``split``: ``train`` / ``eval`` (AReaL's ``rollout`` / ``eval-rollout`` are understood).
    * ``tokenizer``: decodes token ids, only for the episodes the sampler keeps.
    * ``trained_version``: updates the weights that train on these samples have received
      (``actor.get_version()``); defaults to ``step`` for training, none for evaluation.
    """
    split = split_name(split)
    if trained_version is None and split == "train":
        trained_version = step
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
                          tokenizer=tokenizer, model=model, trained_version=trained_version)
        recorded += n or 0
        sample_offset += n or 0
    return recorded


@guarded
def _filtered(index: int, *, step: int, split: str) -> None:
    """A rejected trajectory (``None`` from ``wait()``): nothing but its place is known."""
    with new_episode(step=step, split=split, group_id=str(index),
                     episode_id=f"{split}-{step}-{index}-rejected", framework=FRAMEWORK,
                     metadata={"trajectory_index": index}) as ep:
        ep.prompt("")
        ep.finish(reason="rejected", status=c.STATUS_FILTERED)
    count(COUNT_FILTERED, step=step, split=split)


@guarded
def _unknown(trajectory: Any, index: int, *, step: int, split: str) -> int:
    """A trajectory with neither token ids, messages nor interactions: an error episode."""
    detail = f"{type(trajectory).__name__} without input_ids, messages or interactions"
    warn_unknown(FRAMEWORK, "trajectory", detail)
    with new_episode(step=step, split=split, group_id=str(index),
                     episode_id=f"{split}-{step}-{index}-unknown", framework=FRAMEWORK,
                     metadata={"trajectory_index": index}) as ep:
        ep.prompt("")
        ep.finish(reason=f"unknown trajectory: {detail}", status=c.STATUS_ERROR)
    return 1


def _local(value: Any) -> Any:
    """RTensor-like objects (no ``.detach()``) are localized once; the rest is passed through."""
    to_local = getattr(value, "to_local", None)
    if callable(to_local) and not hasattr(value, "detach"):
        return to_local()
    return value


def _host(value: Any) -> Any:
    """A token-level tensor as a numpy array: localized, moved off the device and converted once
    (the decoder and the version/turn computations below then share it)."""
    value = _local(value)
    detach = getattr(value, "detach", None)
    if not callable(detach) or not hasattr(value, "numpy"):
        return value
    t = detach()
    if getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
        t = t.cpu()
    if not t.is_floating_point():
        return t.numpy()
    return t.float().numpy() if str(t.dtype) in ("torch.bfloat16", "torch.float16") else t.numpy()


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


def _keys(trajectory: Any) -> list[str]:
    if isinstance(trajectory, Mapping):
        return [str(k) for k in trajectory]
    return [k for k in vars(trajectory) if not k.startswith("_")] if hasattr(trajectory, "__dict__") else []


@guarded
def _record_group(trajectory: Any, index: int, offset: int, *, step: int, split: str,
                  tokenizer: Any, model: str | None, trained_version: int | None) -> int | None:
    for key in _keys(trajectory):
        if key not in _KNOWN:
            warn_unknown(FRAMEWORK, f"trajectory[{key!r}]", "a key AReaL's stock workflows do not write; not recorded")
    input_ids = field(trajectory, "input_ids")
    messages = next((field(trajectory, k) for k in _MESSAGE_KEYS if field(trajectory, k) is not None), None)
    interactions = field(trajectory, "interactions")
    if input_ids is None and messages is None:
        if isinstance(interactions, list):
            return _record_interactions(interactions, index, offset, step=step, split=split,
                                        tokenizer=tokenizer, model=model, trained_version=trained_version)
        return _unknown(trajectory, index, step=step, split=split)
    values = {name: _local(field(trajectory, name)) for name in _PER_SAMPLE}
    input_ids = _host(input_ids)
    for name in ("attention_mask", "loss_mask", "versions"):
        values[name] = _host(values[name])
    if getattr(input_ids, "ndim", None) == 1:  # one sample without its batch dimension
        warn_unknown(FRAMEWORK, "input_ids", "1-D; AReaL trajectories are [group_size, seqlen]: read as one sample")
        input_ids = input_ids.reshape(1, -1)
        for name in ("attention_mask", "loss_mask", "versions"):
            if getattr(values[name], "ndim", None) == 1:
                values[name] = values[name].reshape(1, -1)
    size = _rows(input_ids)
    if size is None:
        size = len(messages) if isinstance(messages, list) else 0
    # explicit alignment: a column with another number of rows covers only its prefix
    ragged = {name: rows for name, v in values.items() if (rows := _rows(v)) is not None and rows != size}
    metadata: list[dict[str, Any]] = []
    missing: list[list[str]] = []
    for j in range(size):
        metadata.append({"trajectory_index": index, "sample_index_in_group": j})
        missing.append([f"{name}[{rows}!={size}]" for name, rows in ragged.items() if j >= rows])
    episode_ids = [f"{split}-{step}-{index}-{j}" for j in range(size)]
    if messages is not None and _has_structured(messages, size):
        _record_messages(messages, values, index, offset, episode_ids, metadata, missing,
                         step=step, split=split, model=model, trained_version=trained_version)
        return size
    if input_ids is None:
        return 0
    versions = _version_ranges(values["versions"], values["loss_mask"], values["attention_mask"], size)
    turns = _turn_counts(values["loss_mask"], values["attention_mask"], size)
    attributes = []
    for j in range(size):
        attrs = _Attributes()
        set_policy(attrs, versions[j][1], trained_version)
        if turns[j] is not None:
            attrs[c.RL_TURN_COUNT] = turns[j]
        if missing[j]:
            attrs[c.RL_ALIGNMENT] = "partial"
            attrs[c.RL_ALIGNMENT_MISSING] = missing[j]
        attributes.append(attrs)
    count(COUNT_PARTIAL, sum(1 for m in missing if m), step=step, split=split)
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
        attributes=attributes,
    )
    return size


def _generated(mask: Any, attention: Any, shape: tuple[int, ...]) -> Any:
    """Boolean [B, L] array of generated, attended tokens, or None when the shapes disagree."""
    import numpy as np

    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or tuple(mask.shape) != shape:
        return None
    gen = mask != 0
    if isinstance(attention, np.ndarray) and tuple(attention.shape) == shape:
        gen &= attention != 0
    return gen


def _version_ranges(versions: Any, mask: Any, attention: Any, size: int) -> list[tuple[int | None, int | None]]:
    """(min, max) version over each sample's generated tokens, vectorized over the group."""
    import numpy as np

    out: list[tuple[int | None, int | None]] = [(None, None)] * size
    if versions is None or mask is None:
        return out
    if isinstance(versions, np.ndarray) and versions.ndim == 2 and versions.shape[0] == size:
        gen = _generated(mask, attention, tuple(versions.shape))
        if gen is not None:
            v = versions.astype(np.int64, copy=False)
            gen &= v >= 0
            hi = np.where(gen, v, -1).max(axis=1).tolist() if v.shape[1] else [-1] * size
            lo = np.where(gen, v, np.iinfo(np.int64).max).min(axis=1).tolist() if v.shape[1] else [-1] * size
            return [(lo[i], hi[i]) if hi[i] >= 0 else (None, None) for i in range(size)]
    rows, masks = to_list(versions) or [], to_list(mask) or []
    for i in range(min(size, len(rows), len(masks))):
        row, m = rows[i], masks[i]
        if isinstance(row, list) and isinstance(m, list):
            out[i] = generated_versions(row, m)
    return out


def _turn_counts(mask: Any, attention: Any, size: int) -> list[int | None]:
    """Runs of generated tokens per sample (one per generation call), vectorized."""
    import numpy as np

    if isinstance(mask, np.ndarray) and mask.ndim == 2 and mask.shape[0] == size:
        gen = _generated(mask, attention, tuple(mask.shape))
        if gen is not None and gen.shape[1]:
            starts = gen[:, 0].astype(np.int64) + (gen[:, 1:] & ~gen[:, :-1]).sum(axis=1)
            return starts.tolist()
    rows = to_list(mask) or []
    out: list[int | None] = [None] * size
    for i in range(min(size, len(rows))):
        row = rows[i] if isinstance(rows[i], list) else []
        out[i] = sum(1 for j, m in enumerate(row) if m and (j == 0 or not row[j - 1]))
    return out


def _has_structured(messages: Any, size: int) -> bool:
    return (isinstance(messages, list) and len(messages) == size and size > 0
            and all(isinstance(m, list) for m in messages))


def _record_messages(messages: list[Any], values: dict[str, Any], index: int, offset: int,
                     episode_ids: list[str], metadata: list[dict[str, Any]], missing: list[list[str]],
                     *, step: int, split: str, model: str | None, trained_version: int | None) -> None:
    """A workflow that stored chat messages per sample: replay them, no decoding needed."""
    # one host transfer per tensor for the whole group
    reward_list = to_list(values.get("rewards")) or []
    ranges = _version_ranges(values.get("versions"), values.get("loss_mask"), values.get("attention_mask"),
                             len(messages))
    for j, conversation in enumerate(messages):
        lo, hi = ranges[j]
        with new_episode(step=step, split=split, group_id=str(index), sample_index=offset + j,
                         episode_id=episode_ids[j], framework=FRAMEWORK, metadata=metadata[j]) as ep:
            set_policy(ep, hi, trained_version)
            if lo is not None and lo != hi:
                ep.set_attribute(c.RL_POLICY_VERSION_MIN, lo)
                ep.set_attribute(c.RL_POLICY_VERSION_MAX, hi)
            mark_partial(ep, missing[j])
            turns = replay_messages(ep, conversation, model=model)
            ep.set_attribute(c.RL_TURN_COUNT, turns)
            if j < len(reward_list):
                total, _, problem = reward_total(reward_list[j], f"rewards[{j}]")
                mark_invalid(ep, problem)
                if total is not None:
                    ep.reward(total)


def _record_interactions(interactions: list[Any], index: int, offset: int, *, step: int, split: str,
                         tokenizer: Any, model: str | None, trained_version: int | None) -> int:
    """AReaL's string-only trajectory (external API mode): ``{"interactions": [{"request":
    messages, "response": text, "reward": float}]}``, one episode per interaction."""
    recorded = 0
    for j, item in enumerate(interactions):
        if not isinstance(item, Mapping):
            warn_unknown(FRAMEWORK, "interactions[]", f"{type(item).__name__}, not a dict; not recorded")
            continue
        request = item.get("request")
        if isinstance(request, str):
            request = [{"role": "user", "content": request}]
        elif not isinstance(request, list):
            warn_unknown(FRAMEWORK, "interactions[].request", f"{type(request).__name__}; recorded as text")
            request = [{"role": "user", "content": "" if request is None else str(request)}]
        message, errors = assistant_message(item.get("response"), tokenizer)
        with new_episode(step=step, split=split, group_id=str(index), sample_index=offset + recorded,
                         episode_id=f"{split}-{step}-{index}-{j}", framework=FRAMEWORK,
                         metadata={"trajectory_index": index, "sample_index_in_group": j}) as ep:
            # the request is the whole input of this one call (earlier turns included): the prompt
            ep.prompt([m if isinstance(m, Mapping) else {"role": "user", "content": str(m)} for m in request])
            with ep.turn() as turn:
                record_assistant(turn, message, model=model)
            if errors:
                ep.set_attribute(c.RL_TOOL_PARSE_ERROR, errors)
            ep.set_attribute(c.RL_TURN_COUNT, 1)
            total, _, problem = reward_total(item.get("reward"), f"interactions[{j}].reward")
            mark_invalid(ep, problem)
            if total is not None:
                ep.reward(total)
        recorded += 1
    return recorded
