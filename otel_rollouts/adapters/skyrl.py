"""SkyRL (NovaSky-AI/SkyRL) generator batches as episode traces.

Call it right after ``generator.generate(input_batch)`` in the synchronous trainer; in the fully
asynchronous trainer, once per ``GeneratedOutputGroup`` where the mini-batch is trained (the cap
holds per training step, so per-group calls cannot log groups × cap traces)::

    from otel_rollouts.adapters import skyrl
    skyrl.record_generator_output(generator_input, generator_output,
                                  step=self.global_step, tokenizer=self.tokenizer)
    skyrl.record_output_group(group, step=self.global_step, tokenizer=self.tokenizer)  # fully async

``generator_input`` is SkyRL's ``GeneratorInput`` (``prompts`` as chat messages, already expanded
per sample; ``env_classes``, ``env_extras``, ``trajectory_ids``, ``batch_metadata``),
``generator_output`` its ``GeneratorOutput`` as ``SkyRLGymGenerator.generate`` returns it.
TypedDicts, dicts or objects all work; SkyRL is never imported. Tested on skyrl 0.3.0 (Python
3.11) and 0.4.0 (Python ≥ 3.12); a newer release is warned once (``check_release``) and every
``GeneratorOutput`` key it adds is warned once by name, never guessed.

Without editing the trainer: SkyRL chooses its generator in ``BasePPOExp.get_generator`` (no
class-path setting exists); one line in that override records every generation::

    return skyrl.RecordingGenerator(super().get_generator(cfg, tokenizer, client), tokenizer=tokenizer)

(``fully_async=True`` for ``FullyAsyncRayPPOTrainer``: no staleness at generation time).

Field → attribute mapping (one episode per trajectory; step-wise rows of one trajectory merged):

==========================================  ===================================================
SkyRL                                       otel-rollouts
==========================================  ===================================================
``step=`` (the trainer's ``global_step``    ``rl.step``; the cap's unit
that trains on the rollouts)
``GeneratorInput.prompts[j]``               ``prompt`` span (the messages as given); without a
                                            prompt, ``prompt_token_ids`` split into messages
``response_ids`` + ``loss_masks``           one ``turn`` per run of 1s: ``chat`` span with the
                                            assistant text (template markup / EOS removed,
                                            Hermes ``<tool_call>`` blocks → ``tool_calls`` and
                                            ``execute_tool`` spans); each run of 0s after it →
                                            its messages with their own role (``user`` for
                                            gsm8k's observations; ``environment`` only for text
                                            without any role marker) or the tool calls' results
``rewards`` (float or per-token list)       ``rl.reward.score`` = the sum; with several turns,
                                            ``rl.reward.component.turn_<k>`` = the reward of turn k (the
                                            per-token rewards placed in that turn's tokens; in
                                            step-wise mode each row's reward)
``env_metrics[i]`` ``steps`` /              ``rl.turn.count`` (else the number of generations
``turns_used`` / ``turns`` / ``num_turns``  recorded)
other ``env_metrics[i]`` scalars            ``rl.metadata.env_metrics.<name>`` (never rewards)
``stop_reasons``                            finish reason; ``length`` → ``rl.status=truncated``
``trajectory_ids`` (output, else input)     ``rl.episode.id`` (``uid_rep``); ``rl.group.id`` =
                                            ``instance_id``
``batch_metadata.global_step`` *g*,         train: ``rl.policy.version`` = g − 1 (SkyRL's
``training_phase``                          ``global_step`` is the step being worked on, g − 1
                                            steps finished), ``rl.staleness`` = ``step`` − g
                                            (0 on-policy, as SkyRL's own ``async/staleness``);
                                            eval: ``rl.policy.version`` = g (eval runs after g
                                            finished steps), no staleness, ``rl.split=eval``
``env_classes[j]``                          ``rl.dataset.name``
``env_extras[j]`` scalars                   ``rl.metadata.env_extras.<key>``
``trajectory_time_splits`` (0.4.0)          ``rl.stage.generation.seconds`` (``llm``: model
                                            calls), ``rl.stage.environment.seconds`` (``env``:
                                            ``env.step``); absent when not measured
``trajectory_generation_times``             ``rl.duration.seconds``: the agent loop's
                                            ``e2e_time``, the trajectory's wall time (absent
                                            when SkyRL leaves it None)
``env_extras[j]["extra_info"]["index"]``,   ``rl.dataset.index`` (SkyRL's ``PromptDataset``
else a numeric ``instance_id``              makes the uid ``str(row)``; other uids: none)
``rollout_logprobs`` (the engine's, per     train–inference mismatch (``rl.mismatch.*``, where
response token; ``sampling_params.          both are known), counted where ``loss_masks`` is 1
logprobs`` set) + ``trainer_logprobs=``     (SkyRL's own ``rollout_train_logprobs_abs_diff``
(the trainer's ``action_log_probs``)        mask): each generation span its own tokens' (worst
                                            positions within the generation), the root the
                                            trajectory's (the sum of its generations)
==========================================  ===================================================

Train–inference mismatch: the trainer's logprobs are not in the ``GeneratorOutput``. SkyRL's
trainer computes them after generation (``RayPPOTrainer.fwd_logprobs_values_reward`` writes
``training_input["action_log_probs"]``, ``[rows, max_response]``, right-aligned as every
response-level tensor of ``convert_prompts_responses_to_batch_tensors``; None when the policy
forward is skipped, ``_skip_policy_forward``). To record both, call the adapter after that line
with the generator output the batch was built from (after ``postprocess_generator_output``),
instead of the call right after generation (each call records the episodes)::

    training_input = self.fwd_logprobs_values_reward(training_input)
    skyrl.record_generator_output(generator_input, generator_output, step=self.global_step,
                                  tokenizer=self.tokenizer,
                                  trainer_logprobs=training_input["action_log_probs"])

``trainer_logprobs``: that tensor (row i's values are its last ``len(response_ids[i])`` columns),
or one sequence per row. Without it (``RecordingGenerator``, a call right after generation) only
the engine's logprobs are passed: no statistics, nothing else changes.

One SkyRL training step is counted as one update: the sampler's weights change once per step
(``save_weights_for_sampler``), whatever number of mini-batch optimizer steps it ran.

A loss mask of only 0s (``apply_overlong_filtering`` on a truncated trajectory) cannot split
turns: the response is recorded as one generation, with ``rl.metadata.loss_masked=true``.

Not recorded: ``rollout_metrics`` (batch-level), ``rollout_expert_indices``,
``rollout_sample_support`` (0.4.0: the sampler's top-k vocabulary ids per response token, used to
renormalise logprobs; token-level sampler state, not an episode fact), ``pixel_values``/``image_grid_thw``, non-scalar env metrics
(warned once).

Decoding: observation tokens are decoded when recorded (their messages and roles are the
episode's structure); assistant text only if the episode is kept, except a turn that may hold a
tool call (a Hermes ``<tool_call>`` token in its ids, or text starting like JSON), decoded when
recorded because its ``execute_tool`` spans are structure too.

Also: rows map to prompts by ``trajectory_ids`` (blocked layout only when complete); a repeated
id outside step-wise mode is a duplicate, recorded once; structures not understood are warned
about once (``kit.warn_unknown``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from otel_rollouts import conventions as c
from otel_rollouts.adapters._messages import record_assistant
from otel_rollouts.adapters._text import assistant_message, clean, messages_of
from otel_rollouts.adapters.kit import (
    COUNT_DUPLICATE,
    HERMES_OPEN,
    Columns,
    Deferred,
    Sample,
    as_float,
    check_release,
    count,
    describe_framework,
    field,
    first_occurrences,
    group_ids,
    guarded,
    lazy_text,
    mask_runs,
    read_samples,
    record_samples,
    reward_total,
    seconds,
    set_policy,
    set_span_attribute,
    split_name,
    status_for,
    to_cpu,
    to_list,
    tool_responses,
    warn_unknown,
)

if TYPE_CHECKING:
    from otel_rollouts import Episode

__all__ = ["RecordingGenerator", "record_generator_output", "record_output_group"]

FRAMEWORK = "skyrl"
ROLE_ENVIRONMENT = "environment"
# env_metrics names that skyrl-gym's environments use for the number of turns taken
# (gsm8k_multi_turn: ``steps``, rlm: ``turns_used``)
TURN_COUNT_METRICS = ("steps", "turns_used", "turns", "num_turns")
# trajectory_time_splits components (SkyRL 0.4's agent loop: model calls, env.step) -> stages
TIME_SPLIT_STAGES = {"llm": c.STAGE_GENERATION, "env": c.STAGE_ENVIRONMENT}
# GeneratorOutput keys (skyrl 0.3.0 and 0.4.0), mapped or knowingly not recorded; others are warned
OUTPUT_FIELDS = frozenset({
    "prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_metrics",
    "rollout_logprobs", "trajectory_ids", "trajectory_generation_times", "trajectory_time_splits",
    "rollout_expert_indices", "rollout_sample_support", "is_last_step", "env_metrics",
    "pixel_values", "image_grid_thw",
})
TESTED = ("0.3.0", "0.4.0")


@guarded
def record_generator_output(
    generator_input: object,
    generator_output: object,
    *,
    step: int,
    tokenizer: object = None,
    split: str = "train",
    n_samples_per_prompt: int | None = None,
    model: str | None = None,
    trains_at_step: bool = True,
    trainer_logprobs: object = None,
) -> int:
    """Record each trajectory of a SkyRL generation as one episode; returns how many.

    The generation goes to the tail sampler as columns (rewards, stop reasons, groups) in one
    call; only the trajectories it may keep get their turns recorded and decoded.

    * ``step``: the trainer's ``global_step`` that trains on these rollouts (``rl.step``; the
      cap's unit); with ``batch_metadata.global_step`` it gives ``rl.staleness``.
    * ``tokenizer``: the policy's tokenizer (its chat template and special tokens are taken out
      of the text); turns are split by ``loss_masks`` (1 = policy tokens, 0 = environment
      observations). Without it only token counts are recorded.
    * ``split``: ``train`` or ``eval``; ``batch_metadata.training_phase == "eval"`` means eval.
    * ``n_samples_per_prompt``: group size, used only when ``trajectory_ids`` are missing and
      the blocked layout is complete.
    * ``trains_at_step``: False when ``step`` is the step the rollouts were generated at and the
      step that trains on them is not known yet (``RecordingGenerator`` in the fully async
      trainer): no ``rl.staleness`` then, rather than a wrong 0.
    * ``trainer_logprobs``: the trainer's logprobs of the response tokens, one row per
      ``GeneratorOutput`` row: SkyRL's ``training_input["action_log_probs"]`` (right-aligned
      ``[rows, max_response]``) or a sequence per row; with ``rollout_logprobs`` they give the
      ``rl.mismatch.*`` statistics.
    """
    check_release(FRAMEWORK, "skyrl", TESTED)
    meta = field(generator_input, "batch_metadata")
    phase = field(meta, "training_phase")
    split = "eval" if split_name(phase, "") == "eval" or split_name(split) == "eval" else split_name(split)
    scheduled = _int_or_none(field(meta, "global_step"), "batch_metadata.global_step")
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
    # trajectory id of each row (input ids stand in when the output has none and rows == inputs:
    # SkyRLGymGenerator returns ``trajectory_ids=None`` outside step-wise mode)
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
        rows_of: dict[str | tuple[str, int], list[int]] = {}
        for i in range(n):
            tid = keys[i]
            rows_of.setdefault(tid if tid is not None else ("row", i), []).append(i)
        episodes = list(rows_of.values())
    else:
        keep, dups = first_occurrences(keys)
        count(COUNT_DUPLICATE, dups, step=step, split=split)
        episodes = [[i] for i in keep]
    groups, grouped_by = group_ids(
        n,
        ids=row_tids,
        key=lambda t: field(t, "instance_id") if not isinstance(t, str) else t.rsplit("_", 1)[0],
        per_group=n_samples_per_prompt,
        complete=not cols.ragged and bool(n_samples_per_prompt),
    )
    if split == "eval":
        version, trained = scheduled, None  # eval runs after `global_step` finished steps
    else:
        version = None if scheduled is None else scheduled - 1
        trained = _int_or_none(step, "step") if trains_at_step else None
        trained = None if trained is None else trained - 1
    text = None
    if tokenizer is not None:
        try:
            text = _Text(tokenizer)
        except Exception as exc:  # noqa: BLE001 - recorded without text rather than not at all
            warn_unknown(FRAMEWORK, "tokenizer", f"unusable ({type(exc).__name__}): token counts only")
    env_classes, env_extras = field(generator_input, "env_classes"), field(generator_input, "env_extras")
    # the run: SkyRL, the policy model given, the environment when the batch has one
    classes = {str(e) for e in env_classes} if isinstance(env_classes, (list, tuple)) else set()
    describe_framework(FRAMEWORK, "skyrl", model_name=model,
                       environment_name=next(iter(classes)) if len(classes) == 1 else None)

    engine_rows = _logprob_rows(field(out, "rollout_logprobs"), n, "rollout_logprobs")
    trainer_rows = _logprob_rows(trainer_logprobs, n, "trainer_logprobs")
    stage_times = _stage_times(field(out, "trajectory_time_splits"), n)
    durations = _durations(field(out, "trajectory_generation_times"), n)
    _warn_unmapped_fields(out)

    def read(number: int) -> Sample:
        rows = episodes[number]
        first = rows[0]
        j = input_index.get(keys[first]) if keys[first] is not None else None
        if j is None and per_prompt is not None and not stepwise:
            j = first // per_prompt
        prompt = prompts[j] if j is not None and j < len(prompts) else None
        key = keys[first]
        return _sample(
            cols, rows, scheduled=scheduled, version=version,
            trained=trained, prompt=prompt, prompt_found=j is not None and j < len(prompts),
            input_index=j,
            episode_id=key if key is not None else f"{split}-{step}-{first}",
            group=groups[first], env_class=_at(env_classes, j), env_extras=_at(env_extras, j),
            text=text, model=model, sample_index=number, stages=stage_times.get(rows[-1]),
            duration=durations.get(rows[-1]),
            instance_id=groups[first] if grouped_by == "ids" else None,
            engine_rows=engine_rows, trainer_rows=trainer_rows,
        )

    samples = read_samples(range(len(episodes)), read, FRAMEWORK)
    return record_samples(samples, step=step, split=split, framework=FRAMEWORK,
                          tokenizer=text.tokenizer if text is not None else None)


@guarded
def record_output_group(group: object, *, step: int, tokenizer: object = None,
                        model: str | None = None, trainer_logprobs: object = None) -> int | None:
    """Record one ``GeneratedOutputGroup`` of SkyRL's fully asynchronous trainer (its
    ``generator_output``, ``uid``, ``global_step_when_scheduled``, ``prompts``), e.g. for each
    group in ``convert_generation_group_mini_batch_to_training_input`` with
    ``step=self.global_step``; returns how many episodes. The group's own scheduling step is its
    policy version: ``rl.staleness`` = ``step`` − ``global_step_when_scheduled``, SkyRL's own
    per-group staleness. ``trainer_logprobs``: as in ``record_generator_output``, the group's
    rows."""
    out = field(group, "generator_output")
    uid = field(group, "uid")
    prompts = to_list(field(group, "prompts")) or []
    rows = len(prompts) or len(to_list(field(out, "response_ids")) or [])
    ids = None if uid is None else [{"instance_id": str(uid), "repetition_id": r} for r in range(rows)]
    if uid is None:
        warn_unknown(FRAMEWORK, "GeneratedOutputGroup.uid", "missing: episodes are not grouped")
    generator_input = {
        "prompts": prompts,
        "trajectory_ids": ids,
        "batch_metadata": {"global_step": field(group, "global_step_when_scheduled"), "training_phase": "train"},
    }
    return record_generator_output(generator_input, out, step=step, tokenizer=tokenizer, model=model,
                                   trainer_logprobs=trainer_logprobs)


class RecordingGenerator:
    """A SkyRL generator that records every ``GeneratorOutput`` its inner generator returns
    (rewards, env metrics, time splits included), then returns it unchanged.

    The one line, in ``BasePPOExp.get_generator`` (SkyRL's hook for choosing the generator)::

        return skyrl.RecordingGenerator(super().get_generator(cfg, tokenizer, client), tokenizer=tokenizer)

    ``step`` is the input's ``batch_metadata.global_step``: the step that trains on the rollouts
    in the synchronous trainer (``rl.staleness`` 0). In the fully asynchronous trainer pass
    ``fully_async=True``: the training step is not known at generation time, so no staleness is
    recorded (``record_output_group`` where the group is trained records it). Everything else
    (``generate_batched``, ``generator_cfg`` ...) is the inner generator's. Recording never
    raises into generation.
    """

    def __init__(self, generator: Any, *, tokenizer: object = None, model: str | None = None,
                 fully_async: bool = False) -> None:
        self.generator = generator
        self._record: _Options = {"tokenizer": tokenizer, "model": model, "trains_at_step": not fully_async}

    async def generate(self, input_batch: object, disable_tqdm: bool = False, **kwargs: object) -> Any:
        if disable_tqdm and _accepts(self.generator.generate, "disable_tqdm"):
            kwargs["disable_tqdm"] = disable_tqdm
        output = await self.generator.generate(input_batch, **kwargs)
        _record_generation(input_batch, output, self._record)
        return output

    def __getattr__(self, name: str) -> Any:
        if name == "generator":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.generator, name)


class _Options(TypedDict):
    """``RecordingGenerator``'s keywords for ``record_generator_output``."""

    tokenizer: object
    model: str | None
    trains_at_step: bool


@guarded
def _record_generation(input_batch: object, output: object, options: _Options) -> None:
    step = _int_or_none(field(field(input_batch, "batch_metadata"), "global_step"), "batch_metadata.global_step")
    if step is None:
        warn_unknown(FRAMEWORK, "batch_metadata.global_step", "missing: generation not recorded")
        return
    record_generator_output(input_batch, output, step=step, **options)


def _accepts(function: Callable[..., object], name: str) -> bool:
    try:
        import inspect

        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _stage_times(splits: object, n: int) -> dict[int, dict[str, float]]:
    """``trajectory_time_splits`` (SkyRL 0.4: ``{"llm": [...], "env": [...]}``, a trajectory's
    seconds in model calls and in ``env.step``) as ``{row: {stage: seconds}}``.

    The lists hold one entry per row, in step-wise mode too (every row of a trajectory repeats
    its trajectory's times; the episode takes its last row's), before and after
    ``concatenate_generator_outputs``. Other lengths are warned, not guessed."""
    if splits is None:
        return {}
    if not isinstance(splits, Mapping):
        warn_unknown(FRAMEWORK, "trajectory_time_splits", f"expected a dict of lists, got {type(splits).__name__}")
        return {}
    out: dict[int, dict[str, float]] = {}
    for name, values in splits.items():
        stage = TIME_SPLIT_STAGES.get(str(name))
        if stage is None:
            warn_unknown(FRAMEWORK, f"trajectory_time_splits.{name}", "time split not mapped to a stage")
            continue
        values = to_list(values) or []
        if len(values) != n:
            warn_unknown(FRAMEWORK, f"trajectory_time_splits.{name}",
                         f"{len(values)} values for {n} rows: not recorded")
            continue
        for row, value in enumerate(values):
            seconds, _ = as_float(value, f"trajectory_time_splits.{name}")
            if seconds is None or not math.isfinite(seconds) or seconds < 0:
                if value is not None:
                    warn_unknown(FRAMEWORK, f"trajectory_time_splits.{name}",
                                 f"not a duration in seconds: {type(value).__name__}")
                continue
            out.setdefault(row, {})[stage] = seconds
    return out


def _durations(times: object, n: int) -> dict[int, float]:
    """``trajectory_generation_times`` as ``{row: seconds}``: each trajectory's ``e2e_time``, the
    wall time of its whole agent loop (model calls, ``env.step``, waiting), measured by SkyRL's
    generator around ``agent_loop`` — the episode's duration. One entry per row (step-wise rows
    repeat their trajectory's); SkyRL leaves the field None unless every trajectory has one. A
    list that does not fit the rows is warned, not guessed."""
    values = to_list(times)
    if values is None:
        return {}
    if len(values) != n:
        warn_unknown(FRAMEWORK, "trajectory_generation_times", f"{len(values)} values for {n} rows: not recorded")
        return {}
    out: dict[int, float] = {}
    for row, value in enumerate(values):
        number = seconds(value)
        if number is None:
            if value is not None:
                warn_unknown(FRAMEWORK, "trajectory_generation_times",
                             f"not a duration in seconds: {type(value).__name__}")
            continue
        out[row] = number
    return out


def _dataset_index(env_extras: object, instance_id: object) -> int | None:
    """The prompt's dataset index: ``env_extras["extra_info"]["index"]`` (SkyRL's dataset
    preprocessing scripts write verl's ``extra_info`` column with the source row's index), else the
    trajectory's ``instance_id`` when it is a number (``PromptDataset.__getitem__`` makes the uid
    ``str(item)``: the row's index in the dataset); None for any other uid (never guessed)."""
    extra = field(env_extras, "extra_info")
    for value in (field(extra, "index") if isinstance(extra, Mapping) else None, instance_id):
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value.strip())
    return None


