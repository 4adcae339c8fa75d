"""TRL: a ``TrainerCallback`` that records every ``GRPOTrainer`` completion as an episode.

    from otel_rollouts.adapters.trl import RolloutTraceCallback

    trainer = GRPOTrainer(model=..., reward_funcs=[accuracy, fmt], args=..., train_dataset=...)
    trainer.add_callback(RolloutTraceCallback(trainer))
    trainer.train()

Where the data comes from. After generating and scoring a generation batch,
``GRPOTrainer._generate_and_score_completions`` appends every prompt, completion, per-reward-function
reward and advantage (gathered from all processes) to its ``_logs`` buffers; the token ids it
generated (``prompt_ids``, ``completion_ids``, ``tool_mask``) come out of ``GRPOTrainer._generate``
and never reach ``_logs``. Given the trainer, the callback wraps those two methods and
``_prepare_inputs`` on that trainer instance (results passed through untouched; nothing raised by
the callback's own code reaches TRL) to snapshot each batch at the moment it is made, with the
``global_step`` of the weights that generated it. Episodes are written at the end of the optimizer
step (``on_step_end``; eval batches at ``on_prediction_step``), then the step is closed for the
tail sampler (``otr.end_step``). Without those methods (another trainer) it reads ``_logs`` alone.
A batch goes to the sampler as columns (rewards, advantages, finish reasons, groups) in one call:
only the completions it may keep get their prompt and turns recorded.

Field → attribute (one episode per completion):

====================================  ===================================================================
TRL                                   recorded as
====================================  ===================================================================
``_logs["prompt"]``                   prompt span: messages as given; a string prompt rendered with the
                                      chat template is split back into its messages (``_text``)
``_logs["completion"]``               one turn per assistant message, markup/EOS removed; its
                                      ``tool_calls`` (or Hermes ``<tool_call>`` text) → ``execute_tool``
                                      spans, the ``tool`` messages after it → their results;
                                      ``rl.turn.count``
``_logs["rewards"][name]``            ``rl.reward.component.<name>`` (a reward term; NaN = function returned None:
                                      left out); ``rl.reward.score`` = Σ ``reward_weights`` × terms
``_logs["advantages"]``               ``rl.advantage``
``_logs["extra"][col]`` (log_extra)   ``rl.metadata.<col>``
``len(prompt_ids)``                   ``gen_ai.usage.input_tokens`` (first generation; later turns: the
                                      prompt plus every token before that turn)
``completion_ids`` / ``tool_mask``    ``gen_ai.usage.output_tokens``: TRL's ``completion_lengths``
                                      (model tokens, ``tool_mask`` = 1), per turn when the mask's runs
                                      match the turns
last id ∉ ``eos_token_ids``+pad       ``rl.finish_reason`` = ``length`` and ``rl.status`` = truncated
                                      (TRL's ``is_truncated`` / ``completions/clipped_ratio``), else
                                      ``stop``; also ``gen_ai.response.finish_reasons`` on the last
                                      generation
``num_generations`` consecutive       ``rl.group.id`` / ``rl.sample.index`` (one GRPO group per prompt)
``state.global_step`` at generation   ``rl.policy.version`` (updates the generating weights had)
TRL's schedule (below)                ``rl.staleness``
====================================  ===================================================================

Staleness. A generation batch made at ``global_step`` g is shuffled and split into
``steps_per_generation`` slices; slice k is first trained at micro-step m0 + k (m0 = ``_step`` at
generation), with weights that have ``g + (m0 + k) // G − m0 // G`` updates (G = gradient
accumulation steps). The default schedule (``steps_per_generation`` = G) trains the whole batch on
the weights that generated it: staleness 0. With ``steps_per_generation`` > G the later slices are
trained after further updates: their samples get staleness 1, 2…; each sample's slice is found
by matching its token rows in ``_buffered_inputs`` (main process's own samples; another process's
samples get no staleness when the slices differ). With ``num_iterations`` > 1 a batch is trained
again in later passes: the episode is recorded once, with the staleness of its first training
pass. Eval samples are never trained: version only.

Train–inference mismatch (``rl.mismatch.*`` on each generation, of its own tokens: a run of
``tool_mask`` = 1, worst positions within it; on the root, of the whole completion):
the per-token logprobs ``_generate_and_score_completions`` returns for this process's samples —
``sampling_per_token_logps`` (the engine's: vLLM's, or a ``rollout_func``'s ``logprobs``) against
``old_per_token_logps`` (the trainer's, computed by TRL when it corrects for the mismatch,
``vllm_importance_sampling_correction``, or when ``steps_per_generation`` makes the batch
off-policy), over the tokens TRL's loss counts (``completion_mask`` × ``tool_mask``; a truncated
completion masked by ``mask_truncated_completions`` counts none). Without either (plain
``transformers`` generation has no engine logprobs): no statistic.

Not recorded: images, token ids/text of tool results beyond TRL's tool messages, and
token counts / finish reasons of other processes' samples (only their text reaches the main
process). Only the main process records (TRL gathers every process's completions there). An
eval batch larger than TRL's buffers (sized for a training generation batch) has lost its first
samples inside TRL: they are counted (``adapters.unknown_structure``) and warned about once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Protocol, TypedDict, TypeVar

from transformers import TrainerCallback

from otel_rollouts import conventions as c
from otel_rollouts.adapters._messages import record_assistant
from otel_rollouts.adapters._text import assistant_message, clean, messages_of
from otel_rollouts.adapters.kit import (
    InvalidValue,
    Sample,
    as_float,
    check_release,
    describe_framework,
    end_step,
    exception_text,
    group_ids,
    guarded,
    mask_runs,
    read_samples,
    record_samples,
    report,
    set_policy,
    set_span_attribute,
    status_for,
    to_cpu,
    to_list,
    warn_unknown,
)

if TYPE_CHECKING:
    from otel_rollouts import Episode

__all__ = ["RolloutTraceCallback"]

FRAMEWORK = "trl"
TESTED = ("1.15.0", "1.16.0")  # the releases tests/adapters/test_real_trl.py runs on
_ABSENT = object()
_WRAPPED = "__otr_trl_wrapped__"
_P = ParamSpec("_P")
_R = TypeVar("_R")

_LogprobName = Literal["logprobs", "trainer_logprobs", "logprob_mask", "response_ids"]
_RowKey = tuple[tuple[object, ...], tuple[object, ...]]


class _State(Protocol):
    """What is read of the ``TrainerState`` the callback events receive."""

    @property
    def global_step(self) -> int: ...

    @property
    def is_world_process_zero(self) -> bool: ...


class _Tokens(TypedDict, total=False):
    """TRL's token lists of a generation batch (``_generate``), with its per-token logprobs
    (``_generate_and_score_completions``), for this process's samples."""

    prompt_ids: list[list[int]] | None
    completion_ids: list[list[int]] | None
    tool_mask: list[list[int]] | None
    version: int | None
    micro: int | None
    logprobs: object
    trainer_logprobs: object
    logprob_mask: object
    response_ids: object


