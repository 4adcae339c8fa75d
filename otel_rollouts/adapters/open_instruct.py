"""Open-Instruct (allenai/open-instruct) GRPO batches as episode traces.

Call it in ``DataPreparationActor._data_preparation_loop`` (``open_instruct/data_loader.py``),
where the scored batch and its advantages exist (right after the advantages are computed)::

    from otel_rollouts.adapters import open_instruct
    open_instruct.record_batch(batch, result, step=self.training_step, advantages=advantages,
                               num_samples_per_prompt=self.config.num_samples_per_prompt_rollout,
                               tokenizer=self.tokenizer)

Open-Instruct has no hook there (no callback list, no logger registry reaches the data-preparation
actor; see the README), so that line is added to its source.

``batch`` is Open-Instruct's ``Batch`` (``queries``, ``ground_truths``, ``datasets``,
``raw_queries``, ``decoded_responses``, ``indices``, ``scores``, ``active_tools``,
``model_steps``), ``result`` its ``GenerationResult`` (``responses``, ``finish_reasons``,
``masks``, ``request_info`` with the per-call ``tool_call_stats`` and ``rollout_states``), as
``accumulate_inference_batches`` → ``make_batch_from_groups`` build them. Any object, dataclass
or dict with those names works: Open-Instruct is never imported.

Open-Instruct is not on PyPI (git-only, with vLLM, DeepSpeed and Ray): the structures are read
as its source defines them (``open_instruct/model_utils.py:Batch``,
``data_types.py:GenerationResult`` / ``RequestInfo`` / ``ToolCallStats``,
``environments/base.py:RolloutState``, the default ``rlvr_tokenize_v1`` transform and
``vllm_utils.process_request``), read at commit ``e6c3044a`` (2026-08-20); the tests rebuild that
path's output field by field.

What the data-preparation path produces, and how it is read:

* ``datasets[i]`` and ``ground_truths[i]`` are lists (the default transform wraps a single
  verifier's name and answer in a list, for multi-verifier datasets): one name is
  ``rl.dataset.name``, several are joined with ``,``; the answer is unwrapped the same way.
* ``queries[i]`` are the prompt's token ids (the chat template applied): with ``tokenizer`` the
  prompt is split into its messages by the template's own role markers. ``raw_queries[i]``
  (``"role: content"`` lines, ambiguous once a content holds such a line, e.g. a few-shot
  prompt) is used only without a tokenizer.
* ``responses[i]`` + ``masks[i]``: the engine appends each tool or environment output to the
  response (mask 0, with ``mask_tool_use``), one formatted block per executed call, in call
  order, each answered by the next ``tool_call_stats[i]`` entry. Every run of policy tokens is a
  turn; the observation after it is split into its messages by the template's role markers
  (Hermes: ``<|im_start|>tool``... per result), each result paired with its own call. Output a
  text environment addresses to the ``user`` role is that turn's ``user`` feedback, not a tool
  result. Chat markup and EOS are removed with the tokenizer's own knowledge.

Field → attribute (one episode per sample ``i``):

==============================================  ==============================================
Open-Instruct                                   recorded as
==============================================  ==============================================
``batch.scores[i]``                             ``rl.reward.score`` (the verifiers' final reward)
``request_info.rollout_states[i]["rewards"]``   ``rl.reward.component.env_step_<j>`` (per environment
                                                step rewards: the only reward components)
``advantages[i]``                               ``rl.advantage``
``batch.model_steps[i]``                        ``rl.policy.version`` (−1 placeholders ignored)
``step`` (the consuming ``training_step``)      ``rl.staleness`` = trained version − version
``queries[i]`` (with ``tokenizer``) /           the prompt messages
``raw_queries[i]``
``responses[i]`` + ``masks[i]``                 the turns; each tool output (mask 0) the result
                                                of its own ``execute_tool`` span
``request_info.tool_call_stats[i]``             ``execute_tool`` spans (name, error when
                                                ``success`` is false, ``rl.tool.runtime_s``)
``result.finish_reasons[i]``                    ``rl.finish_reason``, ``rl.status``
``batch.datasets[i]`` / ``indices[i]``          ``rl.dataset.name`` / ``rl.dataset.index``,
                                                ``rl.group.id`` = the dataset index
``request_info.tool_runtimes[i]`` (when         ``rl.stage.tool.seconds`` (the engine awaits
``num_calls[i]`` > 0)                           each call in turn: their sum is its tool time)
``num_calls``, ``timeouts``, ``tool_errors``,   ``rl.metadata.*`` (not reward terms)
``tool_runtimes``, ``ground_truths``
==============================================  ==============================================

``rl.metadata.ground_truth`` (the answer) is recorded only with content capture on.
No ``rl.duration.seconds``: Open-Instruct times no sample's whole rollout (``token_statistics``
has the batch's generation time only, not copied onto episodes).
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

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts.adapters._text import assistant_message, clean, messages_of
from otel_rollouts.adapters.kit import (
    Columns,
    Deferred,
    Sample,
    as_float,
    captures_content,
    describe_framework,
    group_ids,
    guarded,
    items,
    lazy_text,
    mask_runs,
    read_samples,
    record_samples,
    reward_total,
    set_policy,
    set_span_attribute,
    split_name,
    status_for,
    strip_tool_responses,
    to_list,
    tokenizer_info,
    tool_responses,
    warn_unknown,
)

if TYPE_CHECKING:
    from otel_rollouts import Episode, Turn

__all__ = ["record_batch"]

FRAMEWORK = "open-instruct"
SOURCE_COMMIT = "e6c3044aa6201c8bfa4573c1b03142af599e730d"  # allenai/open-instruct, 2026-08-20
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
# one output wrapped in a tag of the tool parser's own (``<output>`` for the legacy parser)
_RESPONSE_OPEN = "<tool_response>"
_Pair = tuple["dict[str, object] | None", "tuple[str, str, bool] | None"]  # (call, its answer)
_WRAPPED = re.compile(r"\s*<(?P<tag>[A-Za-z_][\w-]{0,31})>(?P<body>.*?)</(?P=tag)>\s*", re.DOTALL)


@guarded
def record_batch(
    batch: object,
    result: object,
    *,
    step: int,
    advantages: object = None,
    num_samples_per_prompt: int = 1,
    tokenizer: object = None,
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
    * ``tokenizer``: the actor's tokenizer (``self.tokenizer``): splits the prompt ids and the
      multi-turn responses into messages by its chat template and removes markup and EOS.
      Observations are decoded now (their messages are the episode's structure), the rest only
      for the episodes the sampler keeps.
    * ``split``: ``train`` or ``eval``.
    * ``trained_version``: learner updates the weights that train on the batch have received;
      defaults to ``step`` for training (see the module docstring), none for evaluation.
    """
    describe_framework(FRAMEWORK, "open-instruct")
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
    if tokenizer is not None:
        clean("", tokenizer)  # learn the template's markers and special tokens on this thread
    complete = not cols.ragged and n > 0
    groups, _ = group_ids(
        n, ids=cols.columns.get("indices"), per_group=num_samples_per_prompt, complete=complete
    )
    samples = read_samples(range(n), lambda i: _sample(
        cols, i, step=step, split=split, group=groups[i], tokenizer=tokenizer, model=model,
        n_per_group=num_samples_per_prompt if complete else 0, trained_version=trained_version), FRAMEWORK)
    return record_samples(samples, step=step, split=split, framework=FRAMEWORK)