def _warn_unmapped_fields(out: object) -> None:
    """Warn once per ``GeneratorOutput`` key this adapter neither maps nor knowingly skips (a
    newer SkyRL's field is named, never silently dropped)."""
    if isinstance(out, Mapping):
        for name in out:
            if name not in OUTPUT_FIELDS:
                warn_unknown(FRAMEWORK, f"GeneratorOutput.{name}", "field not mapped by this adapter")


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        warn_unknown(FRAMEWORK, name, f"not an integer step: {type(value).__name__}")
        return None


def _tid_string(tid: object) -> str | None:
    if tid is None:
        return None
    if isinstance(tid, str):
        return tid
    to_string = getattr(tid, "to_string", None)
    if callable(to_string):
        return str(to_string())
    instance, rep = field(tid, "instance_id"), field(tid, "repetition_id")
    if instance is None:
        warn_unknown(FRAMEWORK, "trajectory_ids", f"no instance_id/to_string on {type(tid).__name__}")
        return None
    return f"{instance}_{rep}"


def _at(values: object, j: int | None) -> object:
    rows = to_list(values)
    if rows is None or j is None or j >= len(rows):
        return None
    return rows[j]


def _with_tool_results(message: Mapping[str, object], feedback: list[dict[str, str]]) -> list[dict[str, str]]:
    """The observation after a turn that made tool calls, as ``tool`` messages answering them:
    Hermes/Qwen ``<tool_response>`` blocks in order, else the whole observation for the first
    call (SkyRL's tool environments answer in a user message). Other feedback is kept."""
    calls = message.get("tool_calls") or []
    if not calls or not feedback:
        return feedback
    out: list[dict[str, str]] = []
    for m in feedback:
        blocks = tool_responses(str(m.get("content") or ""))
        if blocks:
            out.extend({"role": "tool", "content": b} for b in blocks)
        else:
            out.append(m)
    if not any(m["role"] == "tool" for m in out):
        text = "\n".join(str(m.get("content") or "") for m in feedback)
        return [{"role": "tool", "content": text}]
    return out