class _RowLogprobs(TypedDict, total=False):
    """One sample's row of each logprob column (the ``Sample`` fields of the same names)."""

    logprobs: object
    trainer_logprobs: object
    logprob_mask: object
    response_ids: object


class _Batch(TypedDict, total=False):
    """A batch snapshotted from the trainer's buffers, waiting to be recorded."""

    n: int
    columns: dict[str, list[object]]
    missing: list[str]
    split: str
    version: int | None
    tokens: _Tokens
    slices: list[int | None] | None
    trained: list[int] | None
    offset: int
    rows: list[_RowKey] | None


class _Usage(TypedDict):
    """A sample's prompt length, model-token mask and finish reason."""

    input_tokens: int | None
    mask: list[int]
    finish_reason: str | None


class RolloutTraceCallback(TrainerCallback):
    """Records each step's ``GRPOTrainer`` completions, rewards per reward function and advantages.

    * ``trainer``: the ``GRPOTrainer`` (TRL callbacks receive no trainer, so it is given here,
      as for TRL's own ``LogCompletionsCallback``); it can also be set later as ``.trainer``;
    * ``model``: model name for the ``chat {model}`` spans (default: the model's
      ``name_or_path``);
    * ``end_steps``: close each step for the tail sampler once its completions are recorded.

    Only the main process records (TRL gathers every process's completions there). Nothing raised
    inside the callback reaches the training loop.
    """

    def __init__(self, trainer: object = None, *, model: str | None = None,
                 end_steps: bool = True) -> None:
        check_release(FRAMEWORK, "trl", TESTED)
        self._trainer: object = None
        self.model = model
        self.end_steps = end_steps
        self.recorded = 0  # episodes recorded so far
        self._last: object = _ABSENT  # the newest buffer entry already recorded (identity marker)
        self._version: int | None = None
        self._batches = 0
        self._pending: list[_Batch] = []  # batches snapshotted by the hooks, not recorded yet
        self._generated: _Tokens | None = None  # what the latest ``_generate`` returned
        self._to_match: _Batch | None = None  # batch whose slices are read after shuffling
        self.hooked = False
        self.trainer = trainer

    @property
    def trainer(self) -> object:
        return self._trainer

    @trainer.setter
    def trainer(self, value: object) -> None:
        self._trainer = value
        self.hooked = False
        try:
            self._install(value)
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            report(f"trl RolloutTraceCallback: {exception_text(exc)}", exc=exc, may_raise=False)

    # --- Trainer events -------------------------------------------------------------------------
    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        self._version = int(state.global_step)  # the weights this step's generation uses

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        self._flush_pending(args, state, "train")
        self._collect(args, state, "train", policy_version=self._version,
                      trained_version=self._version)
        if self.end_steps and state.is_world_process_zero:
            end_step(int(state.global_step), split="train")

    @guarded
    def on_prediction_step(self, args, state, control, **kwargs):
        self._flush_pending(args, state, "eval")
        self._collect(args, state, "eval", policy_version=int(state.global_step),
                      trained_version=None)

    @guarded
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._flush_pending(args, state, "eval")
        if self.end_steps and state.is_world_process_zero:
            end_step(int(state.global_step), split="eval")

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self._flush_pending(args, state, None)

    # --- hooks on the trainer's own methods ---------------------------------------------------------
    def _install(self, trainer: object) -> None:
        """Wrap ``_generate``, ``_generate_and_score_completions`` and ``_prepare_inputs`` on
        this trainer instance (not its class); results pass through unchanged."""
        if trainer is None:
            return
        names = ("_generate", "_generate_and_score_completions", "_prepare_inputs")
        methods = [m for m in (getattr(trainer, name, None) for name in names) if callable(m)]
        if len(methods) != len(names) or not isinstance(getattr(trainer, "_logs", None), Mapping):
            return
        hooks = ((None, self._after_generate), (self._before_score, self._after_score),
                 (None, self._after_prepare))
        for name, method, (before, after) in zip(names, methods, hooks, strict=True):
            if getattr(method, _WRAPPED, None) is not None:
                method = getattr(method, _WRAPPED)  # wrapped by an earlier callback: replace it
            setattr(trainer, name, _wrap(method, before, after))
        self.hooked = True

    def _main(self) -> bool:
        state = getattr(self._trainer, "state", None)
        return bool(getattr(state, "is_world_process_zero", True))

    def _after_generate(self, result: object, _: object) -> None:
        """Keep TRL's own token lists of the batch just generated (this process's samples)."""
        trainer = self._trainer
        if not self._main():
            return
        if not isinstance(result, tuple) or len(result) < 3:
            warn_unknown(FRAMEWORK, "_generate", f"expected a tuple (prompt_ids, completion_ids, tool_mask, ...), "
                                                 f"got {type(result).__name__}: no token counts")
            self._generated = None
            return
        prompt_ids, completion_ids, tool_mask = (to_list(v) for v in result[:3])
        state = getattr(trainer, "state", None)
        self._generated = {
            "prompt_ids": prompt_ids, "completion_ids": completion_ids, "tool_mask": tool_mask,
            "version": _int(getattr(state, "global_step", None)),
            "micro": _int(getattr(trainer, "_step", None)),
        }

    def _fresh(self, logs: object) -> tuple[dict[str, list[object]], int] | None:
        """TRL's log columns and how many rows are new since the last batch (None: nothing new)."""
        if not isinstance(logs, Mapping):
            return None
        columns = _columns(logs)
        new = self._new_count(columns)
        return (columns, new) if new > 0 else None

    def _before_score(self) -> None:
        self._generated = None

    def _after_score(self, output: object, _: object) -> None:
        """Snapshot the batch TRL just appended to ``_logs`` with its tokens and versions."""
        trainer = self._trainer
        if not self._main():
            return
        logs = getattr(trainer, "_logs", None)
        fresh = self._fresh(logs)
        if fresh is None:
            return
        columns, new = fresh
        model = getattr(trainer, "model", None)
        split = "train" if getattr(model, "training", True) else "eval"
        generated: _Tokens = self._generated or {}
        self._generated = None
        version = generated.get("version")
        if version is None:
            version = _int(getattr(getattr(trainer, "state", None), "global_step", None))
        batch = _slice_batch(columns, new)
        generated.update(_logprobs(output))
        batch.update({"split": split, "version": version, "tokens": generated, "slices": None,
                      "trained": _slice_versions(trainer, split, version, generated.get("micro"))})
        expected = _expected_size(trainer, generated)
        batch["offset"] = 0
        maxlen = getattr((logs or {}).get("advantages"), "maxlen", None)
        if expected is not None and expected > new and new == maxlen:
            batch["offset"] = expected - new  # the buffer (sized for training) dropped the first ones
            warn_unknown(FRAMEWORK, "_logs", f"buffer holds {new} of a batch of {expected}: the first "
                                             f"{expected - new} samples are not recorded")
        if split == "train" and len(set(batch["trained"] or ())) > 1:
            # the slices are trained after different numbers of updates: find each sample's slice
            batch["rows"] = _row_keys(output)
            self._to_match = batch
        self._pending.append(batch)

    def _after_prepare(self, result: object, _: object) -> None:
        batch, self._to_match = self._to_match, None
        if batch is None or batch.get("rows") is None:
            return
        buffered = getattr(self._trainer, "_buffered_inputs", None)
        if not isinstance(buffered, Sequence):
            return
        where: dict[_RowKey, list[int]] = {}
        for k, part in enumerate(buffered):
            for key in _row_keys(part) or []:
                where.setdefault(key, []).append(k)
        slices: list[int | None] = []
        for key in batch.pop("rows") or []:  # not None (above)
            ks = where.get(key)
            slices.append(ks.pop(0) if ks else None)
        batch["slices"] = slices

    # --- recording ------------------------------------------------------------------------------------
    def _flush_pending(self, args: object, state: _State, split: str | None) -> None:
        if not self._pending:
            return
        keep: list[_Batch] = []
        todo: list[_Batch] = []
        for batch in self._pending:
            (todo if split is None or batch["split"] == split else keep).append(batch)
        self._pending = keep
        for batch in todo:
            try:
                self._record(batch, args, step=int(state.global_step))
            except InvalidValue:
                raise
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
                report(f"trl RolloutTraceCallback: {exception_text(exc)}", exc=exc)

    def _collect(self, args: object, state: _State, split: str, *, policy_version: int | None,
                 trained_version: int | None) -> None:
        """Whatever reached ``_logs`` without passing the hooks (another trainer class)."""
        try:
            if not state.is_world_process_zero or self._trainer is None:
                return
            fresh = self._fresh(getattr(self._trainer, "_logs", None) or getattr(self._trainer, "_textual_logs", None))
            if fresh is None:
                return
            columns, new = fresh
            batch = _slice_batch(columns, new)
            batch.update({"split": split, "version": policy_version, "tokens": {}, "slices": None, "offset": 0,
                          "trained": None if trained_version is None else [trained_version]})
            self._record(batch, args, step=int(state.global_step))
        except InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            report(f"trl RolloutTraceCallback: {exception_text(exc)}", exc=exc)

    def _new_count(self, columns: dict[str, list[object]]) -> int:
        """How many of the newest entries were not recorded yet.

        The buffers are bounded deques refilled with each generation batch; the last entry
        recorded is remembered by identity (the advantages are fresh float objects per batch), so
        the entries after it are the new ones, and a batch reused over several steps
        (``num_iterations`` > 1) is recorded once.
        """
        marker_column = _marker(columns)
        if not marker_column:
            return 0
        start = 0
        if self._last is not _ABSENT:
            for j in range(len(marker_column) - 1, -1, -1):
                if marker_column[j] is self._last:
                    start = j + 1
                    break
        self._last = marker_column[-1]
        return len(marker_column) - start

    def _record(self, batch: _Batch, args: object, *, step: int) -> None:
        split = batch["split"]
        n, offset = batch["n"], batch["offset"]
        index = self._batches
        self._batches += 1
        trainer = self._trainer
        names = _reward_names(trainer, batch["columns"])
        weights = _reward_weights(trainer, len(names))
        model = self.model or _model_name(trainer)
        describe_framework(FRAMEWORK, "trl", algorithm=_algorithm(trainer), model_name=model)
        tokenizer = _tokenizer(trainer)
        finish = _Finish(trainer)
        group_size = _group_size(args, trainer, split)
        groups, _ = group_ids(offset + n, per_group=group_size, complete=True,
                              prefix=f"{split}:{step}:{index}:")
        tokens: _Tokens = batch["tokens"] or {}
        trained = batch["trained"]
        slices = batch["slices"]
        def read(i: int) -> Sample:
            g = offset + i  # index in the gathered batch (the main process's samples come first)
            values = {name: column[i] for name, column in batch["columns"].items()}
            if trained is None:
                trained_version = None
            elif len(set(trained)) == 1:
                trained_version = trained[0]
            elif slices is not None and g < len(slices) and (part := slices[g]) is not None:
                trained_version = trained[part]
            else:
                trained_version = None
            return _sample(
                values, batch["missing"], names, weights, model=model, tokenizer=tokenizer,
                version=batch["version"], trained_version=trained_version,
                episode_id=f"{split}:{step}:{index}:{i}", group_id=groups[g],
                sample_index=g % group_size if groups[g] and group_size else i,
                usage=_usage(tokens, g, finish), logprobs=_row_logprobs(tokens, g))

        samples = read_samples(range(n), read, FRAMEWORK)
        self.recorded += record_samples(samples, step=step, split=split, framework=FRAMEWORK,
                                        tokenizer=tokenizer)