def _get(obj: object, name: str) -> object:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _sample(cols: Columns, i: int, *, step: int, split: str, group: str | None, tokenizer: object,
            model: str | None, n_per_group: int, trained_version: int | None) -> Sample:
    """Sample ``i``: what the sampler reads now, its prompt and turns only if it may be kept."""
    v = cols.value
    model_step = _model_step(v("model_steps", i))
    metadata: dict[str, object] = {}
    for name in ("num_calls", "timeouts", "tool_errors", "tool_runtimes"):
        value = v(name, i)
        if value not in (None, "", [], 0, False):
            metadata[name] = value
    truth = _ground_truth(v("ground_truths", i))
    # tool_runtimes[i]: the sum of its tool calls' runtimes, each awaited in turn by the engine
    # (process_request): its seconds in tools, when it made calls (0 calls: none measured)
    calls, _ = as_float(_scalar(v("num_calls", i)), "num_calls")
    stages = {c.STAGE_TOOL: _scalar(v("tool_runtimes", i))} if calls else None
    if group is not None and n_per_group and n_per_group > 0:
        metadata["repetition"] = i % n_per_group
    finish = v("finish_reasons", i)
    total, _, problem = reward_total(v("scores", i), f"scores[{i}]")

    def content(ep: Episode) -> None:
        set_policy(ep, model_step, trained_version)
        if truth is not None and captures_content(ep):
            # the dataset's answer is content, as the prompt is: an ``rl.metadata.*`` label
            # would keep it with capture off, so it is recorded only when content is captured
            ep.set_attribute(f"{c.RL_METADATA_PREFIX}ground_truth", truth)
        ep.prompt(_prompt(cols, i, tokenizer))
        _turns(ep, cols, i, tokenizer, model, finish)

    return Sample(
        content, episode_id=f"{split}-{step}-{i}", group_id=group, sample_index=i,
        dataset_name=_dataset_name(v("datasets", i)), dataset_index=v("indices", i),
        metadata=metadata or None, reward=total, stages=stages,
        components=_env_rewards(v("rollout_states", i)) or None,
        advantage=v("advantages", i), finish_reason=finish, status=status_for(finish),
        missing=cols.missing(i), problems=[problem] if problem else (),
    )