def _reward(value: object, name: str) -> tuple[float | None, list[float] | None, str | None]:
    """``reward_total`` with a fast path for SkyRL's per-token lists of numbers."""
    if isinstance(value, list):
        try:
            total = sum(value)
        except TypeError:  # e.g. legacy strings: the careful path says what is wrong
            total = None
        if isinstance(total, (int, float)) and not isinstance(total, bool) and math.isfinite(total):
            return float(total), value, None
    return reward_total(value, name)


def _runs(mask: Sequence[object]) -> list[tuple[int, int, int]]:
    """``mask_runs`` for 0/1 masks found with ``list.index`` (C speed), else ``mask_runs``."""
    try:
        if not set(mask) <= {0, 1}:
            return mask_runs(mask)
    except TypeError:  # unhashable entries
        return mask_runs(mask)
    out: list[tuple[int, int, int]] = []
    n, pos = len(mask), 0
    while pos < n:
        value = 1 if mask[pos] else 0
        try:
            end = mask.index(1 - value, pos)
        except ValueError:
            end = n
        out.append((pos, end, value))
        pos = end
    return out


def _reward_by_turn(per_token: list[float], runs: list[tuple[int, int, int]]) -> list[float]:
    """Per-token rewards summed per turn (a turn: a run of 1s and the 0s after it; 0s before
    the first run count with turn 0)."""
    starts = [s for s, _, value in runs if value] or [0]
    starts[0] = 0
    bounds = starts + [len(per_token)]
    return [float(sum(per_token[bounds[k]:bounds[k + 1]])) for k in range(len(starts))]