def _sample(values: dict[str, object], missing: list[str], names: list[str], weights: list[float], *,
            model: str | None, tokenizer: object, version: int | None, trained_version: int | None,
            episode_id: str, group_id: str | None, sample_index: int,
            usage: _Usage | None, logprobs: _RowLogprobs | None = None) -> Sample:
    """One sample: its reward terms and status now, its prompt and turns only if it may be kept."""
    metadata = {key[len("extra."):]: v for key, v in values.items()
                if key.startswith("extra.") and v is not None}
    reason = usage.get("finish_reason") if usage else None
    components: dict[str, float] = {}
    problems: list[str] = []
    total, weighted = 0.0, False
    for k, name in enumerate(names):
        raw = values.get("rewards." + name)
        if raw is None or (isinstance(raw, float) and math.isnan(raw)):
            continue  # the function returned None: TRL leaves this sample unscored by it
        number, problem = as_float(raw, f"sample {episode_id}: rewards[{name!r}]")
        if problem:
            problems.append(problem)
        if number is not None:
            components[name] = number
            total += weights[k] * number
            weighted = True
    advantage, problem = as_float(values.get("advantages"), f"sample {episode_id}: advantage")
    if problem:
        problems.append(problem)

    def content(ep: Episode) -> None:
        set_policy(ep, version, trained_version)
        ep.prompt(_prompt_messages(values.get("prompt"), tokenizer))
        turns = _turns(values.get("completion"), tokenizer)
        per_turn = _turn_usage(usage, len(turns))
        for k, (assistant, feedback) in enumerate(turns):
            last = k == len(turns) - 1
            with ep.turn() as turn:
                errors = record_assistant(turn, assistant, feedback, model=model,
                                          finish_reason=reason if last else None,
                                          input_tokens=per_turn[k][0], output_tokens=per_turn[k][1])
                if errors:
                    set_span_attribute(turn, c.RL_TOOL_PARSE_ERROR, errors)
        ep.set_attribute(c.RL_TURN_COUNT, len(turns))

    return Sample(
        content, episode_id=episode_id, group_id=group_id, sample_index=sample_index,
        metadata=metadata, reward=total if weighted else None, components=components or None,
        advantage=advantage, finish_reason=reason, status=status_for(reason),
        missing=missing, problems=problems, **(logprobs or {}),
        generation_bounds=_generation_bounds(usage) if logprobs else None,
    )


