"""AReaL (areal-project/AReaL) trajectories as episode traces.

The plug-in: AReaL takes its rollout logic as a ``RolloutWorkflow`` (an instance, a class or an
import path, with ``workflow_kwargs``) wherever it rolls out — ``PPOTrainer.train(workflow=...,
eval_workflow=...)``, ``prepare_batch``, ``submit`` — and its ``WorkflowExecutor`` awaits
``workflow.arun_episode(engine, data)`` for every trajectory. Wrapping the workflow is the one
line; nothing in AReaL is edited::

    from otel_rollouts.adapters import areal
    trainer.train(workflow=areal.traced(workflow), eval_workflow=areal.traced(eval_workflow))

or, by path (single-controller mode sends workflows to rollout workers as path + kwargs)::

    workflow="otel_rollouts.adapters.areal.TracedWorkflow",
    workflow_kwargs={"workflow": "areal.workflow.rlvr.RLVRWorkflow", "workflow_kwargs": {...}}

Each finished trajectory is recorded as it returns (see ``_Recorder`` for step, staleness and
step closing; the split and the group come from AReaL's ``workflow_context``: ``is_eval`` and the
executor's task id, shared by the ``group_size`` samples ``GroupedRolloutWorkflow`` runs).

The explicit call, for a loop that has the batch at hand (its ``global_step`` is exact also in
asynchronous runs, where the wrapper records no staleness) — after ``actor.prepare_batch(...)``::

    areal.record_trajectories(rollout_batch, step=global_step, tokenizer=tokenizer)

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
``rewards[i]``                    ``rl.reward.score`` — the only reward term AReaL carries (in
                                  ``MultiTurnWorkflow`` already discounted by ``turn_discount``)
``versions`` (per token, −1 on    ``rl.policy.version`` = newest version of the generated tokens
non-generated tokens)             (``loss_mask == 1``; −1 placeholders and padding ignored);
                                  ``rl.policy.version_min/max`` when a sample spans several versions
trainer version                   ``rl.staleness`` = ``trained_version − rl.policy.version``
                                  (``trained_version`` defaults to ``step`` for training, see below)
number of mask-1 runs             ``rl.turn.count`` (AReaL's ``num_turns``: one per generation)
finish reason                     ``stop`` when the last generated token is the tokenizer's EOS
group / row                       ``rl.group.id`` = trajectory index; ``rl.metadata.trajectory_index``,
                                  ``rl.metadata.sample_index_in_group``; ``rl.sample.index`` counts
                                  rows across the groups of the call
``None`` (rejected)               an episode with ``rl.status=filtered``
wrapper's clock around            ``rl.duration.seconds`` (``traced`` only): the sample's wall time
``arun_episode``                  (AReaL's stock workflows return one sample per call; the
                                  explicit ``record_trajectories`` has no time: none recorded)
``messages`` / ``conversation``   a custom workflow's chat messages, replayed instead of decoding
``interactions``                  AReaL's string-only trajectories (``concat_string_interactions``:
                                  ``request`` messages, ``response`` text, ``reward``)
``logprobs`` (per token, the      the engine's (rollout) logprobs of the generated tokens, and
inference engine's) and           ``prox_logp`` the trainer's: ``rl.mismatch.*`` on each generation
``prox_logp`` (the actor's        and the root (train–inference mismatch). ``prox_logp`` is AReaL's
``compute_logp``, set by          next-token layout (column t scores token t + 1, as
``PPOTrainer`` when               ``compute_advantages`` rolls the rest to): shifted back onto the
``should_compute_prox_logp()``)   tokens here. Without ``prox_logp`` (the workflow wrapper, or a
                                  batch recorded before ``compute_logp``): no statistic
================================  =====================================================================

To get the mismatch, call ``record_trajectories`` after ``actor.compute_logp`` has stored
``traj["prox_logp"]`` (``recompute_logprob`` / decoupled PPO) and before
``compute_advantages`` (whose output is rolled by one token). With decoupled PPO and
``max_head_offpolicyness`` > 0 the proximal policy is newer than the behaviour policy: Δ then
includes the staleness as well as the numerical mismatch.

Not recorded: ``multi_modal_input`` (images), ``begin_of_trajectory``. Any other key is not understood: it is reported once with
``warn_unknown`` and left out.

Policy version and staleness (the one definition in ``conventions``): AReaL stamps each generated
token with the inference engine's version (``RemoteInfEngine.get_version()``), and
``PPOTrainer.train`` calls ``set_version(global_step + 1)`` on the actor and the rollout engine
after each step's update — so during step ``global_step`` the actor that trains on the batch has
received ``global_step`` updates, the version an on-policy token carries. ``trained_version``
therefore defaults to ``step`` for training batches; evaluation samples are not trained on, so no
staleness is recorded for them unless ``trained_version`` is given. A sample generated across a
weight update (AReaL's interruptible generation) has tokens of several versions: staleness is
measured from the newest; ``trained_version − rl.policy.version_min`` is the oldest token's.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts import episode as new_episode
from otel_rollouts import record_token_batch
from otel_rollouts.adapters._messages import record_assistant
from otel_rollouts.adapters._text import assistant_message
from otel_rollouts.adapters.kit import (
    COUNT_FILTERED,
    COUNT_PARTIAL,
    check_release,
    count,
    current_instance,
    describe_framework,
    end_step,
    exception_text,
    field,
    generated_versions,
    guarded,
    mark_invalid,
    mark_partial,
    replay_messages,
    report,
    reward_total,
    set_policy,
    set_times,
    split_name,
    to_list,
    warn_unknown,
)

if TYPE_CHECKING:
    import numpy as np

__all__ = ["record_trajectories", "traced"]

FRAMEWORK = "areal"
TESTED = ("1.0.4",)  # the only AReaL release on the package registry
_TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "versions")
_LOGPROB_KEYS = ("logprobs", "prox_logp")  # the engine's (per token), the trainer's (next token)
_PER_SAMPLE = ("attention_mask", "loss_mask", "versions", "rewards", *_LOGPROB_KEYS)
_MESSAGE_KEYS = ("messages", "conversation")
# keys AReaL's stock workflows write that are deliberately not recorded
_NOT_RECORDED = frozenset({"multi_modal_input", "begin_of_trajectory"})
_KNOWN = frozenset({*_TOKEN_KEYS, "rewards", *_LOGPROB_KEYS, *_MESSAGE_KEYS, "interactions", *_NOT_RECORDED})


class _Attributes(dict[str, object]):
    """Per-sample root attributes for ``record_token_batch``, filled through the episode API."""

    def set_attribute(self, key: str, value: object) -> None:
        self[key] = value


@guarded
def record_trajectories(
    trajectories: Iterable[object] | None,
    *,
    step: int,
    tokenizer: object,
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
    describe_framework(FRAMEWORK, "areal")
    check_release(FRAMEWORK, "areal", TESTED)
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
def _filtered(index: int, *, step: int, split: str, label: tuple[str, str, dict[str, object]] | None = None,
              reason: str = "rejected") -> None:
    """A rejected trajectory (``None`` from ``wait()`` or from a workflow): nothing but its place
    is known."""
    group, prefix, extra = label or (str(index), f"{split}-{step}-{index}", {"trajectory_index": index})
    with new_episode(step=step, split=split, group_id=group, episode_id=f"{prefix}-rejected",
                     framework=FRAMEWORK, metadata=extra) as ep:
        ep.prompt("")
        ep.finish(reason=reason, status=c.STATUS_FILTERED)
    count(COUNT_FILTERED, step=step, split=split)


@guarded
def _unknown(trajectory: object, index: int, *, step: int, split: str,
             label: tuple[str, str, dict[str, object]]) -> int:
    """A trajectory with neither token ids, messages nor interactions: an error episode."""
    group, prefix, extra = label
    detail = f"{type(trajectory).__name__} without input_ids, messages or interactions"
    warn_unknown(FRAMEWORK, "trajectory", detail)
    with new_episode(step=step, split=split, group_id=group, episode_id=f"{prefix}-unknown",
                     framework=FRAMEWORK, metadata=extra) as ep:
        ep.prompt("")
        ep.finish(reason=f"unknown trajectory: {detail}", status=c.STATUS_ERROR)
    return 1


def _local(value: object) -> Any:
    """RTensor-like objects (no ``.detach()``) are localized once; the rest is passed through."""
    to_local = getattr(value, "to_local", None)
    if callable(to_local) and not hasattr(value, "detach"):
        return to_local()
    return value


def _host(value: object) -> Any:
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


def _rows(value: object) -> int | None:
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if not isinstance(value, Sized):  # no __len__: len() would raise TypeError
        return None
    try:
        return len(value)
    except TypeError:
        return None


def _keys(trajectory: object) -> list[str]:
    if isinstance(trajectory, Mapping):
        return [str(k) for k in trajectory]
    return [k for k in vars(trajectory) if not k.startswith("_")] if hasattr(trajectory, "__dict__") else []


@guarded
def _record_group(trajectory: object, index: int, offset: int, *, step: int, split: str,
                  tokenizer: object, model: str | None, trained_version: int | None,
                  label: tuple[str, str, dict[str, object]] | None = None,
                  duration: float | None = None) -> int | None:
    """One group's rows as episodes. ``label``: (group id, episode-id prefix, metadata) when the
    group is not the ``index``-th of a batch (the workflow wrapper: AReaL's task id).
    ``duration``: the seconds the workflow's ``arun_episode`` took (the wrapper's clock), the
    episode's wall time when the trajectory is one sample (AReaL's stock workflows: groups are
    ``GroupedRolloutWorkflow``'s concurrent calls); a multi-row trajectory's rows get none."""
    group, prefix, extra = label or (str(index), f"{split}-{step}-{index}", {"trajectory_index": index})
    for key in _keys(trajectory):
        if key not in _KNOWN:
            warn_unknown(FRAMEWORK, f"trajectory[{key!r}]", "a key AReaL's stock workflows do not write; not recorded")
    input_ids = field(trajectory, "input_ids")
    messages = next((field(trajectory, k) for k in _MESSAGE_KEYS if field(trajectory, k) is not None), None)
    interactions = field(trajectory, "interactions")
    if input_ids is None and messages is None:
        if isinstance(interactions, list):
            return _record_interactions(interactions, index, offset, step=step, split=split,
                                        tokenizer=tokenizer, model=model, trained_version=trained_version,
                                        label=(group, prefix, extra))
        return _unknown(trajectory, index, step=step, split=split, label=(group, prefix, extra))
    values = {name: _local(field(trajectory, name)) for name in _PER_SAMPLE}
    input_ids = _host(input_ids)
    for name in ("attention_mask", "loss_mask", "versions", *_LOGPROB_KEYS):
        values[name] = _host(values[name])
    if getattr(input_ids, "ndim", None) == 1:  # one sample without its batch dimension
        warn_unknown(FRAMEWORK, "input_ids", "1-D; AReaL trajectories are [group_size, seqlen]: read as one sample")
        input_ids = input_ids.reshape(1, -1)
        for name in ("attention_mask", "loss_mask", "versions", *_LOGPROB_KEYS):
            if getattr(values[name], "ndim", None) == 1:
                values[name] = values[name].reshape(1, -1)
    size = _rows(input_ids)
    if size is None:
        size = len(messages) if isinstance(messages, list) else 0
    # explicit alignment: a column with another number of rows covers only its prefix
    ragged = {name: rows for name, v in values.items() if (rows := _rows(v)) is not None and rows != size}
    metadata: list[dict[str, object]] = []
    missing: list[list[str]] = []
    for j in range(size):
        metadata.append({**extra, "sample_index_in_group": j})
        missing.append([f"{name}[{rows}!={size}]" for name, rows in ragged.items() if j >= rows])
    episode_ids = [f"{prefix}-{j}" for j in range(size)]
    duration = duration if size == 1 else None
    if messages is not None and _has_structured(messages, size):
        _record_messages(messages, values, group, offset, episode_ids, metadata, missing,
                         step=step, split=split, model=model, trained_version=trained_version,
                         duration=duration)
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
        set_times(attrs, duration)
        if missing[j]:
            attrs[c.RL_ALIGNMENT_KIND] = "partial"
            attrs[c.RL_ALIGNMENT_MISSING] = missing[j]
        attributes.append(attrs)
    count(COUNT_PARTIAL, sum(1 for m in missing if m), step=step, split=split)
    # a logprob column of another number of rows cannot be paired with the samples (marked
    # partial above): left out, so no sample is compared with another's logprobs
    engine = None if "logprobs" in ragged else values["logprobs"]
    trainer = None if "prox_logp" in ragged else _token_aligned(values["prox_logp"])
    record_token_batch(
        input_ids,
        tokenizer=tokenizer,
        step=step,
        split=split,
        loss_mask=values["loss_mask"],
        attention_mask=values["attention_mask"],
        rewards=values["rewards"],
        versions=values["versions"],
        group_ids=[group] * size,
        episode_ids=episode_ids,
        sample_indices=list(range(offset, offset + size)),
        metadata=metadata,
        framework=FRAMEWORK,
        model=model,
        attributes=attributes,
        logprobs=engine,
        trainer_logprobs=trainer,
    )
    return size


def _token_aligned(next_token: object) -> object:
    """AReaL's ``prox_logp`` (``compute_logp``: column t is the logprob of token t + 1, the
    last column scores nothing) moved onto the tokens it scores, like ``input_ids`` and the
    engine's ``logprobs``: column 0 (a prompt token, never compared) is NaN. Numpy arrays are
    shifted whole; lists row by row; anything else is left out (None)."""
    import numpy as np

    if next_token is None:
        return None
    if isinstance(next_token, np.ndarray):
        if next_token.ndim != 2:
            warn_unknown(FRAMEWORK, "prox_logp", f"{next_token.ndim}-D, expected [group_size, seqlen]: not compared")
            return None
        out = np.full(next_token.shape, np.nan, dtype=np.float32)  # what the statistics read
        out[:, 1:] = next_token[:, :-1]
        return out
    rows = to_list(next_token)
    if rows is None or not all(isinstance(r, list) for r in rows):
        warn_unknown(FRAMEWORK, "prox_logp", f"{type(next_token).__name__}: not compared")
        return None
    return [[math.nan, *r[:-1]] if r else [] for r in rows]


def _generated(mask: object, attention: object, shape: tuple[int, ...]) -> np.ndarray | None:
    """Boolean [B, L] array of generated, attended tokens, or None when the shapes disagree."""
    import numpy as np

    if not isinstance(mask, np.ndarray) or mask.ndim != 2 or tuple(mask.shape) != shape:
        return None
    gen = mask != 0
    if isinstance(attention, np.ndarray) and tuple(attention.shape) == shape:
        gen &= attention != 0
    return gen


def _version_ranges(versions: object, mask: object, attention: object, size: int) -> list[tuple[int | None, int | None]]:
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


def _turn_counts(mask: object, attention: object, size: int) -> list[int | None]:
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


def _has_structured(messages: object, size: int) -> bool:
    return (isinstance(messages, list) and len(messages) == size and size > 0
            and all(isinstance(m, list) for m in messages))


def _record_messages(messages: Sequence[Sequence[object]], values: Mapping[str, object], group: str,
                     offset: int, episode_ids: list[str], metadata: list[dict[str, object]], missing: list[list[str]],
                     *, step: int, split: str, model: str | None, trained_version: int | None,
                     duration: float | None = None) -> None:
    """A workflow that stored chat messages per sample: replay them, no decoding needed."""
    # one host transfer per tensor for the whole group
    reward_list = to_list(values.get("rewards")) or []
    ranges = _version_ranges(values.get("versions"), values.get("loss_mask"), values.get("attention_mask"),
                             len(messages))
    for j, conversation in enumerate(messages):
        lo, hi = ranges[j]
        with new_episode(step=step, split=split, group_id=group, sample_index=offset + j,
                         episode_id=episode_ids[j], framework=FRAMEWORK, metadata=metadata[j]) as ep:
            set_policy(ep, hi, trained_version)
            set_times(ep, duration)
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


def _record_interactions(interactions: list[object], index: int, offset: int, *, step: int, split: str,
                         tokenizer: object, model: str | None, trained_version: int | None,
                         label: tuple[str, str, dict[str, object]]) -> int:
    """AReaL's string-only trajectory (external API mode): ``{"interactions": [{"request":
    messages, "response": text, "reward": float}]}``, one episode per interaction."""
    group, prefix, extra = label
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
        with new_episode(step=step, split=split, group_id=group, sample_index=offset + recorded,
                         episode_id=f"{prefix}-{j}", framework=FRAMEWORK,
                         metadata={**extra, "sample_index_in_group": j}) as ep:
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


# --- the plug-in: a workflow wrapper -------------------------------------------------------------
def traced(workflow: object, workflow_kwargs: Mapping[str, object] | None = None, *, tokenizer: object = None,
           model: str | None = None, end_steps: bool = True) -> Any:
    """``workflow`` wrapped so that every trajectory it finishes is recorded, with no edit to
    AReaL: pass the result wherever AReaL takes a workflow (``trainer.train(workflow=...,
    eval_workflow=...)``, ``prepare_batch``, ``rollout_batch``, ``submit``)::

        trainer.train(workflow=areal.traced(RLVRWorkflow(reward_fn, gconfig, tokenizer)), ...)

    ``workflow`` is what AReaL accepts as a ``RolloutWorkflow``: an instance, a class or an import
    path (``workflow_kwargs`` then builds it, as AReaL's ``_resolve_workflow`` does). The result
    is a ``RolloutWorkflow`` (AReaL is imported here, at the call, never at module import); the
    same class is importable as ``otel_rollouts.adapters.areal.TracedWorkflow`` for AReaL's
    by-path configuration (single-controller mode sends workflows by path and kwargs)::

        workflow="otel_rollouts.adapters.areal.TracedWorkflow",
        workflow_kwargs={"workflow": "areal.workflow.rlvr.RLVRWorkflow", "workflow_kwargs": {...}}

    * ``tokenizer``: decodes token ids (default: the wrapped workflow's ``tokenizer``);
    * ``model``: model name for the ``chat`` spans;
    * ``end_steps``: close a step for the tail sampler when the engine's version moves past it.

    Without AReaL importable, the workflow is returned unwrapped (warned once).
    """
    check_release(FRAMEWORK, "areal", TESTED)
    cls = _traced_class()
    if cls is None:
        return workflow
    return cls(workflow, workflow_kwargs, tokenizer=tokenizer, model=model, end_steps=end_steps)


def __getattr__(name: str) -> Any:
    """``TracedWorkflow`` is built on first use (PEP 562): it subclasses AReaL's
    ``RolloutWorkflow``, which is imported only then."""
    if name == "TracedWorkflow":
        cls = _traced_class()
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=1)
def _traced_class() -> type | None:
    """The wrapper class, built once per process (with AReaL's ``RolloutWorkflow`` as its base).
    Its ``recorder`` holds what the process's wrappers share (see ``_Recorder``)."""
    try:
        from areal.api import RolloutWorkflow  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except Exception as exc:  # noqa: BLE001 - no AReaL: nothing to wrap
        warn_unknown(FRAMEWORK, "areal.api.RolloutWorkflow", f"not importable ({exception_text(exc)}); "
                     "the workflow is used unwrapped, nothing is recorded")
        return None

    class TracedWorkflow(RolloutWorkflow):  # type: ignore[misc, valid-type]
        """An AReaL ``RolloutWorkflow`` that runs ``workflow`` and records what it returns
        (see ``otel_rollouts.adapters.areal.traced``). The trajectory is returned untouched;
        nothing the recording does reaches AReaL."""

        recorder = _Recorder()  # shared by every wrapper of the process

        def __init__(self, workflow: object, workflow_kwargs: Mapping[str, object] | None = None, *,
                     tokenizer: object = None, model: str | None = None, end_steps: bool = True) -> None:
            self.workflow = _resolve(workflow, workflow_kwargs)
            self.tokenizer = tokenizer if tokenizer is not None else getattr(self.workflow, "tokenizer", None)
            self.model = model
            self.end_steps = end_steps

        async def arun_episode(self, engine: object, data: object) -> object:
            started = time.monotonic()
            try:
                trajectory = await self.workflow.arun_episode(engine, data)
            except Exception as exc:
                _quietly(self.recorder.failed, engine, exc, end_steps=self.end_steps,
                         duration=time.monotonic() - started)
                raise
            _quietly(self.recorder.finished, engine, trajectory, tokenizer=self.tokenizer, model=self.model,
                     end_steps=self.end_steps, duration=time.monotonic() - started)
            return trajectory

    TracedWorkflow.__module__ = __name__  # the path AReaL's controllers derive from a class
    TracedWorkflow.__qualname__ = "TracedWorkflow"
    return TracedWorkflow


def _quietly(record: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Record, never raising into AReaL, not even in strict mode: AReaL's executor would turn
    the exception into a rejected rollout, and the training data would change."""
    try:
        record(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        report(f"areal adapter: {exception_text(exc)}", exc=exc, may_raise=False)


def _resolve(workflow: object, kwargs: Mapping[str, object] | None) -> Any:
    """An instance from AReaL's workflow forms: instance, class + kwargs, import path + kwargs."""
    if isinstance(workflow, str):
        import importlib

        module, _, name = workflow.rpartition(".")
        workflow = getattr(importlib.import_module(module), name)
    if isinstance(workflow, type):
        return workflow(**dict(kwargs or {}))
    return workflow


class _Recorder:
    """What the wrapper records, shared by every wrapper of the process (AReaL builds a new
    workflow instance per ``submit`` when it is given a class or a path).

    Step: the rollout engine's ``get_version()`` when the trajectory finished — the number of
    updates the inference weights have received, i.e. the ``global_step`` during which
    ``PPOTrainer`` consumes it (it calls ``set_version(global_step + 1)`` after each update).
    Exact for on-policy training (``max_head_offpolicyness=0``, AReaL's default: the staleness
    manager admits no rollout beyond the current step's batch), so there ``rl.staleness`` =
    that version − the tokens' version. With ``max_head_offpolicyness`` = k > 0 a trajectory
    finished at version v may be trained at any step in v…v+k: no staleness is recorded.
    """

    _MAX_TASKS = 65_536  # task ids whose sample count is remembered (a group's samples)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, set[int]] = {}  # split → steps recorded and not closed yet
        self.samples: OrderedDict[tuple[str, object], int] = OrderedDict()
        self.runtime: object = None  # the otel_rollouts instance these belong to

    def _current(self) -> None:
        """A new ``otr.configure()`` (another run) starts from nothing: the old run's open
        steps are not this one's. Called with the lock held."""
        rt = current_instance()
        if rt is not self.runtime:
            self.runtime = rt
            self.open.clear()
            self.samples.clear()

    @guarded
    def finished(self, engine: object, trajectory: object, *, tokenizer: object, model: str | None,
                 end_steps: bool, duration: float | None = None) -> None:
        split, task = _context()
        step, trained = self._step(engine, split, end_steps)
        k = self._next_sample(split, task)
        group = f"task-{task}"
        label = (group, f"{split}-{step}-{group}-{k}", {"task_id": task, "trajectory_index": k})
        if trajectory is None:
            _filtered(k, step=step, split=split, label=label, reason="returned_none")
            return
        trajectory = _tensor_dict(trajectory)
        _record_group(trajectory, k, 0, step=step, split=split, tokenizer=tokenizer, model=model,
                      trained_version=trained, label=label, duration=duration)

    @guarded
    def failed(self, engine: object, exc: BaseException, *, end_steps: bool, duration: float | None = None) -> None:
        """The workflow raised (AReaL logs it and rejects the rollout): an error episode."""
        split, task = _context()
        step, _ = self._step(engine, split, end_steps)
        k = self._next_sample(split, task)
        with new_episode(step=step, split=split, group_id=f"task-{task}",
                         episode_id=f"{split}-{step}-task-{task}-{k}-error", framework=FRAMEWORK,
                         metadata={"task_id": task, "trajectory_index": k}) as ep:
            set_times(ep, duration)
            ep.prompt("")
            ep.finish(reason=f"workflow raised: {exception_text(exc)}", status=c.STATUS_ERROR)

    def _next_sample(self, split: str, task: object) -> int:
        with self.lock:
            self._current()
            key = (split, task)
            k = self.samples.pop(key, 0)
            self.samples[key] = k + 1
            if len(self.samples) > self._MAX_TASKS:
                self.samples.popitem(last=False)
            return k

    def _step(self, engine: object, split: str, end_steps: bool) -> tuple[int, int | None]:
        """(step, trained version or None) from the engine; closes the split's older steps."""
        version = None
        get_version = getattr(engine, "get_version", None)
        if callable(get_version):
            try:
                version = int(get_version())
            except Exception:  # noqa: BLE001 - read below as unknown
                version = None
        if version is None:
            warn_unknown(FRAMEWORK, "engine.get_version()", "no weight version: recorded at step 0, no staleness")
            version = 0
        trained = None
        if split == "train":
            config = getattr(engine, "config", None)
            off = getattr(config, "max_head_offpolicyness", None)
            if off is None:
                warn_unknown(FRAMEWORK, "engine.config.max_head_offpolicyness",
                             "not found: whether the run is on-policy is unknown, no staleness recorded")
            elif off == 0:
                trained = version
        if end_steps:
            with self.lock:
                self._current()
                opened = self.open.setdefault(split, set())
                older = sorted(s for s in opened if s < version)
                opened.difference_update(older)
                opened.add(version)
            for s in older:  # the engine moved on: nothing more finishes at those versions
                end_step(s, split)
        return version, trained



def _context() -> tuple[str, object]:
    """(split, task id) from AReaL's workflow context (set by its executor for each task)."""
    import sys

    module = sys.modules.get("areal.infra.workflow_context")
    get = getattr(module, "get", None)
    ctx = get() if callable(get) else None
    if ctx is None:
        warn_unknown(FRAMEWORK, "workflow_context", "AReaL's workflow context is missing: read as train")
        return "train", None
    return ("eval" if getattr(ctx, "is_eval", False) else "train"), getattr(ctx, "task_id", None)


def _tensor_dict(trajectory: object) -> object:
    """A workflow's ``{id: InteractionWithTokenLogpReward}`` as AReaL's executor converts it
    (token tensors when every interaction has them, else its string-only form)."""
    if not isinstance(trajectory, Mapping) or not trajectory:
        return trajectory
    values = list(trajectory.values())
    if not all(hasattr(v, "to_tensor_dict") and hasattr(v, "has_tensor_data") for v in values):
        return trajectory
    if all(v.has_tensor_data for v in values):
        from areal.utils.data import concat_padded_tensors  # type: ignore[import-untyped, import-not-found, unused-ignore]

        return concat_padded_tensors([v.to_tensor_dict() for v in values])
    from areal.experimental.openai.types import concat_string_interactions  # type: ignore[import-untyped, import-not-found, unused-ignore]

    return concat_string_interactions(trajectory)