def _sample(cols: Columns, rows: list[int], *, scheduled: int | None, version: int | None,
            trained: int | None, prompt: object, prompt_found: bool, input_index: int | None,
            episode_id: str, group: str | None, env_class: Any, env_extras: object,
            text: _Text | None, model: str | None, sample_index: int,
            stages: Mapping[str, float] | None = None, duration: float | None = None,
            instance_id: str | None = None, engine_rows: object = None,
            trainer_rows: object = None) -> Sample:
    """One trajectory (its rows): the reward and status now, the turns only if it may be kept."""
    v = cols.value
    last = rows[-1]
    metadata: dict[str, object] = {"rows": len(rows)} if len(rows) > 1 else {}
    if input_index is not None:
        metadata["input_index"] = input_index
    if scheduled is not None:
        metadata["scheduled_step"] = scheduled
    if isinstance(env_extras, Mapping):
        metadata.update({f"env_extras.{k}": x for k, x in env_extras.items()
                         if isinstance(x, (str, int, float, bool))})
    turn_count: int | None = None
    metrics = v("env_metrics", last)
    if isinstance(metrics, Mapping):
        for name, value in metrics.items():
            name = str(name)
            if name in TURN_COUNT_METRICS and turn_count is None and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                turn_count = int(value)
            elif isinstance(value, (str, int, float, bool)):
                metadata[f"env_metrics.{name}"] = value
            elif value is not None:
                warn_unknown(FRAMEWORK, f"env_metrics.{name}",
                             f"{type(value).__name__} value not recorded (scalars only)")
    elif metrics is not None:
        warn_unknown(FRAMEWORK, "env_metrics", f"expected a dict per row, got {type(metrics).__name__}")
    missing = [m for i in rows for m in cols.missing(i)]
    if not prompt_found:
        missing.append("prompts")
    finish = v("stop_reasons", last)
    total: float | None = None
    per_turn: list[float] = []
    problems: list[str] = []
    turns: list[tuple[int, list[int], list[object], bool]] = []  # row, ids, mask, whole mask zeroed
    counted: list[object] = []  # the loss mask as SkyRL trains with it (the logprobs' mask)
    for i in rows:
        ids = to_list(v("response_ids", i)) or []
        mask = to_list(v("loss_masks", i))
        zeroed = False
        counted += mask if mask is not None and len(mask) == len(ids) else [1] * len(ids)
        if mask is None or len(mask) != len(ids):
            if mask is not None:
                warn_unknown(FRAMEWORK, "loss_masks", "length differs from response_ids: all tokens "
                             "taken as generated")
            mask = [1] * len(ids)
        elif ids and not any(mask):
            # SkyRL's apply_overlong_filtering zeroes the whole mask of a truncated
            # trajectory: its turns cannot be told apart, the response is one generation
            zeroed = True
            mask = [1] * len(ids)
        turns.append((i, ids, mask, zeroed))
        reward, per_token, problem = _reward(v("rewards", i), f"rewards[{i}]")
        if problem:
            problems.append(problem)
        if reward is not None:
            total = reward if total is None else total + reward
            if len(rows) > 1:
                per_turn.append(reward)
            elif per_token is not None:
                per_turn = _reward_by_turn(per_token, _runs(mask))

    def content(ep: Episode) -> None:
        set_policy(ep, version, trained)
        shown = prompt
        if shown is None and text is not None:
            prompt_ids = to_list(v("prompt_token_ids", rows[0]))
            if prompt_ids:
                shown = messages_of(text.decode([list(prompt_ids)])[0], text.tokenizer, "user")
        ep.prompt(shown if shown is not None else "")
        generations = 0
        for i, ids, mask, zeroed in turns:
            if zeroed:
                ep.set_attribute(c.RL_METADATA_PREFIX + "loss_masked", True)
            generations += _turns(ep, ids, mask, text, model=model, finish_reason=v("stop_reasons", i))
        ep.set_attribute(c.RL_TURN_COUNT, turn_count if turn_count is not None else generations)
        if compared:  # found for kept episodes only: a dropped one's masks are never walked
            bounds.extend(_generation_bounds(turns))

    logprobs = _episode_logprobs(engine_rows, turns, "rollout_logprobs", aligned="exact")
    trainer_logprobs = _episode_logprobs(trainer_rows, turns, "trainer_logprobs", aligned="right")
    compared = logprobs is not None and trainer_logprobs is not None
    bounds: list[tuple[int, int]] = []  # each generation's tokens, filled by ``content``
    return Sample(
        content, episode_id=episode_id, group_id=group, sample_index=sample_index,
        dataset_name=env_class, dataset_index=_dataset_index(env_extras, instance_id),
        metadata=metadata or None, reward=total, duration=duration, stages=stages,
        components={f"turn_{k}": r for k, r in enumerate(per_turn)} if len(per_turn) > 1 else None,
        finish_reason=finish, status=status_for(finish), missing=sorted(set(missing)),
        problems=problems, logprobs=logprobs, trainer_logprobs=trainer_logprobs,
        logprob_mask=counted if compared else None,
        response_ids=[t for _, ids, _, _ in turns for t in ids] if compared else None,
        generation_bounds=bounds if compared else None,
    )