def _generation_bounds(usage: _Usage | None) -> list[tuple[int, int]] | None:
    """[start, end) of each generation in the completion's tokens: the runs of model tokens
    (``tool_mask`` = 1; tool results between them), one per assistant message, as
    ``_turn_usage`` pairs them. Each turn's generation then gets the mismatch statistics of its
    own tokens; when the runs do not match several turns, the root alone gets them (one turn:
    the whole completion's)."""
    if not usage:
        return None
    return [(start, end) for start, end, value in mask_runs(usage["mask"]) if value == 1] or None


# --- hooks ------------------------------------------------------------------------------------------
def _wrap(method: Callable[_P, _R], before: Callable[[], object] | None,
          after: Callable[[_R, object], None]) -> Callable[_P, _R]:
    """``method`` with ``before()`` / ``after(result, token)`` around it: their failures are
    reported, never raised; the method's own result and exceptions pass through untouched."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        token = None
        if before is not None:
            try:
                token = before()
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
                report(f"trl RolloutTraceCallback: {exception_text(exc)}", exc=exc, may_raise=False)
        result = method(*args, **kwargs)
        try:
            after(result, token)
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            report(f"trl RolloutTraceCallback: {exception_text(exc)}", exc=exc, may_raise=False)
        return result

    setattr(wrapper, _WRAPPED, method)
    return wrapper


def _int(value: Any) -> int | None:  # whatever int() converts
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _slice_versions(trainer: object, split: str, version: int | None, micro: int | None) -> list[int] | None:
    """Updates of the weights that first train each slice of a generation batch (train only)."""
    if split != "train" or version is None:
        return None
    args = getattr(trainer, "args", None)
    ga = _int(getattr(trainer, "current_gradient_accumulation_steps", None)) \
        or _int(getattr(args, "gradient_accumulation_steps", None)) or 1
    spg = _int(getattr(args, "steps_per_generation", None)) or ga
    m0 = micro if micro is not None else 0
    return [version + (m0 + k) // ga - m0 // ga for k in range(max(1, spg))]


def _expected_size(trainer: object, generated: _Tokens) -> int | None:
    """Size of the gathered batch: this process's samples × number of processes."""
    ids = generated.get("completion_ids")
    if not isinstance(ids, list):
        return None
    processes = _int(getattr(getattr(trainer, "accelerator", None), "num_processes", None)) or 1
    return len(ids) * processes


