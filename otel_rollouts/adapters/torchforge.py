"""torchforge: GRPO ``Episode`` records (and their sample dicts) as episodes.

    from otel_rollouts.adapters.torchforge import record_episodes

    # in continuous_rollouts(), after compute_advantages for a group
    record_episodes(episodes, step=episodes[0].policy_version, tokenizer=tokenizer)

One episode per ``Episode``. Input is duck-typed, ``forge`` is never imported: its PyPI package
(``torchforge`` 0.0.1) holds no code, so the structures are read as the source defines them.
``Episode`` lives in the package, ``forge.rl`` (``src/forge/rl/types.py``, read at
meta-pytorch/torchforge ``cf02b132`` and ``7efbb882``); before the sample-logging change
(PR #486) it lived in the app (``apps/grpo/main.py``, read at ``6e77f0b3``, 2025-11-15) without
``request``/``response``/``reward_breakdown``: there the prompt is read from
``completion.prompt`` (a ``Prompt`` of ``Message(chunks, role)``, the chat-templated request as
one user message) or, failing that, decoded from ``completion.prompt_ids``, and the group id is
the digest of that text (the same as ``request`` gives). The tests build dataclasses with exactly
those fields:

* ``Episode`` objects: ``episode_id``, ``policy_version``, ``request`` (the chat-templated
  prompt string), ``response``, ``target``, ``reward``, ``reward_breakdown``, ``advantage``,
  ``completion`` (``stop_reason``, ``generator_version``, ``prompt_ids``, ``token_ids``,
  ``metadata``);
* the sample dicts ``record_metric(..., Reduce.SAMPLE)`` logs (``episode.to_dict``: ``prompt``, the
  breakdown flattened into columns, ``request_len``/``response_len``, ``score`` = a copy of
  ``reward`` in forge's main), a list of them, the ``{"reduction_type": "sample", "samples":
  [...]}`` state, or one dict (streaming mode).

Field → attribute:

=====================================  =========================================================
torchforge                             recorded as
=====================================  =========================================================
``reward``                             ``rl.reward.score`` (forge: the mean of its reward functions)
``reward_breakdown`` / the flattened   ``rl.reward.component.<reward function>`` — only when they are the
breakdown columns                      reward's terms (the reward is their mean or sum); other
                                       numeric columns go to ``rl.metadata.<name>`` with a warning
``score``                              nothing (forge's copy of ``reward`` for the sample table)
``advantage``                          ``rl.advantage``
``policy_version`` /                   ``rl.policy.version`` (−1 / missing: none)
``completion.generator_version``
``trained_version`` (argument)         ``rl.staleness`` = ``trained_version − rl.policy.version``
``request`` (else ``completion.prompt``,   the prompt, split into its messages by the tokenizer's
else ``completion.prompt_ids``)        chat template (one user message without a tokenizer)
``response`` / ``completion.text``     the assistant turn (template markup and EOS removed with a
                                       tokenizer; Hermes ``<tool_call>`` blocks as tool calls)
``completion.stop_reason``             ``rl.finish_reason``, ``rl.status``
``completion.prompt_ids/token_ids``    ``gen_ai.usage.input_tokens/output_tokens``
``target``, ``request_len``,           ``rl.metadata.target``, ``rl.metadata.padded_*`` (padded
``response_len``, ``completion.meta``  maxima, not real lengths), ``rl.metadata.completion.*``
=====================================  =========================================================

Not recorded: ``ref_logprobs``, ``pad_id``, ``completion.logprobs``.
``rl.metadata.target`` (the answer) only with content capture on.

Policy version and staleness (the one definition in ``conventions``): ``generator_version`` is
the version of the weights the generator held; ``continuous_training`` pushes them as
``training_step`` after each ``train_step`` (``policy.update_weights(training_step)``), so it
counts the optimizer steps those weights had received. Which training step consumes an episode
is decided later by the replay buffer (``sample(curr_policy_version=training_step)``), so no
staleness is known where forge logs samples: pass ``trained_version`` (the trainer's
``training_step`` when it trains on the episodes) to record it. ``step`` is only ``rl.step``.

What forge's own sample logging loses or gets wrong, handled here:

* the top-k/bottom-k heaps return the same sample twice when a flush saw fewer than k+k
  samples, and ranks are concatenated: episodes are recorded once per ``episode_id`` (duplicates
  counted in ``otr.stats()``);
* the finish reason and real token counts live in ``completion`` (excluded from the sample
  dict); ``request_len``/``response_len`` are the padded maxima, kept only as metadata;
* no group id exists: the episodes of one prompt share ``request``, so the group is a digest of
  the request (and target); before PR #486 of ``completion.prompt`` (or its prompt ids);
* a policy version that is missing or a negative placeholder is not recorded; rewards,
  components and advantages given as text or numpy/torch scalars become floats.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from itertools import combinations
from typing import TYPE_CHECKING, TypedDict

from otel_rollouts import conventions as c
from otel_rollouts.adapters._messages import record_assistant, token_count, token_ids
from otel_rollouts.adapters._text import assistant_message, messages_of
from otel_rollouts.adapters.kit import (
    COUNT_DUPLICATE,
    Deferred,
    Sample,
    as_float,
    captures_content,
    count,
    describe_framework,
    field,
    first_occurrences,
    guarded_or,
    read_samples,
    record_samples,
    set_policy,
    status_for,
    to_int,
    to_list,
    tokenizer_info,
    warn_unknown,
)

if TYPE_CHECKING:
    from otel_rollouts import Episode

__all__ = ["record_episodes"]

FRAMEWORK = "torchforge"

# columns of Episode.to_dict() that are not reward-breakdown entries
_COLUMNS = frozenset({
    "episode_id", "policy_version", "prompt", "request", "response", "target", "reward",
    "advantage", "request_len", "response_len", "pad_id", "completion", "ref_logprobs",
    "reward_breakdown", "step", "generator_version", "score",
})
_MAX_SUBSET = 8  # flattened columns tried as reward terms (forge apps have a handful)
_EPISODE_FIELDS = ("episode_id", "request", "prompt", "response", "completion", "reward")


@guarded_or(list)
def record_episodes(
    episodes: object,
    *,
    step: int,
    split: str = "train",
    model: str | None = None,
    trained_version: int | None = None,
    tokenizer: object = None,
) -> list[str]:
    """Record each of ``episodes`` (``Episode`` objects or sample dicts) in training step ``step``.

    The samples go to the tail sampler as columns (rewards, stop reasons, groups) in one call;
    only the ones it may keep get their request split and their turn recorded.

    * ``trained_version``: optimizer steps the weights that train on these episodes have received
      (forge's ``training_step`` when it consumes them); gives ``rl.staleness``. Without it no
      staleness is recorded (it is not known where forge logs samples).
    * ``tokenizer``: the generator's tokenizer: the chat-templated ``request`` is split into its
      messages and template markup / EOS are taken out of the text.

    Returns the episode ids recorded (each once). Never raises (unless otel_rollouts runs in
    strict mode).
    """
    describe_framework(FRAMEWORK, "torchforge")
    samples = _as_samples(episodes)
    keys = [_episode_id(s) for s in samples]
    keep, duplicates = first_occurrences(keys)
    count(COUNT_DUPLICATE, duplicates, step=step, split=split)
    read = read_samples(keep, lambda i: _sample(samples[i], i, step=step, split=split, model=model,
                                                trained_version=trained_version, tokenizer=tokenizer),
                        FRAMEWORK)
    record_samples(read, step=step, split=split, framework=FRAMEWORK)
    return [s.episode_id for s in read if s.episode_id is not None]


def _as_samples(episodes: object) -> list[object]:
    if episodes is None:
        return []
    if isinstance(episodes, Mapping):
        if "samples" in episodes and "episode_id" not in episodes:  # SampleAccumulator state
            return list(episodes.get("samples") or [])
        return [episodes]  # per_rank_no_reduce streams one dict
    if isinstance(episodes, Iterable) and not isinstance(episodes, (str, bytes)):
        return [e for e in episodes if e is not None]
    return [episodes]


def _understood(sample: object) -> bool:
    """A sample dict, or an object with at least one of ``Episode``'s fields."""
    if isinstance(sample, Mapping):
        return any(k in sample for k in (*_EPISODE_FIELDS, "score"))
    return any(field(sample, name) is not None for name in _EPISODE_FIELDS)


def _episode_id(sample: object) -> str | None:
    value = field(sample, "episode_id")
    return None if value is None else str(value)


def _version(sample: object) -> int | None:
    completion = field(sample, "completion")
    value = field(sample, "policy_version", default=field(completion, "generator_version"))
    if value is None:
        return None
    number, problem = to_int(value, "policy_version")
    if problem is not None:
        warn_unknown(FRAMEWORK, "policy_version", f"{type(value).__name__} {value!r}, not a version number")
    return number if number is not None and number >= 0 else None


def _group_id(request: object, target: object) -> str | None:
    if request is None:
        return None
    digest = hashlib.blake2b(f"{request}\x1f{target}".encode(), digest_size=6).hexdigest()
    return f"prompt-{digest}"


def _prompt_of(completion: object) -> tuple[str | None, list[dict[str, str]] | None]:
    """(the request text, or None; its messages when the ``Prompt`` holds several) from
    ``completion.prompt``: ``Prompt(messages=[Message(chunks, role)])``, which the generator
    builds from the chat-templated request (one user message) — the request a torchforge
    without ``Episode.request`` (before PR #486) still carries."""
    prompt = field(completion, "prompt")
    if prompt is None:
        return None, None
    if isinstance(prompt, str):
        return prompt, None
    messages: list[dict[str, str]] = []
    for m in to_list(field(prompt, "messages")) or []:
        chunks = field(m, "chunks")
        text = chunks if isinstance(chunks, str) else "".join(str(x) for x in to_list(chunks) or [])
        role = field(m, "role")
        role = field(role, "value", default=role)  # forge's Role enum
        messages.append({"role": str(role or "user").lower(), "content": text})
    if not messages:
        warn_unknown(FRAMEWORK, "completion.prompt", f"{type(prompt).__name__} without messages; "
                     "the prompt is read from completion.prompt_ids")
        return None, None
    if len(messages) == 1 and messages[0]["role"] in ("user", "none"):
        return messages[0]["content"], None
    return "\x1e".join(f"{m['role']}:{m['content']}" for m in messages), messages


def _breakdown(sample: object, reward: float | None) -> tuple[dict[str, object], dict[str, object]]:
    """(reward terms, other numeric columns): ``reward_breakdown``, or the columns ``to_dict``
    flattened — the largest set of them whose mean (forge's ``RewardActor``) or sum the reward
    is; columns outside it are not understood: metadata, with a warning."""
    breakdown = field(sample, "reward_breakdown")
    if isinstance(breakdown, Mapping):
        return dict(breakdown), {}
    if not isinstance(sample, Mapping):
        return {}, {}
    columns = {k: v for k, v in sample.items()
               if k not in _COLUMNS and (isinstance(v, (int, float, str)) or hasattr(v, "item"))
               and not isinstance(v, bool) and as_float(v)[0] is not None}
    if not columns or reward is None:
        return columns, {}
    numbers = {k: as_float(v)[0] or 0.0 for k, v in columns.items()}  # each a number (above)
    names = sorted(numbers)
    if len(names) <= _MAX_SUBSET:
        # the largest set of columns the reward is the mean or sum of: the reward functions
        for size in range(len(names), 0, -1):
            for subset in combinations(names, size):
                total = sum(numbers[k] for k in subset)
                if _close(total / size, reward) or _close(total, reward):
                    others = {k: columns[k] for k in names if k not in subset}
                    if others:
                        warn_unknown(FRAMEWORK, "sample columns", f"{sorted(others)} are not terms of "
                                     f"reward {reward} nor known columns; recorded as metadata")
                    return {k: columns[k] for k in subset}, others
    warn_unknown(FRAMEWORK, "sample columns", f"{names} are neither a breakdown of reward {reward} "
                 "(mean or sum) nor known columns; recorded as metadata")
    return {}, columns


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


class _Usage(TypedDict):
    input_tokens: int | None
    output_tokens: int | None


def _sample(sample: object, i: int, *, step: int, split: str, model: str | None,
            trained_version: int | None, tokenizer: object) -> Sample:
    """One forge episode: its reward, terms and status now, its text only if it may be kept."""
    if not _understood(sample):
        warn_unknown(FRAMEWORK, "episode", f"{type(sample).__name__} with none of Episode's fields; "
                     "recorded as an empty episode")
    episode_id = _episode_id(sample) or f"{split}:{step}:{i}"
    completion = field(sample, "completion")
    request = field(sample, "request", "prompt")
    prompt_messages: list[dict[str, str]] | None = None
    prompt_ids: list[int] | None = None
    if request is None:  # a torchforge before PR #486: Episode has no request
        request, prompt_messages = _prompt_of(completion)
    group_key: object = request
    if request is None:
        prompt_ids = token_ids(field(completion, "prompt_ids"))
        if prompt_ids:
            group_key = "ids:" + ",".join(str(t) for t in prompt_ids)
        elif not isinstance(sample, Mapping) or "prompt" not in sample:
            warn_unknown(FRAMEWORK, "request", "neither request nor completion.prompt nor "
                         "completion.prompt_ids: no prompt and no group id")
    response = field(sample, "response", default=field(completion, "text"))
    target = field(sample, "target")
    version = _version(sample)
    stop_reason = field(completion, "stop_reason", "finish_reason",
                        default=field(sample, "stop_reason"))
    reward, reward_problem = as_float(field(sample, "reward", "score"), f"sample {episode_id}: reward")
    terms, others = _breakdown(sample, reward)

    metadata: dict[str, object] = {}
    for name in ("request_len", "response_len"):  # padded maxima, not real lengths
        value = field(sample, name)
        if value is not None:
            metadata[f"padded_{name}"] = value
    generator_metadata = field(completion, "metadata")
    if isinstance(generator_metadata, Mapping):
        metadata.update({f"completion.{k}": v for k, v in generator_metadata.items()})
    for name, value in others.items():
        metadata[str(name)] = as_float(value)[0]
    problems = [reward_problem] if reward_problem else []
    advantage, problem = as_float(field(sample, "advantage"), f"sample {episode_id}: advantage")
    if problem:
        problems.append(problem)
    components: dict[str, float] = {}
    for name, value in terms.items():
        number, problem = as_float(value, f"sample {episode_id}: reward_breakdown[{name!r}]")
        if problem:
            problems.append(problem)
        if number is not None:
            components[str(name)] = number

    def content(ep: Episode) -> None:
        set_policy(ep, version, trained_version)
        if target is not None and captures_content(ep):
            # the answer is content, as the prompt is: an ``rl.metadata.*`` label would keep it
            # with capture off, so it is recorded only when content is captured
            ep.set_attribute(f"{c.RL_METADATA_PREFIX}target", str(target))
        ep.prompt(_prompt(request, prompt_messages, prompt_ids, tokenizer))
        with ep.turn() as turn:
            usage: _Usage = {"input_tokens": token_count(field(completion, "prompt_ids")),
                                     "output_tokens": token_count(field(completion, "token_ids"))}
            if tokenizer is not None:
                message, errors = assistant_message("" if response is None else str(response), tokenizer)
                record_assistant(turn, message, model=model, finish_reason=stop_reason, **usage)
                if errors:
                    ep.set_attribute(c.RL_TOOL_PARSE_ERROR, errors)
            else:
                turn.record_generation("" if response is None else str(response), model=model,
                                       finish_reason=stop_reason, **usage)

    return Sample(
        content, episode_id=episode_id, group_id=_group_id(group_key, target), sample_index=i,
        metadata=metadata, reward=reward, components=components or None, advantage=advantage,
        finish_reason=stop_reason, status=status_for(stop_reason), problems=problems,
    )


def _prompt(request: object, messages: list[dict[str, str]] | None, ids: list[int] | None,
            tokenizer: object) -> list[dict[str, str]] | Deferred:
    """The prompt messages: the chat-templated request split by the tokenizer's template, the
    ``Prompt``'s own messages, or the prompt ids decoded (only if the episode is kept)."""
    if messages is not None:  # a Prompt of several messages: plain texts already
        return messages
    if request is not None:
        if tokenizer is not None:
            return messages_of(str(request), tokenizer)
        return [{"role": "user", "content": str(request)}]
    if ids and tokenizer is not None:
        info = tokenizer_info(tokenizer)
        return Deferred(lambda: messages_of(info.decoder.decode(ids, skip_special_tokens=False),
                                            tokenizer, "user"))
    if ids:
        return [{"role": "user", "content": f"<{len(ids)} prompt tokens; pass tokenizer= to decode>"}]
    return [{"role": "user", "content": ""}]