def _generation_bounds(turns: list[tuple[int, list[int], list[object], bool]]) -> list[tuple[int, int]]:
    """[start, end) of each generation (a run of 1s in the mask ``_turns`` splits by) in the
    episode's concatenated response tokens, in the order ``_turns`` records them: each
    generation's mismatch statistics and worst-token positions are its own."""
    out: list[tuple[int, int]] = []
    offset = 0
    for _, ids, mask, _ in turns:
        out.extend((offset + start, offset + end) for start, end, value in _runs(mask) if value)
        offset += len(ids)
    return out


def _logprob_rows(values: object, n: int, name: str) -> Any:
    """Per-row logprobs (``rollout_logprobs``, the trainer's): one list per ``GeneratorOutput``
    row, a tensor moved to the host once. Another number of rows is warned, not guessed."""
    if values is None:
        return None
    shape = getattr(values, "shape", None)
    # a [rows, max_response] tensor stays one host tensor (its rows are views: a dropped sample's
    # values never become Python numbers); lists are SkyRL's own rows
    rows = to_cpu(values) if shape is not None and len(shape) == 2 else to_list(values)
    if rows is None:
        return None
    if len(rows) < n or (len(rows) > n and name == "rollout_logprobs"):
        warn_unknown(FRAMEWORK, name, f"{len(rows)} rows for {n} responses: not recorded")
        return None
    return rows[:n]  # the trainer's batch may carry padding rows after the real ones