def _scalar(value: object) -> object:
    """A numpy/torch scalar as a Python one; other values unchanged."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes, list, tuple, Mapping)):
        try:
            return value.item()
        except (TypeError, ValueError):
            return value
    return value


def _dataset_name(value: object) -> str | None:
    """``datasets[i]``: the default transform wraps the verifier source in a list (one entry per
    verifier); one name is the dataset name, several are joined with ``,``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    names = to_list(value)
    if names is None or any(isinstance(x, (list, tuple, Mapping)) for x in names):
        warn_unknown(FRAMEWORK, "datasets", f"{type(value).__name__} {value!r:.80}, not a name or a "
                     "list of names; recorded as text")
        return str(value)
    names = [str(_scalar(x)) for x in names if x is not None]
    return ",".join(names) if names else None


def _ground_truth(value: object) -> str | int | float | bool | list[str] | None:
    """``ground_truths[i]`` as an attribute value: a one-entry list (the default transform's
    wrapping) is its entry, several scalars a list of strings, anything else JSON text."""
    value = _scalar(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        values = [_scalar(x) for x in (to_list(value) or [])]
        if len(values) == 1:
            return _ground_truth(values[0])
        if values and all(isinstance(x, (str, int, float, bool)) for x in values):
            return [str(x) for x in values]
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _model_step(value: object) -> int | None:
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


# --- the prompt ----------------------------------------------------------------------------------
def _prompt(cols: Columns, i: int, tokenizer: object) -> Deferred | list[dict[str, str]]:
    """The prompt's messages: the chat-templated ``queries[i]`` split by the template's role
    markers (only if the episode is kept); without a tokenizer the ``raw_queries`` lines."""
    query = cols.value("queries", i)
    ids = None if query is None or isinstance(query, str) else to_list(query)
    if tokenizer is not None and ids:
        info = tokenizer_info(tokenizer)
        ids = [int(t) for t in ids]

        def split() -> list[dict[str, str]]:
            return messages_of(info.decoder.decode(ids, skip_special_tokens=False), tokenizer, "user")

        return Deferred(split)
    raw = cols.value("raw_queries", i)
    if isinstance(raw, str) and raw:
        return _unflatten(raw)
    if isinstance(query, str):
        return [{"role": "user", "content": query}]
    return [{"role": "user", "content": ""}]


def _unflatten(text: str) -> list[dict[str, str]]:
    """Open-Instruct's ``raw_queries`` join messages as ``"{role}: {content}"`` lines (read only
    without a tokenizer: a content holding such a line cannot be told apart)."""
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


# --- the turns -----------------------------------------------------------------------------------
def _stats(cols: Columns, i: int) -> list[dict[str, object]]:
    stats = []
    for s in to_list(cols.value("tool_call_stats", i)) or []:
        stat = items(s)
        if not (stat.get("tool_name") or stat.get("name")):
            warn_unknown(FRAMEWORK, "tool_call_stats", f"{type(s).__name__} without tool_name; "
                         "recorded as a call of an unnamed tool")
        stats.append(stat)
    return stats


def _turns(ep: Episode, cols: Columns, i: int, tokenizer: object, model: str | None, finish: object) -> None:
    v = cols.value
    stats = _stats(cols, i)
    response = to_list(v("responses", i))
    mask = to_list(v("masks", i))
    if mask is not None and response is not None and len(mask) != len(response):
        warn_unknown(FRAMEWORK, "masks", f"{len(mask)} mask values for {len(response)} response tokens; "
                     "the response is recorded as one turn")
        mask = None
    if tokenizer is not None and response:
        parts = _parts([int(t) for t in response], mask, tokenizer,
                       called=bool(stats) or bool(v("num_calls", i)))
        _record_parts(ep, parts, stats, tokenizer, model, finish)
        return
    text = v("decoded_responses", i)
    if tokenizer is not None and isinstance(text, str):
        _record_parts(ep, [_Gen(_lazy_message(tokenizer, text=text), None)], stats, tokenizer,
                      model, finish)
        return
    with ep.turn() as turn:
        turn.record_generation(
            {"role": "assistant", "content": "" if text is None else text},
            model=model,
            finish_reason=finish,
            output_tokens=len(response) if response is not None else None,
        )
        outputs = v("tool_outputs", i)
        for k, stat in enumerate(stats):
            # without a tokenizer the outputs cannot be split (they are concatenated):
            # one call owns them all
            result = outputs if len(stats) == 1 else None
            _tool(turn, stat, f"call_{k}", None, result)
        if len(stats) != 1 and outputs:
            turn.feedback(outputs, role="tool")


class _Gen:
    """A run of policy tokens: its assistant message (decoded now when the tool calls it holds
    are structure, else a ``Deferred``) and its token count."""

    __slots__ = ("message", "tokens")

    def __init__(self, message: str | Deferred, tokens: int | None) -> None:
        self.message = message
        self.tokens = tokens


class _Obs:
    """An observation the engine inserted: ``[(role, text, is_tool_output)]`` in order."""

    __slots__ = ("items",)

    def __init__(self, found: list[tuple[str, str, bool]]) -> None:
        self.items = found


def _lazy_message(tokenizer: object, ids: list[int] | None = None, text: str | None = None) -> Deferred:
    decoded = lazy_text(tokenizer, ids) if ids is not None else None

    def message() -> dict[str, object]:
        raw = decoded.resolve() if decoded is not None else text
        return assistant_message(raw, tokenizer)[0]

    return Deferred(message)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def _parts(response: list[int], mask: Sequence[object] | None, tokenizer: object, *, called: bool
           ) -> list[_Gen | _Obs]:
    """The response as generations and observations: by the mask's runs (0 = inserted by the
    engine); without masked observations but with tool calls (``mask_tool_use`` off) by the chat
    template's role markers in the decoded text; else one generation, decoded only if kept."""
    if mask is not None and any(not m for m in mask):
        runs = mask_runs(mask)
        parts: list[_Gen | _Obs] = []
        for k, (start, end, value) in enumerate(runs):
            ids = response[start:end]
            if not value:
                parts.append(_Obs(_observation(_decode(tokenizer, ids), tokenizer)))
            elif k + 1 < len(runs):  # an observation follows: its calls are structure
                parts.append(_Gen(_decode(tokenizer, ids), end - start))
            else:
                parts.append(_Gen(_lazy_message(tokenizer, ids), end - start))
        return parts
    if called:
        parts = []
        for m in messages_of(_decode(tokenizer, response), tokenizer, "assistant"):
            if m["role"] == "assistant":
                parts.append(_Gen(m["content"], None))
            else:
                found = _observation_message(m["role"], m["content"])
                if parts and isinstance(parts[-1], _Obs):
                    parts[-1].items.extend(found)
                else:
                    parts.append(_Obs(found))
        return parts
    return [_Gen(_lazy_message(tokenizer, response), len(response))]


def _observation(text: str, tokenizer: object) -> list[tuple[str, str, bool]]:
    """The messages of an observation run: one per executed call, each rendered by the tool
    parser with its role's template (and the next generation prompt, left out)."""
    found: list[tuple[str, str, bool]] = []
    for m in messages_of(text, tokenizer, "tool"):
        found.extend(_observation_message(m["role"], m["content"]))
    return found


def _observation_message(role: str, content: str) -> list[tuple[str, str, bool]]:
    if role == "assistant":  # the generation prompt the parser appends after each output
        return [("assistant", content.strip(), False)] if content.strip() else []
    blocks = tool_responses(content)
    if blocks:  # Hermes/Qwen results (Qwen3.5 templates put them in a user message)
        rest = strip_tool_responses(content)
        return [("tool", b, True) for b in blocks] + ([(role, rest, False)] if rest else [])
    if role == "user":  # a text environment's reply (its response_role), not a tool result
        return [("user", content.strip(), False)]
    head = content.lstrip()
    if head.startswith(_RESPONSE_OPEN):  # a result cut by the context budget: no closing tag
        return [(role, head[len(_RESPONSE_OPEN):].strip(), True)]
    return [(role, b, True) for b in _wrapped(content)]


def _wrapped(text: str) -> list[str]:
    """Outputs a tool parser wrapped in one tag each (``<output>``...``</output>``) back to
    back, unwrapped; text that is not wholly such blocks is one output."""
    out = []
    pos = 0
    tag = None
    while pos < len(text):
        m = _WRAPPED.match(text, pos)
        if m is None or (tag is not None and m.group("tag") != tag):
            return [text.strip()]
        tag = m.group("tag")
        out.append(m.group("body").strip())
        pos = m.end()
    return out or [text.strip()]


def _record_parts(ep: Episode, parts: list[_Gen | _Obs], stats: list[dict[str, object]], tokenizer: object,
                  model: str | None, finish: object) -> None:
    """One turn per generation with the observation after it; each tool output (and each text
    environment reply) answers the next executed call of ``tool_call_stats`` in order. Calls left
    without an output (the context budget ran out) are spans of the last turn that called."""
    turns: list[tuple[_Gen | None, _Obs | None]] = []
    k = 0
    while k < len(parts):
        part = parts[k]
        if isinstance(part, _Gen):
            obs = parts[k + 1] if k + 1 < len(parts) and isinstance(parts[k + 1], _Obs) else None
            turns.append((part, obs))  # type: ignore[arg-type]
            k += 2 if obs is not None else 1
        else:
            turns.append((None, part))
            k += 1
    # which calls each turn's observation answers (text environment replies included)
    owned: list[list[_Pair]] = []
    s = 0
    last_caller = None
    for t, (_, obs) in enumerate(turns):
        pairs: list[_Pair] = []
        for item in obs.items if obs is not None else []:
            role, _, is_tool = item
            if (is_tool or role == "user") and s < len(stats):
                pairs.append((stats[s], item))
                s += 1
                last_caller = t
            else:
                pairs.append((None, item))
        owned.append(pairs)
    leftover = stats[s:]
    if leftover and owned:
        owned[last_caller if last_caller is not None else len(owned) - 1].extend(
            (stat, None) for stat in leftover)
    n_call = 0
    for t, ((gen, _), pairs) in enumerate(zip(turns, owned, strict=True)):
        with ep.turn() as turn:
            parsed: list[dict[str, object]] = []
            if gen is not None:
                message: str | Deferred | dict[str, object] = gen.message
                errors: list[str] = []
                if isinstance(message, str):
                    reply, errors = assistant_message(message, tokenizer, f"call_{t}_")
                    parsed = list(reply.get("tool_calls") or [])
                    message = reply
                turn.record_generation(message, model=model,
                                       finish_reason=finish if t == len(turns) - 1 else None,
                                       output_tokens=gen.tokens)
                if errors:
                    set_span_attribute(turn, c.RL_TOOL_PARSE_ERROR, errors)
            for stat, answer in pairs:
                if stat is None:
                    if answer is not None:
                        turn.feedback(answer[1], role=answer[0])
                    continue
                if answer is not None and not answer[2]:  # a text environment's reply
                    turn.feedback(answer[1], role=answer[0])
                    continue
                name = str(stat.get("tool_name") or stat.get("name") or "tool")
                call = _take_call(parsed, name)
                call_id = str(call.get("id")) if call and call.get("id") else f"call_{t}_{n_call}"
                n_call += 1
                _tool(turn, stat, call_id, _arguments(call), None if answer is None else answer[1],
                      answered=answer is not None)


def _take_call(parsed: list[dict[str, object]], name: str) -> dict[str, object] | None:
    """The first tool call the model wrote that names ``name`` (removed), if any."""
    for k, call in enumerate(parsed):
        function = call.get("function")
        if isinstance(function, Mapping) and function.get("name") == name:
            return parsed.pop(k)
    return None


def _arguments(call: Mapping[str, Any] | None) -> object:
    if not call:
        return None
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _tool(turn: Turn, stat: Mapping[str, object], call_id: str, arguments: object, result: object, *,
          answered: bool = True) -> None:
    name = stat.get("tool_name") or stat.get("name") or "tool"
    with turn.tool_call(str(name), arguments=arguments, call_id=call_id) as call:
        set_span_attribute(call, c.RL_TOOL_RUNTIME, _float_or_none(stat.get("runtime")))
        if stat.get("success") is False:
            call.error(result if isinstance(result, str) and result else f"{name} failed")
        elif answered:
            call.result("" if result is None else result)
        # else: executed, but its output never reached the model (context budget): no result


def _float_or_none(value: object) -> float | None:
    total, _, problem = reward_total(value)
    return None if problem else total


def _env_rewards(state: object) -> dict[str, object]:
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