def _row_keys(part: object) -> list[_RowKey] | None:
    """One hashable key per row of a batch dict (its padded prompt and completion ids)."""
    if not isinstance(part, Mapping):
        return None
    prompts, completions = to_list(part.get("prompt_ids")), to_list(part.get("completion_ids"))
    if prompts is None or completions is None or len(prompts) != len(completions):
        return None
    return [(tuple(p), tuple(q)) for p, q in zip(prompts, completions, strict=True)]


class _Finish:
    """TRL's rule for a clipped completion (``is_truncated``): its last id is neither an EOS id
    nor the pad id."""

    def __init__(self, trainer: object) -> None:
        ids = getattr(trainer, "eos_token_ids", None)
        tokenizer = getattr(trainer, "_tokenizer", None) or _tokenizer(trainer)
        if ids is None:
            ids = getattr(tokenizer, "eos_token_id", None)
        ids = (to_list(ids) or []) if ids is not None else []
        pad = getattr(tokenizer, "pad_token_id", None)
        self.stop_ids = {int(i) for i in ids if isinstance(i, int)} | ({pad} if isinstance(pad, int) else set())

    def reason(self, completion_ids: Sequence[int]) -> str | None:
        if not self.stop_ids or not completion_ids:
            return None
        return c.FINISH_STOP if completion_ids[-1] in self.stop_ids else c.FINISH_LENGTH


