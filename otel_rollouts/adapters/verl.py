"""verl (verl-project/verl) DataProto batches as episode traces.

Call it in ``RayPPOTrainer.fit``: mark the rollout order once the generated batch is assembled,
before ``_balance_batch`` reorders it, and record the batch once it has rewards and advantages
(validation batches in ``_validate`` need only ``record_batch``)::

    from otel_rollouts.adapters import verl as verl_adapter

    batch = batch.union(gen_batch_output)
    verl_adapter.mark_rollouts(batch, agent_loop_workers=self.config.actor_rollout_ref.rollout.agent.num_workers)
    self._balance_batch(batch, metrics=metrics)
    ...
    batch = compute_advantage(batch, ...)
    verl_adapter.record_batch(batch, step=self.global_steps, tokenizer=self.tokenizer)

Without a source edit: ``otel_rollouts.adapters.verl_loop`` (one config entry; no advantages).
With verl's reward-loop workers (the default without a colocated reward model) the batch at the
first line has no ``index`` column: ``mark_rollouts`` numbers by ``extra_info["index"]``.

``batch`` is verl's ``DataProto`` (``batch`` a TensorDict, ``non_tensor_batch`` numpy columns,
``meta_info``); a dict with those three keys works as well; verl is never imported.

What lands where (verl field → attribute):

* ``input_ids`` / ``attention_mask`` / ``response_mask`` (0 on tool tokens of verl's tool-agent
  loop) → the ``prompt`` span (the rendered prompt split into its messages), one ``turn`` with a
  ``chat`` span per generated run, ``execute_tool`` spans for Hermes ``<tool_call>`` blocks with
  the following tool tokens as their result (the template's ``<|im_start|>tool`` markup removed),
  other observations as feedback with their template role. Text is cleaned with the tokenizer's
  own template markers and special tokens.
* ``token_level_scores`` (else ``token_level_rewards``, ``rm_scores``) summed → ``rl.reward.score``;
  ``advantages`` averaged over generated tokens → ``rl.advantage``.
* reward terms → ``rl.reward.component.<key>``: the keys in ``reward_extra_keys=``, else verl's own list
  ``meta_info["reward_extra_keys"]`` (written by the agent loop / reward loop with ``rm_scores``,
  read back by ``verl.trainer.ppo.reward.extract_reward`` as ``reward_extra_infos_dict``), else
  (older reward managers) the numeric columns that are not verl bookkeeping, with a warning.
* ``uid`` → ``rl.group.id``; ``index`` (``extra_info["index"]``) → ``rl.dataset.index`` and
  ``rl.metadata.sample_index``; ``data_source`` → ``rl.dataset.name`` (one per batch) and
  ``rl.metadata.data_source``; verl's ``rollout_n`` (``get_trajectory_info``: the repetition of a
  dataset index in the rollout order) → ``rl.sample.index``, ``rl.metadata.rollout_n`` and the
  episode id ``{split}-{step}-{uid}-{rollout_n}``; ``meta_info["validate"]`` → ``rl.split=eval``
  and ``rl.metadata.validate``: the keys of verl's rollout traces (step, sample_index, rollout_n,
  validate). After ``_balance_batch`` the rollout order is known only from ``mark_rollouts``'s
  column; without it, a batch whose groups are interleaved gets no ``rollout_n`` (warned).
* ``max_global_steps`` (else ``global_steps``, ``param_version``, ``policy_version``; set by
  verl's LLM server client: the ``global_steps`` of the weights the rollout replica held, i.e.
  weight updates received, one per trainer step) → ``rl.policy.version``; with
  ``min_global_steps`` differing (a partial rollout resumed on newer weights) →
  ``rl.policy.version_min/max``. ``rl.staleness`` = trained version − ``max_global_steps``, the
  trained version being ``trained_version=`` or, for training batches, ``step - 1`` (verl's
  trainer at ``global_steps`` k trains the weights published as k − 1; verl's own
  ``trajectory_staleness``). Fully async trainers pass ``trained_version=self.current_param_version``.
  Validation samples get no staleness (nothing trains on them). Units are verl's weight
  versions: one per trainer step (a step's PPO mini-batches make several optimizer steps).
* train–inference mismatch: ``rollout_log_probs`` (the engine's logprob of each response token,
  ``[B, response_len]``, 0.0 on padding; present when the rollout computes them,
  ``actor_rollout_ref.rollout.calculate_log_probs``) → ``logprobs``, and ``old_log_probs`` (the
  actor's recomputation, ``RayPPOTrainer._compute_old_log_prob``; present once the trainer's
  ``batch.union(old_log_prob)`` ran) → ``trainer_logprobs`` of ``record_token_batch``: both
  response-only, the last ``response_len`` columns of ``input_ids``, counted where
  ``response_mask`` is 1 → ``rl.mismatch.*`` on the generation spans and the root. Passed as they
  are (no copy on the training thread). Absent columns are passed as nothing (no statistics). In
  verl's bypass mode (``rollout_correction.bypass_mode``) ``old_log_probs`` *is*
  ``rollout_log_probs`` (no recomputation): not passed as the trainer's, the Δ would be 0 by
  construction. ``verl_loop`` sees only ``rollout_log_probs`` (it records before the actor runs).
* ``__num_turns__`` → ``rl.turn.count`` (verl counts user, assistant and tool messages);
  ``num_cached_tokens``, ``spec_num_*``, ``agent_name`` → ``rl.metadata.<name>``.
* Time: verl's agent loop times each sample (``AgentLoopMetrics``: ``generate_sequences``,
  ``tool_calls``, ``compute_score``), but its synchronous trainer keeps only per-step aggregates
  (``meta_info["timing"]``: min/mean/max, "slowest"), never copied onto episodes. Per sample they
  reach the batch as ``processing_times`` / ``tool_calls_times`` (fully async trainer) →
  ``rl.stage.generation.seconds`` / ``rl.stage.tool.seconds``; ``verl_loop`` also reads them
  (and ``compute_score`` → ``rl.stage.reward.seconds``) before verl aggregates them. A 0.0 (verl's
  default where nothing was timed) is left out. No ``rl.duration.seconds``: verl measures no
  sample's wall time (the stages leave out waiting, tokenisation and environment steps).
* Not recorded: ``turn_scores``, ``tool_rewards`` (per-turn lists), ``extras``, ``extra_info``, ``priority``,
  ``reward_model`` (ground truth), ``raw_prompt``, ``tools_kwargs``, ``multi_modal_*``,
  ``ref_log_prob``/``values``/``returns``, ``position_ids``, ``meta_info``
  metrics.

Tensors leave the device once per batch; text is decoded only for the episodes the tail
sampler keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts import record_token_batch
from otel_rollouts.adapters.kit import (
    COUNT_PARTIAL,
    check_release,
    count,
    describe_framework,
    field,
    guarded,
    seconds,
    set_policy,
    set_times,
    split_name,
    to_list,
    warn_unknown,
)

__all__ = ["ROLLOUT_N_COLUMN", "STAGE_COLUMNS", "mark_rollouts", "record_batch", "rollout_numbers",
           "stage_columns"]

FRAMEWORK = "verl"
TESTED = ("0.9.0", "0.9.1")  # the releases tests/adapters/test_real_verl*.py run on
ROLLOUT_N_COLUMN = "__otr_rollout_n__"  # non_tensor_batch column written by mark_rollouts
_REWARD_TENSORS = ("token_level_scores", "token_level_rewards", "rm_scores")
_VERSION_COLUMNS = ("max_global_steps", "global_steps", "param_version", "policy_version")
_METADATA_COLUMNS = ("num_cached_tokens", "spec_num_draft_tokens", "spec_num_accepted_tokens",
                     "spec_num_verify_steps", "agent_name")
# per-sample seconds of verl's ``AgentLoopMetrics`` (timed by the agent loop around its LLM calls,
# its tool calls and the reward): the fully async trainer's columns (``addition_process``), and
# the column ``verl_loop`` fills from the metrics verl's manager aggregates away
SCORE_TIMES_COLUMN = "__otr_compute_score_times__"
STAGE_COLUMNS = {"processing_times": c.STAGE_GENERATION, "tool_calls_times": c.STAGE_TOOL,
                 SCORE_TIMES_COLUMN: c.STAGE_REWARD}
# columns verl's dataset, agent loop, LLM server client and trainers add that are not rewards
_NOT_REWARDS = {"uid", "index", "data_source", "extra_info", "reward_model", "raw_prompt",
                "raw_prompt_ids", "prompt", "full_prompts", "tools_kwargs", "interaction_kwargs",
                "request_id", "multi_modal_data", "multi_modal_inputs", "agent_name",
                "__num_turns__", "param_version", "policy_version", "global_steps",
                "min_global_steps", "max_global_steps", "num_cached_tokens", "turn_scores",
                "tool_rewards", "extras", "tool_extra_fields", "prompt_len", "response_len",
                "processing_times", "tool_calls_times", "spec_num_draft_tokens",
                "spec_num_accepted_tokens", "spec_num_verify_steps", "num_preempted",
                "priority", "__do_sample__", ROLLOUT_N_COLUMN, SCORE_TIMES_COLUMN}


class _Attributes(dict[str, object]):
    """Per-sample root attributes for ``record_token_batch``, filled through the episode API."""

    def set_attribute(self, key: str, value: object) -> None:
        self[key] = value


@guarded
def mark_rollouts(batch: object, *, agent_loop_workers: int | None = None) -> int:
    """Write verl's ``rollout_n`` of each sample into ``non_tensor_batch[ROLLOUT_N_COLUMN]``.

    Call it on the generated batch before ``_balance_batch``: verl's rollout traces number a
    prompt's rollouts by their order at generation (``get_trajectory_info``: consecutive samples
    with the same dataset ``index``), which balancing destroys; the column moves with the samples
    (``DataProto.reorder``) so ``record_batch`` gives verl's numbers. ``agent_loop_workers``
    (``config.actor_rollout_ref.rollout.agent.num_workers``): verl numbers each worker's chunk
    (``DataProto.chunk``) on its own, which matters when a prompt's rollouts straddle two chunks.
    Returns how many samples.
    """
    non_tensor = field(batch, "non_tensor_batch")
    if non_tensor is None:
        return 0
    check_release(FRAMEWORK, "verl", TESTED)
    index = _dataset_index(non_tensor)
    if index is None:
        return 0
    import numpy as np

    size = len(index)
    non_tensor[ROLLOUT_N_COLUMN] = np.asarray(rollout_numbers(index, agent_loop_workers), dtype=np.int64)
    return size


def rollout_numbers(index: Sequence[object], agent_loop_workers: int | None = None) -> list[int]:
    """verl's ``rollout_n`` of each sample of a generation batch, in generation order: the
    batch is cut into ``agent_loop_workers`` chunks (``DataProto.chunk``) and each chunk numbered
    by ``get_trajectory_info`` (consecutive samples with the same dataset index)."""
    size, parts = len(index), max(1, int(agent_loop_workers or 1))
    numbers: list[int] = []
    start = 0
    for k in range(parts):  # np.array_split's chunk sizes, as DataProto.chunk
        end = start + size // parts + (1 if k < size % parts else 0)
        numbers += _trajectory_rollout_n(index[start:end])
        start = end
    return numbers


def _dataset_index(non_tensor: object) -> list[object] | None:
    """The dataset index verl's agent loop numbered the rollouts by. ``index`` when the batch
    has it; else (verl's reward-loop layout: with reward-loop workers the agent loop returns none
    of its input columns, so the trained batch keeps only ``uid``, ``data_source``,
    ``reward_model`` and ``extra_info``) ``extra_info["index"]``, from which ``RLHFDataset``
    made the column (``extra_info.get("index", 0)``); else the position (``np.arange``)."""
    index = to_list(_column(non_tensor, "index"))
    if index is not None:
        return index
    extra_info = to_list(_column(non_tensor, "extra_info"))
    if extra_info is not None:
        if not all(isinstance(e, Mapping) and "index" in e for e in extra_info):
            warn_unknown(FRAMEWORK, "extra_info.index", "missing: numbered as verl's RLHFDataset does "
                         "(index 0), which a custom dataset class may not")
        return [e.get("index", 0) if isinstance(e, Mapping) else 0 for e in extra_info]
    uid = to_list(_column(non_tensor, "uid"))
    return None if uid is None else list(range(len(uid)))  # verl: np.arange(len(batch))


@guarded
def record_batch(
    batch: object,
    *,
    step: int,
    tokenizer: object,
    split: str = "train",
    policy_version: int | Sequence[int] | None = None,
    rollout_n: int | None = None,
    reward_extra_keys: Sequence[str] | None = None,
    model: str | None = None,
    trained_version: int | None = None,
    group_size: int | None = None,
) -> int:
    """Record every sample of a verl ``DataProto`` as one episode; returns how many.

    * ``step``: the trainer's ``global_steps`` (``rl.step``; the cap holds per step and split).
    * ``split``: ``train`` or ``eval``; ``meta_info["validate"]`` marks a validation batch eval.
    * ``policy_version``: the weights version that generated the batch (an int, or one per
      sample); else ``max_global_steps`` / ``global_steps`` from ``non_tensor_batch``.
    * ``trained_version``: the version of the weights that train on the batch (default for
      training batches: ``step - 1``); gives ``rl.staleness``.
    * ``rollout_n``: samples per prompt, used to form groups only when ``uid`` is missing.
    * ``reward_extra_keys``: ``non_tensor_batch`` columns that are reward terms (default: verl's
      ``meta_info["reward_extra_keys"]``).
    * ``group_size``: samples verl drew per prompt (``rollout.n``, ``val_kwargs.n`` for
      validation) → ``rl.group.expected_size``, so a group whose members did not all arrive
      says so (``rl.group.lost``).
    """
    describe_framework(FRAMEWORK, "verl")
    check_release(FRAMEWORK, "verl", TESTED)
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
    extra_info = columns.get("extra_info")
    if index is None and extra_info is not None:
        index = [field(e, "index") if isinstance(e, Mapping) else None for e in extra_info]
    groups = _groups(size, uid, rollout_n)
    rollouts = _rollout_numbers(size, groups, index, columns.get(ROLLOUT_N_COLUMN)
                                if ROLLOUT_N_COLUMN not in ragged else None)
    versions = _versions(size, policy_version, columns, meta)
    lowest = _column_ints(columns.get("min_global_steps"), size) if policy_version is None else [None] * size
    if trained_version is None and split != "eval":
        if field(meta, "trajectory_param_versions") is not None:  # fully async: versions are syncs
            warn_unknown(FRAMEWORK, "trained_version", "a fully async batch: pass "
                         "trained_version=self.current_param_version for rl.staleness")
        else:
            trained_version = int(step) - 1
    trained = trained_version if split != "eval" else None
    turns = _column_ints(columns.get("__num_turns__"), size)
    extra = {name: columns[name] for name in _METADATA_COLUMNS if columns.get(name) is not None}
    stage_columns = {stage: columns[name] for name, stage in STAGE_COLUMNS.items()
                     if columns.get(name) is not None and name not in ragged}

    metadata: list[dict[str, object]] = []
    episode_ids: list[str] = []
    attributes: list[_Attributes | None] = []
    data_sources: set[str | None] = set()  # each sample's metadata["data_source"]
    seen: dict[str | None, int] = {}
    partial = 0
    for i in range(size):
        group = groups[i]
        order = seen.get(group, 0)
        seen[group] = order + 1
        sample_index = index[i] if index is not None and i < len(index) else None
        entry: dict[str, object] = {"sample_index": sample_index, "rollout_n": rollouts[i],
                                    "validate": split == "eval"}
        source = _at(columns.get("data_source"), i)
        data_sources.add(None if source is None else str(source))
        if source is not None:
            entry["data_source"] = str(source)
        for name, values in extra.items():
            value = _at(values, i)
            if isinstance(value, (int, float, str)) or _numeric(value):
                entry[name] = value.item() if hasattr(value, "item") else value
        missing = [f"{name}[{n}!={size}]" for name, n in ragged.items() if i >= n or n > size]
        if missing:
            entry["alignment"] = "partial"
            entry["alignment_missing"] = missing
            partial += 1
        metadata.append({k: v for k, v in entry.items() if v is not None})
        rep = rollouts[i] if rollouts[i] is not None else order
        episode_ids.append(f"{split}-{step}-{group}-{rep}" if group is not None else f"{split}-{step}-{i}")
        attrs = _Attributes()
        version = versions[i] if versions is not None else None
        set_policy(attrs, version, trained)
        low = lowest[i]
        if version is not None and low is not None and 0 <= low < version:
            attrs[c.RL_POLICY_VERSION_MIN] = low
            attrs[c.RL_POLICY_VERSION_MAX] = version
        if turns[i] is not None:
            attrs[c.RL_TURN_COUNT] = turns[i]
        if group_size and group_size > 0 and groups[i] is not None:
            attrs[c.RL_GROUP_EXPECTED_SIZE] = int(group_size)
        # verl's AgentLoopMetrics default to 0.0 where the loop timed nothing (no tool call, a
        # reward scored outside the loop): 0 s is "not measured" here, left out
        set_times(attrs, None, {stage: v for stage, values in stage_columns.items()
                                if (v := _at(values, i)) is not None and _positive(v)})
        attributes.append(attrs or None)
    # partial samples are marked in their metadata (rl.metadata.alignment) and counted here
    count(COUNT_PARTIAL, partial, step=step, split=split)

    components = _components(columns, _reward_keys(reward_extra_keys, meta, columns), size)
    sources = data_sources
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
        versions=_token_versions(versions, loss_mask),
        episode_ids=episode_ids,
        sample_indices=rollouts if all(r is not None for r in rollouts) else None,
        metadata=metadata,
        reward_components=components or None,
        dataset_name=sources.pop() if len(sources) == 1 else None,
        dataset_indices=[_at(index, i) for i in range(size)] if index is not None else None,
        framework=FRAMEWORK,
        model=model,
        attributes=attributes,
        **_logprobs(tensors, responses),
    )
    return size


def _logprobs(tensors: object, responses: Any) -> dict[str, Any]:
    """``record_token_batch``'s ``logprobs`` (verl's ``rollout_log_probs``: the engine's) and
    ``trainer_logprobs`` (``old_log_probs``: the actor's recomputation), each only when the batch
    has it, as verl holds them: ``[B, response_len]``, the last columns of ``input_ids``. Not
    copied. ``old_log_probs`` that is ``rollout_log_probs`` itself (verl's bypass mode) is not the
    trainer's: left out."""
    out: dict[str, Any] = {}
    engine = _get(tensors, "rollout_log_probs")
    trainer = _get(tensors, "old_log_probs")
    shape = tuple(responses.shape)
    for key, name, values in (("logprobs", "rollout_log_probs", engine),
                              ("trainer_logprobs", "old_log_probs", trainer)):
        if values is None:
            continue
        if tuple(getattr(values, "shape", ())) != shape:
            warn_unknown(FRAMEWORK, name, f"shape {tuple(getattr(values, 'shape', ()))} is not the responses' "
                         f"{shape}: not recorded")
            continue
        out[key] = values
    if "trainer_logprobs" in out and "logprobs" in out and _same_storage(engine, trainer):
        del out["trainer_logprobs"]  # bypass mode: old_log_probs = rollout_log_probs
    return out


def _same_storage(a: Any, b: Any) -> bool:
    """Whether two tensors are one (verl's bypass mode assigns the same tensor to both keys)."""
    if a is b:
        return True
    pointer = getattr(a, "data_ptr", None)
    other = getattr(b, "data_ptr", None)
    if callable(pointer) and callable(other):
        try:
            return bool(pointer() == other() and a.shape == b.shape and a.stride() == b.stride())
        except Exception:  # noqa: BLE001 - not torch tensors: compared by identity only
            return False
    return False


def _positive(value: object) -> bool:
    number = seconds(value)
    return number is not None and number > 0


def stage_columns(metrics: Sequence[object]) -> dict[str, list[object]]:
    """``STAGE_COLUMNS`` from verl's per-sample ``AgentLoopMetrics`` (models or their dumps), one
    entry per sample: ``generate_sequences``, ``tool_calls``, ``compute_score`` seconds."""
    names = {"processing_times": "generate_sequences", "tool_calls_times": "tool_calls",
             SCORE_TIMES_COLUMN: "compute_score"}
    return {column: [field(m, name) for m in metrics] for column, name in names.items()}


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


def _column(non_tensor: Any, key: str) -> object:
    try:
        return non_tensor[key] if key in non_tensor else None
    except TypeError:
        return None


def _names(non_tensor: Any) -> list[str]:
    try:
        return [str(k) for k in non_tensor.keys()]
    except AttributeError:
        return []


def _cat_zeros(response_mask: Any, prompt_width: int) -> object:
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


def _groups(size: int, uid: Sequence[object] | None, rollout_n: int | None) -> list[str | None]:
    if uid is not None and all(u is not None for u in uid):
        return [str(u) for u in uid]
    if rollout_n and rollout_n > 0 and size % rollout_n == 0:  # batch.repeat(n, interleave=True)
        return [str(i // rollout_n) for i in range(size)]
    return [None] * size


def _trajectory_rollout_n(index: Sequence[object]) -> list[int]:
    """verl's ``get_trajectory_info`` numbering: the count of equal dataset indices just before."""
    out, n = [], 0
    for i, value in enumerate(index):
        n = n + 1 if i > 0 and index[i - 1] == value else 0
        out.append(n)
    return out


def _rollout_numbers(size: int, groups: list[str | None], index: Sequence[object] | None,
                     marked: list[Any] | None) -> list[int | None]:
    """verl's ``rollout_n`` per sample: from ``mark_rollouts``'s column, else from the current
    order when every group is still contiguous (not reordered); else unknown (warned)."""
    if marked is not None:
        values = _column_ints(marked, size)
        if all(v is not None for v in values):
            return _unique_in_groups(values, groups)
        warn_unknown(FRAMEWORK, ROLLOUT_N_COLUMN, "not integers; rollout_n not recorded")
        return [None] * size
    if not _contiguous(groups):
        warn_unknown(FRAMEWORK, "rollout_n", "the samples of a uid group are not adjacent (verl's "
                     "_balance_batch reordered them): call mark_rollouts(batch) before balancing "
                     "to record verl's rollout_n")
        return [None] * size
    keys = index if index is not None and len(index) == size else list(range(size))
    return _unique_in_groups(_trajectory_rollout_n(keys), groups)


def _unique_in_groups(values: Sequence[int | None], groups: list[str | None]) -> list[int | None]:
    """``values`` when (group, value) names each sample once (they become episode ids)."""
    pairs = [(g, v) for g, v in zip(groups, values, strict=True) if g is not None]
    if len(set(pairs)) != len(pairs):
        warn_unknown(FRAMEWORK, "rollout_n", "repeats within a uid group; rollout_n not recorded")
        return [None] * len(values)
    return list(values)


def _contiguous(groups: list[str | None]) -> bool:
    closed: set[str] = set()
    previous = None
    for g in groups:
        if g != previous:
            if g in closed:
                return False
            if previous is not None:
                closed.add(previous)
            previous = g
    return True


def _column_ints(values: list[Any] | None, size: int) -> list[int | None]:
    out: list[int | None] = []
    for i in range(size):
        v = _at(values, i)
        try:
            out.append(None if v is None or isinstance(v, (str, bytes)) else int(v))
        except (TypeError, ValueError):
            out.append(None)
    return out


def _versions(size: int, explicit: Any, columns: Mapping[str, list[object] | None], meta: object
              ) -> list[int | None] | None:
    """One policy version per sample (verl keeps no per-token versions); −1 placeholders and
    missing values are None."""
    value = explicit
    if value is None:
        value = next((column for k in _VERSION_COLUMNS if (column := columns.get(k)) is not None
                      and any(v is not None for v in column)), None)
    if value is None:
        value = field(meta, "param_version", "policy_version")
    if value is None:
        return None
    if isinstance(value, (int, float)) or getattr(value, "shape", None) == ():
        return [int(value) if int(value) >= 0 else None] * size
    values = _column_ints(to_list(value), size)
    return [v if v is not None and v >= 0 else None for v in values]


def _token_versions(per_sample: list[int | None] | None, loss_mask: Any) -> object:
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


def _reward_keys(explicit: Sequence[str] | None, meta: object, columns: Mapping[str, list[object] | None]) -> list[str]:
    """Which columns are reward terms: the caller's list, else verl's ``reward_extra_keys``, else
    the numeric columns that are not verl bookkeeping (warned: a guess)."""
    if explicit is not None:
        return [str(k) for k in explicit]
    listed = field(meta, "reward_extra_keys")
    if listed is not None and not isinstance(listed, (str, bytes)):
        return [str(k) for k in to_list(listed) or []]
    guessed = [name for name, values in columns.items()
               if values is not None and name not in _NOT_REWARDS and not name.startswith("__")
               and values and all(_numeric(v) for v in values)]
    if guessed:
        warn_unknown(FRAMEWORK, "reward_extra_keys", f"meta_info has no reward_extra_keys; numeric columns "
                     f"{sorted(guessed)} taken as reward terms (pass reward_extra_keys= to choose)")
    return guessed


def _components(columns: Mapping[str, list[object] | None], keys: Sequence[str], size: int) -> dict[str, list[object]]:
    """The reward-term columns (``acc``, ``score``, ``format``...) aligned to the batch."""
    out = {}
    for name in keys:
        values = columns.get(name)
        if values is None:
            continue
        out[name] = (values + [None] * size)[:size]
    return out


def _numeric(value: object) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (int, float)):
        return True
    item = getattr(value, "item", None)
    return callable(item) and getattr(value, "shape", None) == ()
