"""verl (verl-project/verl) DataProto batches as episode traces.

Call it in ``RayPPOTrainer.fit`` once the batch has rewards (and advantages, when computed), and
on validation batches::

    from otel_rollouts.adapters import verl as verl_adapter
    verl_adapter.record_batch(batch, step=self.global_steps, tokenizer=self.tokenizer)

``batch`` is verl's ``DataProto``: ``batch`` (a TensorDict: ``prompts`` left-padded,
``responses`` right-padded, ``input_ids``, ``attention_mask``, ``response_mask`` with 0 on tool
tokens in multi-turn rollouts, ``token_level_scores``/``token_level_rewards``, ``advantages``),
``non_tensor_batch`` (numpy object arrays: ``uid``, ``index``, ``data_source``, ``extra_info``,
reward extra info such as ``acc``) and ``meta_info`` (``global_steps``, ``validate``). A dict with
those three keys works as well; verl is never imported.

Each episode carries verl's own rollout-trace tags — ``step``, ``sample_index`` (the dataset
index), ``rollout_n`` (repetition within the group) and ``validate`` — so a trace found here can
be matched with verl's weave/mlflow traces. Tensors leave the device once per batch; text is
decoded only for the episodes the tail sampler keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from otel_rollouts._guard import guarded
from otel_rollouts.adapters._common import (
    COUNT_PARTIAL,
    count,
    field,
    split_name,
    to_list,
)
from otel_rollouts.decode import record_token_batch

__all__ = ["record_batch"]

FRAMEWORK = "verl"
_REWARD_TENSORS = ("token_level_scores", "token_level_rewards", "rm_scores")
_KNOWN_NON_TENSOR = {"uid", "index", "data_source", "extra_info", "reward_model", "raw_prompt",
                     "raw_prompt_ids", "tools_kwargs", "interaction_kwargs", "request_id",
                     "multi_modal_data", "multi_modal_inputs", "agent_name", "__num_turns__",
                     "param_version", "policy_version"}


@guarded
def record_batch(
    batch: Any,
    *,
    step: int,
    tokenizer: Any,
    split: str = "train",
    policy_version: int | Sequence[int] | None = None,
    rollout_n: int | None = None,
    reward_extra_keys: Sequence[str] | None = None,
    model: str | None = None,
) -> int:
    """Record every sample of a verl ``DataProto`` as one episode; returns how many.

    * ``step``: the trainer's ``global_steps`` (``rl.step``; the cap holds per step and split).
    * ``split``: ``train`` or ``eval``; ``meta_info["validate"]`` marks a validation batch eval.
    * ``policy_version``: the weights version that generated the batch (an int, or one per
      sample); else ``param_version``/``policy_version`` from ``non_tensor_batch``/``meta_info``.
    * ``rollout_n``: samples per prompt, used to form groups only when ``uid`` is missing.
    * ``reward_extra_keys``: ``non_tensor_batch`` columns that are reward components (default:
      every numeric column that is not one of verl's known bookkeeping columns).
    """
    tensors = field(batch, "batch")
    if tensors is None:
        tensors = batch
    non_tensor = field(batch, "non_tensor_batch", default={})
    meta = field(batch, "meta_info", default={})
    split = "eval" if field(meta, "validate") is True else split_name(split)

    prompts = _get(tensors, "prompts")
    responses = _get(tensors, "responses")
    input_ids = _get(tensors, "input_ids")
    attention = _get(tensors, "attention_mask")
    response_mask = _get(tensors, "response_mask")
    if responses is None or input_ids is None:
        return 0
    size = int(responses.shape[0])
    prompt_width = int(prompts.shape[1]) if prompts is not None else int(input_ids.shape[1]) - int(responses.shape[1])
    if response_mask is None:  # older verl: the response part of the attention mask
        response_mask = attention[:, prompt_width:] if attention is not None else (responses != 0)
    loss_mask = _cat_zeros(response_mask, prompt_width)
    reward_tensor = next((_get(tensors, k) for k in _REWARD_TENSORS if _get(tensors, k) is not None), None)
    rewards = reward_tensor.sum(-1) if reward_tensor is not None and len(reward_tensor.shape) == 2 else reward_tensor
    advantages = _get(tensors, "advantages")
    if advantages is not None and len(advantages.shape) == 2:
        weight = response_mask.to(advantages.dtype) if hasattr(response_mask, "to") else response_mask
        denom = weight.sum(-1)
        advantages = (advantages * weight).sum(-1) / (denom + (denom == 0))

    columns = {name: to_list(non_tensor[name]) for name in _names(non_tensor)}
    ragged = {name: len(v) for name, v in columns.items() if v is not None and len(v) != size}
    uid = columns.get("uid") if "uid" not in ragged else None
    index = columns.get("index")
    if index is None and columns.get("extra_info") is not None:
        index = [field(e, "index") if isinstance(e, Mapping) else None for e in columns["extra_info"]]
    groups = _groups(size, uid, rollout_n)
    versions = _token_versions(_versions(size, policy_version, columns, meta), loss_mask)

    metadata, episode_ids, seen = [], [], {}
    partial = 0
    for i in range(size):
        group = groups[i]
        rep = seen.get(group, 0) if group is not None else None
        if group is not None:
            seen[group] = rep + 1
        sample_index = index[i] if index is not None and i < len(index) else None
        entry: dict[str, Any] = {"sample_index": sample_index, "rollout_n": rep,
                                 "validate": split == "eval"}
        source = _at(columns.get("data_source"), i)
        if source is not None:
            entry["data_source"] = str(source)
        missing = [f"{name}[{n}!={size}]" for name, n in ragged.items() if i >= n or n > size]
        if missing:
            entry["alignment"] = "partial"
            entry["alignment_missing"] = missing
            partial += 1
        metadata.append({k: v for k, v in entry.items() if v is not None})
        episode_ids.append(f"{split}-{step}-{group}-{rep}" if group is not None else f"{split}-{step}-{i}")
    # record_token_batch takes no per-sample attributes: partial samples are marked in their
    # metadata (rl.metadata.alignment) and counted here
    count(COUNT_PARTIAL, partial, step=step, split=split)

    components = _components(columns, reward_extra_keys, size)
    sources = {m.get("data_source") for m in metadata}
    record_token_batch(
        input_ids,
        tokenizer=tokenizer,
        step=step,
        split=split,
        loss_mask=loss_mask,
        attention_mask=attention,
        rewards=rewards,
        advantages=advantages,
        group_ids=groups,
        versions=versions,
        episode_ids=episode_ids,
        metadata=metadata,
        reward_components=components or None,
        dataset_name=sources.pop() if len(sources) == 1 else None,
        dataset_indices=[_at(index, i) for i in range(size)] if index is not None else None,
        framework=FRAMEWORK,
        model=model,
    )
    return size


def _get(tensors: Any, key: str) -> Any:
    """A tensor of a TensorDict / dict by key (TensorDicts are not Mappings)."""
    if tensors is None:
        return None
    try:
        if key in tensors.keys():
            return tensors[key]
    except (AttributeError, TypeError, KeyError):
        pass
    return field(tensors, key)


def _names(non_tensor: Any) -> list[str]:
    try:
        return [str(k) for k in non_tensor.keys()]
    except AttributeError:
        return []


def _cat_zeros(response_mask: Any, prompt_width: int) -> Any:
    """``[zeros(B, P) | response_mask]`` on the mask's own device (no host copy)."""
    if type(response_mask).__module__.split(".", 1)[0] == "torch":
        import torch

        zeros = torch.zeros((response_mask.shape[0], prompt_width), dtype=response_mask.dtype,
                            device=response_mask.device)
        return torch.cat([zeros, response_mask], dim=1)
    import numpy as np

    mask = np.asarray(response_mask)
    return np.concatenate([np.zeros((mask.shape[0], prompt_width), dtype=mask.dtype), mask], axis=1)


def _at(values: list[Any] | None, i: int) -> Any:
    return values[i] if values is not None and i < len(values) else None


def _groups(size: int, uid: list[Any] | None, rollout_n: int | None) -> list[str | None]:
    if uid is not None and all(u is not None for u in uid):
        return [str(u) for u in uid]
    if rollout_n and rollout_n > 0 and size % rollout_n == 0:  # batch.repeat(n, interleave=True)
        return [str(i // rollout_n) for i in range(size)]
    return [None] * size


def _versions(size: int, explicit: Any, columns: dict[str, Any], meta: Any) -> list[Any] | None:
    """One policy version per sample (verl keeps no per-token versions)."""
    value = explicit
    if value is None:
        value = columns.get("param_version") or columns.get("policy_version")
    if value is None:
        value = field(meta, "param_version", "policy_version")
    if value is None:
        return None
    if isinstance(value, (int, float)) or getattr(value, "shape", None) == ():
        return [int(value)] * size
    values = to_list(value) or []
    return [values[i] if i < len(values) else None for i in range(size)]


def _token_versions(per_sample: list[Any] | None, loss_mask: Any) -> Any:
    """Per-sample versions spread over generated tokens (−1 elsewhere), on the mask's device:
    unambiguous for record_token_batch whatever the batch size."""
    if per_sample is None:
        return None
    values = [int(v) if v is not None else -1 for v in per_sample]
    if type(loss_mask).__module__.split(".", 1)[0] == "torch":
        import torch

        column = torch.tensor(values, dtype=torch.int64, device=loss_mask.device)[:, None]
        return torch.where(loss_mask != 0, column, torch.full_like(column, -1))
    import numpy as np

    mask = np.asarray(loss_mask)
    return np.where(mask != 0, np.asarray(values, dtype=np.int64)[:, None], -1)


def _components(columns: dict[str, Any], keys: Sequence[str] | None, size: int) -> dict[str, list[Any]]:
    """Reward extra info columns (``acc``, ``format``...) whose values are numbers."""
    out = {}
    for name, values in columns.items():
        if values is None or (keys is not None and name not in keys):
            continue
        if keys is None and (name in _KNOWN_NON_TENSOR or name.startswith("__")):
            continue
        if keys is None and not all(_numeric(v) for v in values):
            continue
        out[name] = (values + [None] * size)[:size]
    return out


def _numeric(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return True
    item = getattr(value, "item", None)
    return callable(item) and getattr(value, "shape", None) == ()