def _episode_logprobs(values: Any, turns: list[tuple[int, list[int], list[object], bool]],
                      name: str, *, aligned: str) -> object:
    """One episode's logprobs over its response tokens (its rows', concatenated), or None when
    a row has none. ``aligned="right"``: a row longer than its response holds it in its last
    columns (SkyRL's padded response tensors); ``"exact"``: the lengths must be equal."""
    if values is None:
        return None
    parts: list[Any] = []
    for i, ids, _, _ in turns:
        row = values[i] if i < len(values) else None
        if row is not None and getattr(row, "shape", None) is None:
            row = to_list(row)
        if row is None:
            return None
        if len(row) > len(ids) and aligned == "right":
            row = row[len(row) - len(ids):]
        if len(row) != len(ids):
            warn_unknown(FRAMEWORK, name, f"{len(row)} logprobs for {len(ids)} response tokens: not recorded")
            return None
        parts.append(row)
    if len(parts) == 1:
        return parts[0]  # a list, or a view of the host tensor's row
    if all(isinstance(p, list) for p in parts):
        return [x for p in parts for x in p]
    import numpy as np

    return np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])


def _turns(ep: Episode, ids: list[int], mask: Sequence[object], text: _Text | None, *, model: str | None,
           finish_reason: str | None) -> int:
    """Record one row's turns (runs of 1s) with the observations after them; returns how many
    generations. Without a tokenizer only token counts are recorded."""
    runs = _runs(mask)
    observations = [k for k, (_, _, value) in enumerate(runs) if not value]
    decoded = dict(zip(observations, text.decode([ids[s:e] for s, e, _ in (runs[k] for k in observations)])
                       if text is not None else [], strict=False))
    generations = 0
    k = 0
    while k < len(runs):
        start, end, value = runs[k]
        with ep.turn() as turn:
            if not value:  # observation tokens before any generation in this row
                for m in _feedback(decoded.get(k), text):
                    turn.feedback(m["content"], role=m["role"])
                k += 1
                continue
            generations += 1
            k += 1
            feedback: list[dict[str, str]] = []
            if k < len(runs) and not runs[k][2]:
                feedback = _feedback(decoded.get(k), text)
                k += 1
            finish = finish_reason if k >= len(runs) else None
            segment = ids[start:end]
            if text is not None and not text.may_call_tools(segment):
                # no tool call possible: the text is decoded only if the episode is kept
                turn.record_generation(text.lazy_message(segment), model=model, finish_reason=finish,
                                       output_tokens=end - start)
                for m in feedback:
                    turn.feedback(m["content"], role=m["role"])
                continue
            message: dict[str, object] = {"role": "assistant", "content": ""}
            errors: list[str] = []
            if text is not None:
                (content,) = text.decode([segment])
                message, errors = assistant_message(content, text.tokenizer, f"call_{generations - 1}_")
            errors += record_assistant(turn, message, _with_tool_results(message, feedback), model=model,
                                       finish_reason=finish, output_tokens=end - start)
            if errors:
                set_span_attribute(turn, c.RL_TOOL_PARSE_ERROR, errors)
    return generations