def _usage(tokens: _Tokens, g: int, finish: _Finish) -> _Usage | None:
    """Token counts and finish reason of gathered sample ``g`` (this process's samples only)."""
    completions = tokens.get("completion_ids")
    if not isinstance(completions, list) or g >= len(completions):
        return None
    ids = completions[g]
    prompts = tokens.get("prompt_ids")
    masks = tokens.get("tool_mask")
    mask = masks[g] if isinstance(masks, list) and g < len(masks) else None
    if not isinstance(mask, list) or len(mask) != len(ids):
        mask = [1] * len(ids)
    prompt = prompts[g] if isinstance(prompts, list) and g < len(prompts) else None
    return {"input_tokens": len(prompt) if isinstance(prompt, list) else None,
            "mask": mask, "finish_reason": finish.reason(ids)}


# TRL's output key -> the Sample field it feeds
_LOGPROB_FIELDS: tuple[tuple[str, _LogprobName], ...] = (
    ("sampling_per_token_logps", "logprobs"), ("old_per_token_logps", "trainer_logprobs"),
    ("completion_ids", "response_ids"))
_ROW_FIELDS: tuple[_LogprobName, ...] = ("logprobs", "trainer_logprobs", "logprob_mask", "response_ids")


def _logprobs(output: object) -> _Tokens:
    """The per-token logprobs of this process's samples from what
    ``_generate_and_score_completions`` returned, [B, completion length] each, moved to the host
    once per batch and kept as arrays (a row is a view: a dropped sample's values never become
    Python numbers): the engine's, the trainer's, the completion ids, and TRL's loss mask
    (``completion_mask`` × ``tool_mask``). Empty when neither logprob is there."""
    if not isinstance(output, Mapping):
        return {}
    if output.get("sampling_per_token_logps") is None and output.get("old_per_token_logps") is None:
        return {}
    out: _Tokens = {}
    for key, name in _LOGPROB_FIELDS:
        value = output.get(key)
        if value is not None:
            out[name] = _rows(value)
    mask = output.get("completion_mask")
    tool_mask = output.get("tool_mask")
    if mask is not None and tool_mask is not None and getattr(mask, "shape", None) == getattr(tool_mask, "shape", 0):
        mask = mask * tool_mask
    if mask is not None:
        out["logprob_mask"] = _rows(mask)
    return out


