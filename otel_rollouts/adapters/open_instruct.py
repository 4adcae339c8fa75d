"""Open-Instruct (allenai/open-instruct) GRPO batches as episode traces.

Call it where Open-Instruct's data-preparation actor has a scored batch (after advantages are
computed), for train and for eval batches::

    from otel_rollouts.adapters import open_instruct
    open_instruct.record_batch(batch, result, step=training_step, advantages=advantages,
                               num_samples_per_prompt=args.num_samples_per_prompt_rollout,
                               tokenizer=tokenizer)

``batch`` is Open-Instruct's ``Batch`` (``queries``, ``raw_queries``, ``decoded_responses``,
``scores``, ``datasets``, ``indices``, ``model_steps``...), ``result`` its ``GenerationResult``
(``responses``, ``finish_reasons``, ``masks``, ``request_info`` with the tool-call stats). Any
object, dataclass or dict with those names works: Open-Instruct is never imported.

What it fixes compared with the hand-written logger (DESIGN.md §7): every sample becomes an
episode (the tail sampler applies the per-step cap, not head-of-batch); ragged per-sample lists
never raise — the samples they do not cover get ``rl.alignment=partial``; ``request_info`` is
ignored, not mis-paired, once ``mask_truncated_completions`` filtered the batch but not it;
groups come from dataset indices (blocked ``i // n`` only for complete layouts); a batch
without scores is still recorded. The batch takes the columnar path (``otr.record_batch``): the
sampler chooses from the scores, statuses and groups in one call, and only the samples it may
keep get their prompt and turns recorded (and decoded).

Open-Instruct is not on PyPI (git-only, with vLLM, DeepSpeed and Ray): the structures are read
as its source defines them (``open_instruct/model_utils.py:Batch``,
``data_types.py:GenerationResult`` / ``RequestInfo`` / ``ToolCallStats``,
``environments/base.py:RolloutState``; see shared/research/seed-frameworks.md §2) and the tests
build dataclasses with exactly those fields.

Field → attribute (one episode per sample ``i``):

==============================================  ==============================================
Open-Instruct                                   recorded as
==============================================  ==============================================
``batch.scores[i]``                             ``rl.reward`` (the verifiers' final reward)
``request_info.rollout_states[i]["rewards"]``   ``rl.reward.env_step_<j>`` (per environment
                                                step rewards: the only reward components)
``advantages[i]``                               ``rl.advantage``
``batch.model_steps[i]``                        ``rl.policy.version`` (−1 placeholders ignored)
``step`` (the consuming ``training_step``)      ``rl.staleness`` = trained version − version
``batch.raw_queries[i]`` (``"role: content"``   the prompt messages (else ``queries[i]`` decoded)
lines) / ``queries[i]``
``decoded_responses[i]`` / ``responses[i]``     the turns; with ``masks`` (0 = tool output) one
+ ``masks[i]``                                  turn per model run, tool outputs as results
``request_info.tool_call_stats[i]``             ``execute_tool`` spans (name, ``success``,
                                                ``rl.tool.runtime_s``)
``result.finish_reasons[i]``                    ``rl.finish_reason``, ``rl.status``
``batch.datasets[i]`` / ``indices[i]``          ``rl.dataset.name`` / ``rl.dataset.index``,
                                                ``rl.group.id`` = the dataset index
``num_calls``, ``timeouts``, ``tool_errors``,   ``rl.metadata.*`` (not reward terms)
``tool_runtimes``, ``ground_truths``
==============================================  ==============================================

``rl.metadata.ground_truth`` (the answer) is recorded only with content capture on.
Not recorded: ``logprobs``, ``token_statistics`` (batch totals), ``active_tools``,
``rollout_states[i]`` other than its rewards. A structure not shaped as above is reported once
with ``warn_unknown`` and recorded as far as understood.

Policy version and staleness (the one definition in ``conventions``): ``model_steps[i]`` is the
learner step of the weights the vLLM engine held when it generated sample ``i`` (the number of
learner updates those weights had received), ``training_step`` the learner step that consumes the
batch (the data-preparation actor runs up to ``async_steps`` ahead); both count the same learner
updates, so ``rl.staleness = training_step − model_steps[i]`` — 0 for on-policy data. Pass
``trained_version`` when the weights that train on the batch are counted otherwise. Evaluation
samples are not trained on: no staleness unless ``trained_version`` is given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts._core.guard import guarded
from otel_rollouts.adapters._common import (
    Columns,
    Sample,
    captures_content,
    group_ids,
    items,
    lazy_text,
    read_samples,
    record_samples,
    reward_total,
    set_policy,
    set_span_attribute,
    split_name,
    status_for,
    to_list,
    turns_from_mask,
    warn_unknown,
)

__all__ = ["record_batch"]

FRAMEWORK = "open-instruct"
_REQUEST_INFO_FIELDS = (
    "num_calls",
    "timeouts",
    "tool_errors",
    "tool_outputs",
    "tool_runtimes",
    "tool_calleds",
    "tool_call_stats",
    "rollout_states",
)
_ROLE_LINE = re.compile(r"^(system|user|assistant|tool|developer): ", re.MULTILINE)


@guarded
def record_batch(
    batch: Any,
    result: Any,
    *,
    step: int,
    advantages: Any = None,
    num_samples_per_prompt: int = 1,
    tokenizer: Any = None,
    split: str = "train",
    model: str | None = None,
    trained_version: int | None = None,
) -> int:
    """Record every sample of an Open-Instruct batch as one episode; returns how many.

    * ``batch`` / ``result``: Open-Instruct's ``Batch`` and ``GenerationResult`` (duck-typed).
    * ``step``: the training step that consumes the batch (``rl.step``); each sample's
      ``model_steps`` entry is its policy version (``rl.policy.version``, staleness = step − it).
    * ``advantages``: per-sample advantages (numpy array or list), when computed.
    * ``num_samples_per_prompt``: the GRPO group size, used only when dataset indices are
      missing and the blocked layout is complete.
    * ``tokenizer``: decodes token ids when text is missing, and splits multi-turn tool
      responses by ``masks`` (decoded only for the episodes the sampler keeps).
    * ``split``: ``train`` or ``eval``.
    * ``trained_version``: learner updates the weights that train on the batch have received;
      defaults to ``step`` for training (see the module docstring), none for evaluation.
    """
    split = split_name(split)
    if trained_version is None and split == "train":
        trained_version = step
    responses = _get(result, "responses")
    decoded = _get(batch, "decoded_responses")
    queries = _get(batch, "queries")
    n = next((len(v) for v in (to_list(responses), to_list(decoded), to_list(queries)) if v is not None), 0)
    if n == 0 and batch is not None:
        warn_unknown(FRAMEWORK, "batch", f"{type(batch).__name__} / {type(result).__name__} without "
                     "responses, decoded_responses or queries: nothing to record")
    request_info = _get(result, "request_info")
    info = {name: _get(request_info, name) for name in _REQUEST_INFO_FIELDS}
    cols = Columns(
        n,
        # request_info is not filtered by mask_truncated_completions: ragged means mis-paired
        drop_if_ragged=_REQUEST_INFO_FIELDS,
        queries=queries,
        raw_queries=_get(batch, "raw_queries"),
        decoded_responses=decoded,
        responses=responses,
        masks=_get(result, "masks"),
        finish_reasons=_get(result, "finish_reasons"),
        scores=_get(batch, "scores"),
        advantages=advantages,
        datasets=_get(batch, "datasets"),
        indices=_get(batch, "indices"),
        model_steps=_get(batch, "model_steps"),
        ground_truths=_get(batch, "ground_truths"),
        **info,
    )
    complete = not cols.ragged and n > 0
    groups, _ = group_ids(
        n, ids=cols.columns.get("indices"), per_group=num_samples_per_prompt, complete=complete
    )
    samples = read_samples(range(n), lambda i: _sample(
        cols, i, step=step, split=split, group=groups[i], tokenizer=tokenizer, model=model,
        n_per_group=num_samples_per_prompt if complete else 0, trained_version=trained_version), FRAMEWORK)
    return record_samples(samples, step=step, split=split, framework=FRAMEWORK)


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _sample(cols: Columns, i: int, *, step: int, split: str, group: str | None, tokenizer: Any,
            model: str | None, n_per_group: int, trained_version: int | None) -> Sample:
    """Sample ``i``: what the sampler reads now, its prompt and turns only if it may be kept."""
    v = cols.value
    model_step = _model_step(v("model_steps", i))
    metadata: dict[str, Any] = {}
    for name in ("num_calls", "timeouts", "tool_errors", "tool_runtimes"):
        value = v(name, i)
        if value not in (None, "", [], 0, False):
            metadata[name] = value
    truth = v("ground_truths", i)
    if group is not None and n_per_group and n_per_group > 0:
        metadata["repetition"] = i % n_per_group
    finish = v("finish_reasons", i)
    total, _, problem = reward_total(v("scores", i), f"scores[{i}]")

    def content(ep: Any) -> None:
        set_policy(ep, model_step, trained_version)
        if isinstance(truth, (str, int, float)) and captures_content(ep):
            # the dataset's answer is content, as the prompt is: an ``rl.metadata.*`` label
            # would keep it with capture off, so it is recorded only when content is captured
            ep.set_attribute(f"{c.RL_METADATA_PREFIX}ground_truth", truth)
        ep.prompt(_prompt(cols, i, tokenizer))
        _turns(ep, cols, i, tokenizer, model, finish)

    return Sample(
        content, episode_id=f"{split}-{step}-{i}", group_id=group, sample_index=i,
        dataset_name=v("datasets", i), dataset_index=v("indices", i), metadata=metadata or None,
        reward=total, components=_env_rewards(v("rollout_states", i)) or None,
        advantage=v("advantages", i), finish_reason=finish, status=status_for(finish),
        missing=cols.missing(i), problems=[problem] if problem else (),
    )


def _model_step(value: Any) -> int | None:
    """``model_steps[i]`` as a policy version: −1 placeholders are none, non-numbers reported."""
    if value is None:
        return None
    if hasattr(value, "item") and not isinstance(value, (list, tuple)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        warn_unknown(FRAMEWORK, "model_steps", f"{type(value).__name__} {value!r}, not a learner step")
        return None
    return int(value) if value >= 0 else None  # -1: a placeholder, not a policy version


def _prompt(cols: Columns, i: int, tokenizer: Any) -> list[dict[str, Any]]:
    raw = cols.value("raw_queries", i)
    if isinstance(raw, str) and raw:
        return _unflatten(raw)
    query = cols.value("queries", i)
    if query is not None and tokenizer is not None:
        return [{"role": "user", "content": lazy_text(tokenizer, to_list(query) or [])}]
    if isinstance(query, str):
        return [{"role": "user", "content": query}]
    return [{"role": "user", "content": ""}]


def _unflatten(text: str) -> list[dict[str, Any]]:
    """Open-Instruct's ``raw_queries`` join messages as ``"{role}: {content}"`` lines."""
    marks = list(_ROLE_LINE.finditer(text))
    if not marks or marks[0].start() != 0:
        warn_unknown(FRAMEWORK, "raw_queries", "not the \"role: content\" lines Open-Instruct writes; "
                     "recorded as one user message")
        return [{"role": "user", "content": text}]
    out = []
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        out.append({"role": m.group(1), "content": text[m.end():end].rstrip("\n")})
    return out


