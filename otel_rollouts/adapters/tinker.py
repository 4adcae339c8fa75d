"""Tinker cookbook: trajectory groups (``do_group_rollout`` output) as episodes.

    from otel_rollouts.adapters.tinker import record_trajectory_groups

    # rl/train.py, once a batch of groups is trained (next to _maybe_export_rollout_summary_jsonl)
    record_trajectory_groups(full_batch_wrapped_trajectory_groups, step=i_batch,
                             tokenizer=tokenizer)
    otr.end_step(i_batch)

One episode per trajectory, grouped by ``(split, step, group index)``. Input is duck-typed, the
cookbook is never imported. Groups: ``WrappedTrajectoryGroup`` (``trajectory_group``,
``env_group_builder``, ``sampling_client_step``), ``TrajectoryGroup`` (``trajectories_G``,
``final_rewards_G``, ``metrics_G``, ``rollout_errors``), ``None`` for a group the loop dropped,
or the per-trajectory records of the rollout-summary JSONL (``serialize_rollout_summaries``).

Field → attribute (cookbook 0.6.1, ``tinker_cookbook/rl/types.py``):

=========================================== ==================================================
``transitions[0].ob`` (rendered prompt)     ``prompt`` span: split back into its messages
                                            with the tokenizer's chat template, else the
                                            renderer's layout (``_tinker_text``: Inkling's
                                            ``TmlRenderersTokenizerAdapter`` has no template),
                                            decoded only if the episode is kept
``transitions[k].ac.tokens``                turn k's ``chat`` span: the assistant message
                                            parsed by the framework's ``renderer`` when given
                                            (``renderer.parse_response``), else decoded with
                                            the tokenizer, end-of-turn markup removed and
                                            Hermes/Qwen ``<tool_call>`` blocks parsed
tool calls of ``ac``                        ``execute_tool`` spans; the result is the ``tool``
                                            message (``<tool_response>`` block) that the next
                                            observation ``transitions[k+1].ob`` (or
                                            ``final_ob``) adds after the action
other messages the next observation adds    ``feedback`` spans with their real role
``ac.stop_reason``                          the ``chat`` span's finish reason
``ob.length`` / ``len(ac.tokens)``          ``gen_ai.usage.input_tokens`` / ``output_tokens``
Σ ``transitions[k].reward`` + final reward  ``rl.reward.score`` (``TrajectoryGroup.get_total_rewards``)
Σ ``transitions[k].reward``                 ``rl.reward.component.transitions``
``final_rewards_G[i]``                      ``rl.reward.component.final`` (``compute_group_rewards``)
``transitions[k].metrics[key]`` for the     ``rl.reward.component.<key>`` (``t<k>.<key>`` when several
reward-term keys (``reward_metrics=``,      steps carry it). Default: ``format``/``correct``
default ``REWARD_METRICS``)                 (``ProblemEnv``: reward = format_coef·(format−1) +
                                            correct) and ``rubric_score`` (rubric env)
every other ``metrics`` entry (``stop/*``,  ``rl.metadata.steps[k].metrics`` — diagnostics,
``parse_error``, ``max_turns``, timings…)   never ``rl.reward.component.*``
``transitions[k].logs``, ``episode_done``   ``rl.metadata.steps[k]``
``metrics_G[i]``                            ``rl.metadata.trajectory_metrics``
advantages (``advantages=``)                ``rl.advantage``
``Trajectory.stop_reason``                  ``rl.finish_reason``; ``rl.status`` ``ok``
                                            (completed, tool_stopped), ``truncated`` (max_*,
                                            context_overflow, rollout_timeout), ``error``
                                            (parse_error)
``sampling_client_step`` × ``num_substeps`` ``rl.policy.version`` (optimizer updates of the
                                            sampling weights; negative placeholders ignored)
(``step`` − ``sampling_client_step``)       ``rl.staleness`` on the ``train`` split (the
× ``num_substeps``                          cookbook's own ``async/staleness``); 0 on-policy.
                                            Eval episodes are not trained on: no staleness.
                                            With num_substeps > 1 this is the figure at the
                                            iteration's start (substep j adds j)
``ac.maybe_logprobs`` (the sampler's         the generation's engine (rollout) logprobs of
logprobs of ``ac.tokens``)                  ``ac.tokens``. The trainer's logprobs of the same
                                            tokens stay inside the cookbook's ``train_step``
                                            (``forward_backward``'s ``loss_fn_outputs``, its
                                            ``optim/kl_sample_train_*`` metrics): no
                                            ``rl.mismatch.*`` statistic is recorded
``len(transitions)``                        ``rl.turn.count``
``env_group_builder.logging_tags()``        ``rl.metadata.tags``
``rollout_errors[j]``                       an error episode (``rl.status=error``,
                                            ``rl.finish_reason`` = the error type)
``trace`` (``RolloutTrace``, PR #749, not   prompt/response/next messages taken from it;
in 0.6.1)                                   ``reward_data`` kept raw as
                                            ``rl.metadata.reward_data`` (it mixes terms with
                                            the total and coefficients such as
                                            ``format_coef``: never ``rl.reward.component.*``)
=========================================== ==================================================

Tool markers are parsed before special tokens are removed (a tokenizer may mark ``<tool_call>``
special). A tokenizer whose layout is unknown (no chat template, no renderer) is warned once,
naming what is lost; the observations after actions are still recorded, never dropped.

Decoding: the prompt is split only if the episode is kept; each action, and the text the next
observation adds after it, are decoded when recorded (their tool calls shape the span tree).

Not recorded: ``sequence_id``/``prompt_cache_hit_tokens``, images in observations
(warned once), and texts a rollout-summary record does not hold (it has lengths, not tokens).

Other things handled: steps that returned early (parse error, ``length``) still give an
episode with ``rl.status``; failed rollouts give error episodes; dropped groups (``None``) are
counted; ragged ``final_rewards_G`` / ``metrics_G`` / advantages never raise (the samples they
miss carry ``rl.alignment.kind=partial``); the cap of the tail sampler holds per (step, split).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from otel_rollouts.adapters import _tinker_kinds
from otel_rollouts.adapters._tinker_groups import (
    ADAPTER,
    FRAMEWORK,
    REWARD_METRICS,
    TESTED,
    _as_groups,
    _Reader,
    _record_group,
    _substeps,
)
from otel_rollouts.adapters._tinker_kinds import (
    PreferenceVerdicts,
    TeacherLogprobs,
)
from otel_rollouts.adapters.kit import (
    COUNT_FILTERED,
    Columns,
    InvalidValue,
    check_release,
    count,
    describe_framework,
    exception_text,
    guarded_or,
    report,
)

__all__ = [
    "PreferenceVerdicts",
    "REWARD_METRICS",
    "TeacherLogprobs",
    "record_trajectory_groups",
]


@guarded_or(list)
def record_trajectory_groups(
    trajectory_groups: Sequence[object],
    *,
    step: int,
    split: str = "train",
    tokenizer: object = None,
    taglist: Sequence[object] | None = None,
    sampling_client_steps: Sequence[object] | None = None,
    advantages: Sequence[object] | None = None,
    model: str | None = None,
    group_start: int = 0,
    renderer: object = None,
    reward_metrics: Sequence[str] = REWARD_METRICS,
    num_substeps: int = 1,
    preference_verdicts: Any = None,  # a PreferenceVerdicts, or a stand-in with its take()
    teacher: object = None,
    kl_penalty_coef: object = None,
) -> list[str]:
    """Record every trajectory of ``trajectory_groups`` as one episode of training step ``step``.

    * ``step``: the training iteration (``i_batch``) that trains on these groups;
    * ``split``: ``"train"`` or the cookbook's ``"eval/<label>"``;
    * ``tokenizer``: decodes observations and actions (prompts lazily, only for kept episodes);
    * ``renderer``: the cookbook renderer the environments use (``renderers.get_renderer(...)``):
      actions are parsed with its ``parse_response`` (thinking, tool calls in its own format);
      its ``tokenizer`` is used when ``tokenizer`` is not given;
    * ``taglist`` / ``sampling_client_steps``: per-group tags and policy versions, as given to
      ``serialize_rollout_summaries`` (a ``WrappedTrajectoryGroup`` carries its own);
    * ``advantages``: per group, the per-trajectory advantages (``compute_advantages`` output);
    * ``reward_metrics``: the transition-metric keys that are reward terms (add the keys your
      ``reward_fn`` returns);
    * ``num_substeps``: the cookbook's ``Config.num_substeps`` (optimizer updates per iteration);
    * ``group_start``: index of the first group, when one step's groups arrive in several calls;
    * ``preference_verdicts``: the ``PreferenceVerdicts`` wrapping the preference model of
      ``PairwisePreferenceGroupBuilder`` groups (their verdicts go on the reward spans);
    * ``teacher`` / ``kl_penalty_coef``: prompt-only distillation: the ``TeacherLogprobs``
      wrapping the teacher client (one, or one per group), and the coefficient.

    Preference (``PairwisePreferenceGroupBuilder``) and multiplayer (``TwoPlayerEnvGroupBuilder``)
    groups are told by their ``WrappedTrajectoryGroup``'s builder, distillation by ``teacher``:
    they are recorded as linked episodes (``_tinker_kinds``).

    Returns the episode ids recorded. Never raises (unless otel_rollouts runs in strict mode).
    """
    describe_framework(FRAMEWORK, "tinker-cookbook")
    check_release(ADAPTER, FRAMEWORK, TESTED)
    if tokenizer is None and renderer is not None:
        tokenizer = getattr(renderer, "tokenizer", None)
    try:
        reader = _Reader(tokenizer, renderer)
    except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot be read: record numbers only
        report(f"tinker adapter: tokenizer: {exception_text(exc)}", exc=exc)
        reader = _Reader(None, None)
    if isinstance(reward_metrics, str):
        reward_metrics = (reward_metrics,)
    groups = _as_groups(trajectory_groups)
    per_group = Columns(len(groups), tags=taglist, versions=sampling_client_steps,
                        advantages=advantages)
    substeps = _substeps(num_substeps)
    ids: list[str] = []
    for gi, group in enumerate(groups):
        g = group_start + gi
        if group is None:
            count(COUNT_FILTERED, step=step, split=split)
            continue
        try:
            kind = _tinker_kinds.kind_of(group, teacher=teacher)
            if kind is not None:
                ids.extend(_tinker_kinds.record_group(
                    kind, group, gi, g, per_group, step=step, split=split, reader=reader,
                    model=model, substeps=substeps, verdicts=preference_verdicts,
                    teacher=teacher, kl_penalty_coef=kl_penalty_coef))
                continue
            ids.extend(_record_group(group, gi, g, per_group, step=step, split=split,
                                     reader=reader, model=model, substeps=substeps,
                                     reward_keys=tuple(str(k) for k in reward_metrics or ())))
        except InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the training loop
            report(f"tinker adapter: group {g}: {exception_text(exc)}", exc=exc)
    return ids