def _rows(value: object) -> object:
    """A [B, L] tensor on the host (one move per batch), or a list of rows as TRL gave them."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 2:
        return to_cpu(value)
    return to_list(value)


def _row_logprobs(tokens: _Tokens, g: int) -> _RowLogprobs:
    """Gathered sample ``g``'s row of each logprob column (this process's samples only: another
    process's logprobs never reach the main process)."""
    if "logprobs" not in tokens and "trainer_logprobs" not in tokens:
        return {}
    out: _RowLogprobs = {}
    for name in _ROW_FIELDS:
        rows: Any = tokens.get(name)  # a list of rows, or a host tensor / array (indexed by row)
        if isinstance(rows, list) and g < len(rows) and isinstance(rows[g], list):
            out[name] = rows[g]
        elif rows is not None and getattr(rows, "shape", None) is not None and g < rows.shape[0]:
            out[name] = rows[g]  # a view of the host tensor's row
    return out


def _turn_usage(usage: _Usage | None, turns: int) -> list[tuple[int | None, int | None]]:
    """(input, output) tokens of each turn: the runs of model tokens (``tool_mask`` = 1), one per
    turn; when they do not match the turns, the totals go on the last turn."""
    out: list[tuple[int | None, int | None]] = [(None, None)] * turns
    if not usage or turns == 0:
        return out
    prompt = usage.get("input_tokens")
    mask = usage["mask"]
    runs = [(start, end) for start, end, value in mask_runs(mask) if value == 1]
    if len(runs) == turns:
        return [(None if prompt is None else prompt + start, end - start) for start, end in runs]
    if runs or turns > 1:
        warn_unknown(FRAMEWORK, "tool_mask", f"{len(runs)} runs of model tokens for {turns} assistant turns: "
                                             "token counts recorded as totals on the last turn")
    out[-1] = (prompt, sum(1 for m in mask if m))
    return out


# --- text -------------------------------------------------------------------------------------------
def _tokenizer(trainer: object) -> object:
    tokenizer = getattr(trainer, "_tokenizer", None)
    if tokenizer is None:
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", None) or tokenizer
    return tokenizer if callable(getattr(tokenizer, "convert_ids_to_tokens", None)) else None


def _prompt_messages(prompt: object, tokenizer: object) -> Sequence[Mapping[str, object]]:
    """A conversational prompt as its messages; a text prompt (possibly rendered with the chat
    template by the user) split into its messages."""
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return messages_of(prompt, tokenizer)
    if isinstance(prompt, Mapping):
        prompt = [prompt]
    if isinstance(prompt, Sequence):
        out: list[dict[str, object]] = []
        for m in prompt:
            if isinstance(m, Mapping):
                out.append(dict(m))
            else:
                out.append({"role": "user", "content": "" if m is None else str(m)})
        return out
    warn_unknown(FRAMEWORK, "prompt", f"expected text or messages, got {type(prompt).__name__}")
    return [{"role": "user", "content": str(prompt)}]


def _assistant(message: Mapping[str, object], tokenizer: object, turn: int) -> dict[str, object]:
    """An assistant message as a person reads it: markup removed; tool calls TRL parsed kept
    (given ids, which TRL's tool calls lack: ``call_<turn>_<n>``), Hermes ``<tool_call>`` text
    (no response schema) turned into ``tool_calls``."""
    content = message.get("content")
    if message.get("tool_calls") or not isinstance(content, str):
        out = dict(message)
        if isinstance(content, str):
            out["content"] = clean(content, tokenizer)
        calls = out.get("tool_calls")
        if isinstance(calls, Sequence) and not isinstance(calls, str):
            out["tool_calls"] = [
                {**call, "id": f"call_{turn}_{n}"} if isinstance(call, Mapping) and not call.get("id") else call
                for n, call in enumerate(calls)]
        return out
    parsed, errors = assistant_message(content, tokenizer, call_id_prefix=f"call_{turn}_")
    out = {**{k: v for k, v in message.items() if k != "content"}, **parsed}
    if errors:
        out["unparsed_tool_calls"] = errors
    return out


