"""TRL: a ``TrainerCallback`` that records every ``GRPOTrainer`` completion as an episode.

    from otel_rollouts.adapters.trl import RolloutTraceCallback

    trainer = GRPOTrainer(model=..., reward_funcs=[accuracy, fmt], args=..., train_dataset=...)
    trainer.add_callback(RolloutTraceCallback(trainer))
    trainer.train()

Where the data comes from: after generating and scoring a generation batch, ``GRPOTrainer``
appends every prompt, completion, per-reward-function reward and advantage (gathered from all
processes) to its ``_logs`` buffers (``prompt``, ``completion``, ``rewards[name]``,
``advantages``, ``extra``), which its own completions table reads at logging time. Those
buffers only hold the latest generation batch and that table only appears every
``logging_steps``; this callback reads them at the end of every optimizer step (and after every
evaluation batch), so no step's completions are skipped, then closes the step for the tail
sampler (``otr.end_step``).

Each completion becomes one episode: the prompt (text or messages), the completion as turns
(a conversational completion with tool calls gives ``execute_tool`` spans with the tool
results), ``rl.reward`` = the weighted sum of the reward functions TRL optimises,
``rl.reward.<function name>`` per reward function, ``rl.advantage``, the GRPO group
(``num_generations`` consecutive completions of one prompt), and ``rl.policy.version`` = the
optimizer step whose weights generated it. The prompt is always recorded (a review of TRL's own
trace logging found completions logged without it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._guard import guarded, report
from otel_rollouts.adapters._common import as_float, group_ids, mark_invalid, mark_partial
from otel_rollouts.adapters._messages import conversation, record_completion

__all__ = ["RolloutTraceCallback"]

FRAMEWORK = "trl"
_ABSENT = object()


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

    def __init__(self, trainer: Any = None, *, model: str | None = None,
                 end_steps: bool = True) -> None:
        self.trainer = trainer
        self.model = model
        self.end_steps = end_steps
        self.recorded = 0  # episodes recorded so far
        self._last: Any = _ABSENT  # the newest buffer entry already recorded (identity marker)
        self._version: int | None = None
        self._batches = 0

    # --- Trainer events -------------------------------------------------------------------------
    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        self._version = int(state.global_step)  # the weights this step's generation uses

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        self._collect(args, state, "train", policy_version=self._version)
        if self.end_steps and state.is_world_process_zero:
            otr.end_step(int(state.global_step), split="train")

    @guarded
    def on_prediction_step(self, args, state, control, **kwargs):
        self._collect(args, state, "eval", policy_version=int(state.global_step))

    @guarded
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.end_steps and state.is_world_process_zero:
            otr.end_step(int(state.global_step), split="eval")

    # --- reading the trainer's buffers -------------------------------------------------------------
    def _collect(self, args: Any, state: Any, split: str, *, policy_version: int | None) -> None:
        try:
            if not state.is_world_process_zero or self.trainer is None:
                return
            logs = getattr(self.trainer, "_logs", None) or getattr(self.trainer, "_textual_logs", None)
            if not isinstance(logs, Mapping):
                return
            columns = _columns(logs)
            new = self._new_count(columns)
            if new <= 0:
                return
            group_size = _group_size(args, split)
            self._record(columns, new, step=int(state.global_step), split=split,
                         policy_version=policy_version, group_size=group_size)
        except otr.InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            report(f"trl RolloutTraceCallback: {type(exc).__name__}: {exc}", exc=exc)

    def _new_count(self, columns: dict[str, list[Any]]) -> int:
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

    def _record(self, columns: dict[str, list[Any]], n: int, *, step: int, split: str,
                policy_version: int | None, group_size: int | None) -> None:
        batch = self._batches
        self._batches += 1
        names = _reward_names(self.trainer, columns)
        weights = _reward_weights(self.trainer, len(names))
        model = self.model or _model_name(self.trainer)
        groups, _ = group_ids(n, per_group=group_size, complete=True,
                              prefix=f"{split}:{step}:{batch}:")
        # TRL extends every buffer in lockstep; one of another length cannot be paired with the
        # samples safely, so it is left out of this batch and its samples are marked partial
        length = len(_marker(columns))
        ragged = {name: len(col) for name, col in columns.items() if len(col) != length}
        missing = [f"{name}[{size}!={length}]" for name, size in ragged.items()]
        for i in range(n):
            values = {name: column[length - n + i] for name, column in columns.items()
                      if name not in ragged}
            self._record_one(values, missing, names, weights, model=model, step=step,
                             split=split, policy_version=policy_version,
                             episode_id=f"{split}:{step}:{batch}:{i}", group_id=groups[i],
                             sample_index=i % group_size if groups[i] and group_size else i)

    def _record_one(self, values: dict[str, Any], missing: list[str], names: list[str],
                    weights: list[float], *, model: str | None, step: int, split: str,
                    policy_version: int | None, episode_id: str, group_id: str | None,
                    sample_index: int) -> None:
        metadata = {key[len("extra."):]: v for key, v in values.items()
                    if key.startswith("extra.") and v is not None}
        with otr.episode(step=step, split=split, group_id=group_id, sample_index=sample_index,
                         policy_version=policy_version, episode_id=episode_id,
                         framework=FRAMEWORK, metadata=metadata) as ep:
            if policy_version is not None:
                ep.set_attribute(c.RL_STALENESS, step - policy_version)
            mark_partial(ep, missing)
            prompt = values.get("prompt")
            ep.prompt(prompt if prompt is not None else "")
            completion = values.get("completion")
            if isinstance(completion, (list, tuple)):
                record_completion(ep, conversation(completion), model=model)
            else:
                with ep.turn() as turn:
                    turn.record_generation("" if completion is None else str(completion),
                                           model=model)
            components: dict[str, float] = {}
            total, weighted = 0.0, False
            for k, name in enumerate(names):
                raw = values.get("rewards." + name)
                if raw is None or (isinstance(raw, float) and math.isnan(raw)):
                    continue  # the function returned None: TRL leaves this sample unscored by it
                number, problem = as_float(raw, f"sample {episode_id}: rewards[{name!r}]")
                mark_invalid(ep, problem)
                if number is not None:
                    components[name] = number
                    total += weights[k] * number
                    weighted = True
            advantage, problem = as_float(values.get("advantages"),
                                          f"sample {episode_id}: advantage")
            mark_invalid(ep, problem)
            ep.reward(total if weighted else None, components=components, advantage=advantage)
            ep.finish(status=c.STATUS_OK)
        self.recorded += 1


# --- helpers ------------------------------------------------------------------------------------
def _columns(logs: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Flat snapshot (lists) of the trainer's per-sample buffers: ``prompt``, ``completion``,
    ``advantages``, ``rewards.<name>``, ``extra.<column>``."""
    out: dict[str, list[Any]] = {}
    for key in ("prompt", "completion", "advantages"):
        if logs.get(key) is not None:
            out[key] = list(logs[key])
    for group in ("rewards", "extra"):
        nested = logs.get(group)
        if isinstance(nested, Mapping):
            for name, column in list(nested.items()):
                out[f"{group}.{name}"] = list(column)
    return out


def _marker(columns: Mapping[str, list[Any]]) -> list[Any]:
    """The buffer whose entries identify a batch: the advantages (fresh float objects)."""
    return columns.get("advantages") or columns.get("completion") or []


def _group_size(args: Any, split: str) -> int | None:
    size = getattr(args, "num_generations_eval", None) if split == "eval" else None
    size = size or getattr(args, "num_generations", None)
    return int(size) if size else None


def _reward_names(trainer: Any, columns: Mapping[str, Any]) -> list[str]:
    names = getattr(trainer, "reward_func_names", None)
    if names:
        return [str(n) for n in names]
    return [key[len("rewards."):] for key in columns if key.startswith("rewards.")]


def _reward_weights(trainer: Any, n: int) -> list[float]:
    weights = getattr(trainer, "reward_weights", None)
    try:
        values = [float(w) for w in (weights.tolist() if hasattr(weights, "tolist") else weights)]
    except TypeError:
        values = []
    return values if len(values) == n else [1.0] * n


def _model_name(trainer: Any) -> str | None:
    config = getattr(getattr(trainer, "model", None), "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if not name:
        return None
    return str(name).rstrip("/").rsplit("/", 1)[-1] or None
