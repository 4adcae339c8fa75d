"""torchforge: GRPO ``Episode`` records (and their sample dicts) as episodes.

    from otel_rollouts.adapters.torchforge import record_episodes

    # in continuous_rollouts(), after compute_advantages for a group
    record_episodes(episodes, step=policy_version)

One episode per ``Episode``. Input is duck-typed, ``forge`` is never imported:

* ``Episode`` objects (``apps/grpo/main.py``): ``episode_id``, ``policy_version``, ``request``
  (the chat-templated prompt string), ``response``, ``target``, ``reward``,
  ``reward_breakdown``, ``advantage``, ``completion`` (``stop_reason``, ``generator_version``,
  ``prompt_ids``, ``token_ids``, ``metadata``);
* the sample dicts ``record_episode_sample`` logs (``episode.to_dict``: ``prompt``, the
  breakdown flattened into columns, ``request_len``/``response_len``…), a list of them, the
  ``{"reduction_type": "sample", "samples": [...]}`` state, or one dict (streaming mode).

What forge's own sample logging loses or gets wrong, handled here:

* the top-k/bottom-k heaps return the same sample twice when a flush saw fewer than k+k
  samples, and ranks are concatenated: episodes are recorded once per ``episode_id`` (duplicates
  counted in ``otr.stats()``);
* the finish reason and real token counts live in ``completion`` (excluded from the sample
  dict); ``request_len``/``response_len`` are the padded maxima, kept only as metadata;
* no group id exists: the episodes of one prompt share ``request``, so the group is a digest of
  the request (and target);
* a policy version that is missing or a negative placeholder is not recorded; rewards,
  components and advantages given as text or numpy/torch scalars become floats.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._content import to_int
from otel_rollouts._guard import guarded_or, report
from otel_rollouts.adapters._common import (
    COUNT_DUPLICATE,
    as_float,
    count,
    field,
    first_occurrences,
    mark_invalid,
    status_for,
)
from otel_rollouts.adapters._messages import token_count

__all__ = ["record_episodes"]

FRAMEWORK = "torchforge"

# columns of Episode.to_dict() that are not reward-breakdown entries
_COLUMNS = frozenset({
    "episode_id", "policy_version", "prompt", "request", "response", "target", "reward",
    "advantage", "request_len", "response_len", "pad_id", "completion", "ref_logprobs",
    "reward_breakdown", "step", "generator_version",
})


@guarded_or(list)
def record_episodes(
    episodes: Any,
    *,
    step: int,
    split: str = "train",
    model: str | None = None,
) -> list[str]:
    """Record each of ``episodes`` (``Episode`` objects or sample dicts) in training step ``step``.

    Returns the episode ids recorded (each once). Never raises (unless otel_rollouts runs in
    strict mode).
    """
    samples = _as_samples(episodes)
    keys = [_episode_id(s) for s in samples]
    keep, duplicates = first_occurrences(keys)
    count(COUNT_DUPLICATE, duplicates, step=step, split=split)
    ids = []
    for i in keep:
        try:
            ids.append(_record(samples[i], i, step=step, split=split, model=model))
        except otr.InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the training loop
            report(f"torchforge adapter: sample {i}: {type(exc).__name__}: {exc}", exc=exc)
    return ids


def _as_samples(episodes: Any) -> list[Any]:
    if episodes is None:
        return []
    if isinstance(episodes, Mapping):
        if "samples" in episodes and "episode_id" not in episodes:  # SampleAccumulator state
            return list(episodes.get("samples") or [])
        return [episodes]  # per_rank_no_reduce streams one dict
    if isinstance(episodes, Iterable) and not isinstance(episodes, (str, bytes)):
        return [e for e in episodes if e is not None]
    return [episodes]


def _episode_id(sample: Any) -> str | None:
    value = field(sample, "episode_id")
    return None if value is None else str(value)


def _version(sample: Any) -> int | None:
    completion = field(sample, "completion")
    value = field(sample, "policy_version", default=field(completion, "generator_version"))
    if value is None:
        return None
    number, _ = to_int(value, "policy_version")
    return number if number is not None and number >= 0 else None


def _group_id(request: Any, target: Any) -> str | None:
    if request is None:
        return None
    digest = hashlib.blake2b(f"{request}\x1f{target}".encode(), digest_size=6).hexdigest()
    return f"prompt-{digest}"


def _breakdown(sample: Any) -> dict[str, Any]:
    """Reward per reward function: ``reward_breakdown``, or the columns ``to_dict`` flattened."""
    breakdown = field(sample, "reward_breakdown")
    if isinstance(breakdown, Mapping):
        return dict(breakdown)
    if isinstance(sample, Mapping):
        return {k: v for k, v in sample.items()
                if k not in _COLUMNS and (isinstance(v, (int, float, str)) or hasattr(v, "item"))
                and not isinstance(v, bool) and as_float(v)[0] is not None}
    return {}


def _record(sample: Any, i: int, *, step: int, split: str, model: str | None) -> str:
    episode_id = _episode_id(sample) or f"{split}:{step}:{i}"
    completion = field(sample, "completion")
    request = field(sample, "request", "prompt")
    response = field(sample, "response", default=field(completion, "text"))
    target = field(sample, "target")
    version = _version(sample)
    stop_reason = field(completion, "stop_reason", "finish_reason",
                        default=field(sample, "stop_reason"))

    metadata: dict[str, Any] = {}
    if target is not None:
        metadata["target"] = str(target)
    for name in ("request_len", "response_len"):  # padded maxima, not real lengths
        value = field(sample, name)
        if value is not None:
            metadata[f"padded_{name}"] = value
    generator_metadata = field(completion, "metadata")
    if isinstance(generator_metadata, Mapping):
        metadata.update({f"completion.{k}": v for k, v in generator_metadata.items()})

    with otr.episode(step=step, split=split, group_id=_group_id(request, target), sample_index=i,
                     policy_version=version, episode_id=episode_id, framework=FRAMEWORK,
                     metadata=metadata) as ep:
        if version is not None:
            ep.set_attribute(c.RL_STALENESS, step - version)
        ep.prompt([{"role": "user", "content": "" if request is None else str(request)}])
        with ep.turn() as turn:
            turn.record_generation(
                "" if response is None else str(response),
                model=model,
                finish_reason=stop_reason,
                input_tokens=token_count(field(completion, "prompt_ids")),
                output_tokens=token_count(field(completion, "token_ids")),
            )
        reward, problem = as_float(field(sample, "reward"), f"sample {episode_id}: reward")
        mark_invalid(ep, problem)
        advantage, problem = as_float(field(sample, "advantage"), f"sample {episode_id}: advantage")
        mark_invalid(ep, problem)
        components: dict[str, float] = {}
        for name, value in _breakdown(sample).items():
            number, problem = as_float(value, f"sample {episode_id}: reward_breakdown[{name!r}]")
            mark_invalid(ep, problem)
            if number is not None:
                components[str(name)] = number
        if reward is not None or components or advantage is not None:
            ep.reward(reward, components=components, advantage=advantage)
        ep.finish(reason=stop_reason, status=status_for(stop_reason))
    return episode_id