def _turns(completion: object, tokenizer: object) -> list[tuple[dict[str, object], list[dict[str, object]]]]:
    """(assistant message, what followed it) per turn of a completion (text or messages)."""
    if completion is None:
        completion = ""
    if isinstance(completion, str):
        return [(_assistant({"role": "assistant", "content": completion}, tokenizer, 0), [])]
    if isinstance(completion, Mapping):
        completion = [completion]
    if not isinstance(completion, Sequence):
        warn_unknown(FRAMEWORK, "completion", f"expected text or messages, got {type(completion).__name__}")
        return [(_assistant({"role": "assistant", "content": str(completion)}, tokenizer, 0), [])]
    turns: list[tuple[dict[str, object], list[dict[str, object]]]] = []
    for m in completion:
        if not isinstance(m, Mapping):
            m = {"role": "assistant", "content": "" if m is None else str(m)}
        role = str(m.get("role") or "")
        if role == "assistant" or not turns:
            if role != "assistant":
                warn_unknown(FRAMEWORK, "completion", f"completion starts with a {role or 'role-less'} message")
            turns.append((_assistant({**m, "role": "assistant"}, tokenizer, len(turns)), []))
        else:
            turns[-1][1].append(dict(m))
    return turns or [({"role": "assistant", "content": ""}, [])]


# --- helpers ------------------------------------------------------------------------------------
def _columns(logs: Mapping[str, Iterable[object]]) -> dict[str, list[object]]:
    """Flat snapshot (lists) of the trainer's per-sample buffers: ``prompt``, ``completion``,
    ``advantages``, ``rewards.<name>``, ``extra.<column>``."""
    out: dict[str, list[object]] = {}
    for key in ("prompt", "completion", "advantages"):
        if logs.get(key) is not None:
            out[key] = list(logs[key])
    for group in ("rewards", "extra"):
        nested = logs.get(group)
        if isinstance(nested, Mapping):
            for name, column in list(nested.items()):
                out[f"{group}.{name}"] = list(column)
    return out


def _slice_batch(columns: dict[str, list[object]], n: int) -> _Batch:
    """The newest ``n`` entries of every column. TRL extends every buffer in lockstep; one of
    another length cannot be paired with the samples safely, so it is left out of this batch and
    its samples are marked partial."""
    length = len(_marker(columns))
    ragged = {name: len(col) for name, col in columns.items() if len(col) != length}
    return {
        "n": n,
        "columns": {name: col[length - n:] for name, col in columns.items() if name not in ragged},
        "missing": [f"{name}[{size}!={length}]" for name, size in ragged.items()],
    }


def _marker(columns: Mapping[str, list[object]]) -> list[object]:
    """The buffer whose entries identify a batch: the advantages (fresh float objects)."""
    return columns.get("advantages") or columns.get("completion") or []


def _group_size(args: object, trainer: object, split: str) -> int | None:
    size = None
    if split == "eval":
        size = getattr(args, "num_generations_eval", None) or getattr(trainer, "num_generations_eval", None)
    size = size or getattr(args, "num_generations", None)
    return _int(size) or None


def _reward_names(trainer: object, columns: Mapping[str, object]) -> list[str]:
    names = getattr(trainer, "reward_func_names", None)
    if names:
        return [str(n) for n in names]
    return [key[len("rewards."):] for key in columns if key.startswith("rewards.")]


def _reward_weights(trainer: object, n: int) -> list[float]:
    weights: Any = getattr(trainer, "reward_weights", None)  # a tensor, a list; else TypeError below
    try:
        values = [float(w) for w in (weights.tolist() if hasattr(weights, "tolist") else weights)]
    except TypeError:
        values = []
    return values if len(values) == n else [1.0] * n


def _algorithm(trainer: object) -> str | None:
    """The algorithm a TRL trainer runs, from its class (``GRPOTrainer`` -> ``grpo``)."""
    name = type(trainer).__name__
    return name[: -len("Trainer")].lower() if name.endswith("Trainer") and len(name) > len("Trainer") else None


def _model_name(trainer: object) -> str | None:
    config = getattr(getattr(trainer, "model", None), "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if not name:
        return None
    return str(name).rstrip("/").rsplit("/", 1)[-1] or None