def _feedback(content: str | None, text: _Text | None) -> list[dict[str, str]]:
    if content is None or text is None:
        return [{"role": ROLE_ENVIRONMENT, "content": ""}]
    return messages_of(content, text.tokenizer, ROLE_ENVIRONMENT)


class _Text:
    """Decoding with one tokenizer for one call: observations now (their roles and messages are
    the episode's structure), assistant text only if the episode is kept, unless it may hold a
    tool call (whose ``execute_tool`` spans are structure too): a Hermes ``<tool_call>`` token in
    the ids, or text that starts like a JSON tool call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        clean("", tokenizer)  # learns the template's markers and special tokens on this thread
        self.hermes_id: int | None = None
        try:
            tid = tokenizer.convert_tokens_to_ids(HERMES_OPEN)
            if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) \
                    and tokenizer.decode([tid]) == HERMES_OPEN:
                self.hermes_id = tid
        except Exception:  # noqa: BLE001 - no such token: only the JSON form is looked for
            self.hermes_id = None

    def decode(self, segments: list[list[int]]) -> list[str]:
        if not segments:
            return []
        batch_decode = getattr(self.tokenizer, "batch_decode", None)
        if callable(batch_decode):
            return [str(t) for t in batch_decode(segments, skip_special_tokens=False)]
        return [str(self.tokenizer.decode(s, skip_special_tokens=False)) for s in segments]

    def may_call_tools(self, segment: list[int]) -> bool:
        if self.hermes_id is not None and self.hermes_id in segment:
            return True
        (head,) = self.decode([segment[:4]])
        return head.lstrip().startswith(("{", "[", "`"))

    def lazy_message(self, segment: list[int]) -> Deferred:
        tokenizer, decoded = self.tokenizer, lazy_text(self.tokenizer, segment)  # private copy, export thread
        return Deferred(lambda: assistant_message(decoded.resolve(), tokenizer)[0])