def _turns(ep: Any, cols: Columns, i: int, tokenizer: Any, model: str | None, finish: Any) -> None:
    v = cols.value
    stats = []
    for s in to_list(v("tool_call_stats", i)) or []:
        stat = items(s)
        if not (stat.get("tool_name") or stat.get("name")):
            warn_unknown(FRAMEWORK, "tool_call_stats", f"{type(s).__name__} without tool_name; "
                         "recorded as a call of an unnamed tool")
        stats.append(stat)
    response = to_list(v("responses", i))
    mask = to_list(v("masks", i))
    if mask is not None and response is not None and len(mask) != len(response):
        warn_unknown(FRAMEWORK, "masks", f"{len(mask)} mask values for {len(response)} response tokens; "
                     "the response is recorded as one turn")
    if tokenizer is not None and response and mask and len(mask) == len(response) and 0 in mask:
        def tool(turn: Any, k: int, output: Any) -> None:
            # the k-th tool output inserted into the response answers the k-th recorded call
            if k < len(stats):
                _tool(turn, stats[k], k, output)
            else:
                turn.feedback(output, role="tool")

        turns_from_mask(ep, response, mask, tokenizer, model=model, finish_reason=finish,
                        on_observation=tool)
        return
    text = v("decoded_responses", i)
    if text is None and response is not None and tokenizer is not None:
        text = lazy_text(tokenizer, response)
    with ep.turn() as turn:
        turn.record_generation(
            {"role": "assistant", "content": "" if text is None else text},
            model=model,
            finish_reason=finish,
            output_tokens=len(response) if response is not None else None,
        )
        outputs = v("tool_outputs", i)
        for k, stat in enumerate(stats):
            # per-call outputs are not kept (they are concatenated); one call owns them all
            result = outputs if len(stats) == 1 else None
            _tool(turn, stat, k, result)
        if len(stats) != 1 and outputs:
            turn.feedback(outputs, role="tool")


def _tool(turn: Any, stat: dict[str, Any], k: int, result: Any) -> None:
    name = stat.get("tool_name") or stat.get("name") or "tool"
    call = turn.tool_call(str(name), call_id=f"call_{k}")
    set_span_attribute(call, c.RL_TOOL_RUNTIME, _float_or_none(stat.get("runtime")))
    if stat.get("success") is False:
        call.error(f"{name} failed")
    else:
        call.result("" if result is None else result)


def _float_or_none(value: Any) -> float | None:
    total, _, problem = reward_total(value)
    return None if problem else total


def _env_rewards(state: Any) -> dict[str, Any]:
    """Per-environment-step rewards of a tool rollout (``RolloutState.rewards``) as components."""
    if state is None:
        return {}
    raw = _get(state, "rewards")
    if raw is not None and (isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__len__")):
        warn_unknown(FRAMEWORK, "rollout_states.rewards", f"{type(raw).__name__}, not a list of per-step "
                     "rewards; not recorded")
        return {}
    rewards = to_list(raw)
    if not rewards:
        return {}
    return {f"env_step_{j}": r for j, r in enumerate(rewards)}
