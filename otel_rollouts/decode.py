"""Token-id batches (what RL frameworks hold) recorded as episodes, decoded only when kept.

    summary = otr.record_token_batch(
        batch["input_ids"], tokenizer=tokenizer, step=step, loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"], rewards=batch["rewards"], versions=batch["versions"],
    )

Why it is cheap: each tensor leaves the device once per batch, as a compact private numpy array
(``_token_layout``). The training thread then records, per sample, the episode's structure
through the normal episode API — prompt, one turn per loss-mask-1 run, token counts, reward,
policy versions, finish reason — with message text as ``Deferred`` values that hold only array
views. Nothing is decoded on the training thread. When the tail sampler keeps an episode, the
export thread resolves those values: one ``batch_decode`` call per episode for all its segments,
cached in a per-sample ``_Decoded`` object that every attribute of that episode reads from.

Tool calls are parsed from the decoded text, so the ``execute_tool`` spans (and whether the
feedback after a turn is a tool result or environment feedback) are known only then: each turn
carries a ``_TurnTail`` span record that the materializer replaces by those spans. A dropped
episode costs a few small objects and is never decoded.

Decoding uses a private copy of the tokenizer: a fast tokenizer used from two threads at once can
raise "Already borrowed" in the *training* thread (huggingface/tokenizers#537), and telemetry must
never do that.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry import trace

from otel_rollouts import _runtime
from otel_rollouts import conventions as c
from otel_rollouts._chat_roles import RoleMarkers, learn_markers
from otel_rollouts._content import Deferred, to_float
from otel_rollouts._guard import InvalidValue, guarded_or, report
from otel_rollouts._recording import SpanRecord
from otel_rollouts._token_layout import Layout, field_layout, host_column, layout_of
from otel_rollouts.episode import episode as new_episode
from otel_rollouts.toolcalls import ParsedMessage, parse_tool_calls, tool_responses

__all__ = ["record_token_batch", "TokenBatchSummary"]

FEEDBACK_SPAN = "feedback"
ROLE_TOOL = "tool"
ROLE_ENVIRONMENT = "environment"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class TokenBatchSummary:
    """What ``record_token_batch`` did with a batch."""

    recorded: int = 0  # episodes recorded, including error episodes for refused samples
    refused: list[tuple[int, str]] = field(default_factory=list)  # (sample, reason): tokens unusable
    problems: list[str] = field(default_factory=list)  # batch-level notes (e.g. misaligned columns)


# --- what is learned once per tokenizer --------------------------------------------------------
class _TokenizerInfo:
    """EOS ids (training thread), role markers and a private decoding copy (export thread)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = weakref.ref(tokenizer) if _weakrefable(tokenizer) else (lambda: tokenizer)
        self.lock = threading.Lock()
        self._markers: RoleMarkers | None = None
        self._decoder: Any = None
        self._special: tuple[str, ...] | None = None
        self.eos_ids = self._eos_ids(tokenizer)

    def _eos_ids(self, tokenizer: Any) -> frozenset[int]:
        ids = set()
        eos = getattr(tokenizer, "eos_token_id", None)
        for value in eos if isinstance(eos, (list, tuple)) else [eos]:
            if isinstance(value, int):
                ids.add(value)
        for suffix in self.markers.suffixes:  # the template's end of message, e.g. <|im_end|>
            try:
                encoded = tokenizer.encode(suffix.strip(), add_special_tokens=False)
            except Exception:  # noqa: BLE001
                continue
            if len(encoded) == 1:
                ids.add(int(encoded[0]))
        return frozenset(ids)

    @property
    def markers(self) -> RoleMarkers:
        if self._markers is None:
            with self.lock:
                if self._markers is None:
                    tokenizer = self.tokenizer()
                    self._markers = learn_markers(tokenizer) if tokenizer is not None else RoleMarkers()
        return self._markers

    @property
    def decoder(self) -> Any:
        """A private copy of the tokenizer (made once, on the export thread)."""
        if self._decoder is None:
            with self.lock:
                if self._decoder is None:
                    tokenizer = self.tokenizer()
                    try:
                        self._decoder = copy.deepcopy(tokenizer)
                    except Exception:  # noqa: BLE001 - an uncopyable tokenizer is used as it is
                        self._decoder = tokenizer
        return self._decoder

    @property
    def special(self) -> tuple[str, ...]:
        """Strings of the special tokens, removed from messages with ``skip_special_tokens``."""
        if self._special is None:
            tokenizer = self.tokenizer()
            found = set(getattr(tokenizer, "all_special_tokens", None) or ())
            for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
                if getattr(token, "special", False):
                    found.add(str(token))
            self._special = tuple(sorted((s for s in found if s), key=len, reverse=True))
        return self._special


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


_infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_infos_by_id: dict[int, _TokenizerInfo] = {}
_infos_lock = threading.Lock()


def _info(tokenizer: Any) -> _TokenizerInfo:
    with _infos_lock:
        try:
            info = _infos.get(tokenizer)
        except TypeError:  # not weak-referenceable / unhashable
            info = _infos_by_id.get(id(tokenizer))
        if info is None:
            info = _TokenizerInfo(tokenizer)
            try:
                _infos[tokenizer] = info
            except TypeError:
                _infos_by_id[id(tokenizer)] = info
        return info


# --- the lazy per-sample decoding ----------------------------------------------------------------
class _Decoded:
    """One sample's token ids and segments; decodes and parses everything once, when asked."""

    __slots__ = ("info", "ids", "bounds", "first_value", "skip_special", "_result")

    def __init__(self, info: _TokenizerInfo, ids: np.ndarray, bounds: list[int], first_value: bool,
                 skip_special: bool) -> None:
        self.info = info
        self.ids = ids  # a view of the batch's host array
        self.bounds = bounds  # segment edges: [0, cut1, ..., n]
        self.first_value = first_value  # loss-mask value of the first segment
        self.skip_special = skip_special
        self._result: dict[str, Any] | None = None

    def result(self) -> dict[str, Any]:
        if self._result is None:
            self._result = self._compute()
        return self._result

    def _compute(self) -> dict[str, Any]:
        info = self.info
        b = self.bounds
        segments = [self.ids[b[k] : b[k + 1]].tolist() for k in range(len(b) - 1)]
        texts = info.decoder.batch_decode(segments, skip_special_tokens=False) if segments else []
        markers = info.markers
        values = [self.first_value if k % 2 == 0 else not self.first_value for k in range(len(texts))]
        prompt: list[dict[str, Any]] = []
        turns: list[ParsedMessage] = []
        feedback: list[str | None] = []
        start = 0
        if texts and not values[0]:
            prompt = markers.messages(texts[0])
            start = 1
        for k in range(start, len(texts)):
            if values[k]:
                text = markers.clean(texts[k])
                prefix = markers.prefixes.get("assistant")
                if prefix and text.startswith(prefix):
                    text = text[len(prefix) :]
                for eos in self._eos_strings():
                    if text.endswith(eos):
                        text = text[: -len(eos)]
                turns.append(parse_tool_calls(text, f"call_{len(turns)}_"))
                feedback.append(None)
            elif feedback:
                feedback[-1] = texts[k]
        if self.skip_special:
            prompt = [dict(m, content=self._unspecial(m["content"])) for m in prompt]
            for t in turns:
                t.content = self._unspecial(t.content)
        errors = [f"turn {i}: {e}" for i, t in enumerate(turns) for e in t.errors]
        return {"prompt": prompt, "turns": turns, "feedback": feedback, "errors": errors or None}

    def _eos_strings(self) -> list[str]:
        tokenizer = self.info.decoder
        eos = getattr(tokenizer, "eos_token", None)
        return [eos] if isinstance(eos, str) and eos else []

    def _unspecial(self, text: str) -> str:
        for s in self.info.special:
            text = text.replace(s, "")
        return text

    # the values read by the span attributes
    def prompt(self) -> list[dict[str, Any]]:
        return self.result()["prompt"]

    def assistant(self, k: int) -> dict[str, Any]:
        turn = self.result()["turns"][k]
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        return message

    def errors(self) -> list[str] | None:
        return self.result()["errors"]

    def tail(self, k: int) -> tuple[ParsedMessage, str | None]:
        result = self.result()
        return result["turns"][k], result["feedback"][k]


class _Field(Deferred):
    """A Deferred reading one value of a sample's ``_Decoded`` (decoded at most once)."""

    __slots__ = ("decoded", "key", "index")

    def __init__(self, decoded: _Decoded, key: str, index: int = -1) -> None:
        self.decoded, self.key, self.index = decoded, key, index

    def resolve(self) -> Any:
        method = getattr(self.decoded, self.key)
        return method(self.index) if self.index >= 0 else method()


class _TurnTail(SpanRecord):
    """Stands for what follows a turn's generation: its tool calls and the feedback it got.

    Both depend on decoded text, so the materializer asks for them (``expand``) only when the
    episode is kept: ``execute_tool`` spans (with the tool result from the following mask-0
    tokens) when the turn made parseable tool calls, else one ``feedback`` span (role from the
    chat template's markers, else ``environment``).
    """

    __slots__ = ("decoded", "turn_index", "has_feedback", "capture")

    def expand(self) -> list[SpanRecord]:
        try:
            return self._expand()
        except Exception as exc:  # noqa: BLE001 - a decoding problem must not lose the episode
            span = self._child(FEEDBACK_SPAN, c.KIND_SPAN, {c.RL_FEEDBACK_ROLE: ROLE_ENVIRONMENT})
            span.fail(exc)
            return [span] if self.has_feedback else []

    def _child(self, name: str, kind: str, attrs: dict[str, Any], offset: int = 0) -> SpanRecord:
        base = {c.RL_SPAN_KIND: kind, c.OPENINFERENCE_SPAN_KIND: c.OPENINFERENCE_KIND_OF.get(kind, c.OI_CHAIN)}
        op = c.OPERATION_OF.get(kind)
        if op is not None:
            base[c.GEN_AI_OPERATION_NAME] = op
        base.update(attrs)
        span = SpanRecord(self.episode, name, _runtime.new_id64(), self.parent_id, kind, base, self.start_ns + offset)
        span.end_ns = self.end_ns if self.end_ns is not None else span.start_ns  # no end(): not a late span
        return span

    def _expand(self) -> list[SpanRecord]:
        if not self.capture:
            if not self.has_feedback:
                return []
            return [self._child(FEEDBACK_SPAN, c.KIND_SPAN, {c.RL_FEEDBACK_ROLE: ROLE_ENVIRONMENT})]
        parsed, text = self.decoded.tail(self.turn_index)
        markers = self.decoded.info.markers
        if parsed.tool_calls:
            results: list[str | None] = [None] * len(parsed.tool_calls)
            if text is not None:
                blocks = tool_responses(text)
                if blocks:
                    results[: len(blocks)] = blocks[: len(results)]
                else:
                    results[0] = "\n".join(m["content"] for m in markers.messages(text)) or text.strip()
            spans = []
            for j, (call, result) in enumerate(zip(parsed.tool_calls, results, strict=True)):
                name = call["function"]["name"]
                attrs = {
                    c.GEN_AI_TOOL_NAME: name,
                    c.GEN_AI_TOOL_CALL_ID: call["id"],
                    c.GEN_AI_TOOL_CALL_ARGUMENTS: call["function"]["arguments"],
                }
                if result is not None:
                    attrs[c.GEN_AI_TOOL_CALL_RESULT] = result
                spans.append(self._child(c.tool_span_name(name), c.KIND_TOOL, attrs, j))
            return spans
        if text is None:
            return []
        messages = markers.messages(text, default_role=ROLE_ENVIRONMENT)
        roles = {m["role"] for m in messages}
        role = roles.pop() if len(roles) == 1 else ROLE_ENVIRONMENT
        if role in ("assistant", ROLE_TOOL):
            role = ROLE_ENVIRONMENT  # no parsed tool call before it: no evidence it is a tool result
        content = "\n".join(m["content"] for m in messages) if messages else text
        if self.decoded.skip_special:
            content = self.decoded._unspecial(content)
        return [self._child(FEEDBACK_SPAN, c.KIND_SPAN, {
            c.RL_FEEDBACK_ROLE: role,
            c.GEN_AI_INPUT_MESSAGES: [{"role": role, "content": content}],
        })]


def _tail_span(decoded: _Decoded | None, turn_index: int, has_feedback: bool, capture: bool) -> None:
    """Add a ``_TurnTail`` under the current span (the turn)."""
    parent = trace.get_current_span()
    if not isinstance(parent, SpanRecord):
        return
    record = parent.episode
    span = _TurnTail(record, FEEDBACK_SPAN, _runtime.new_id64(), parent.span_id, c.KIND_SPAN, {})
    span.decoded, span.turn_index, span.has_feedback, span.capture = decoded, turn_index, has_feedback, capture
    record.add(span)
    span.end()


# --- the batch ------------------------------------------------------------------------------------
def _per_sample(name: str, value: Any, batch: int, summary: TokenBatchSummary) -> list[Any] | None:
    """A per-sample column aligned to the batch: short columns leave ``None`` and are noted."""
    column = host_column(value)
    if column is None:
        return None
    if len(column) != batch:
        summary.problems.append(f"{name}: {len(column)} values for {batch} samples (alignment partial)")
        column = (column + [None] * batch)[:batch]
    return column


def _token_values(name: str, value: Any, ids: Layout, mask: Layout | None, batch: int,
                  refused: dict[int, str], summary: TokenBatchSummary, reduce: str) -> list[Any] | None:
    """Rewards/advantages given per sample ([B]) or per token ([B, L]: summed / averaged)."""
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 2 or (isinstance(value, (list, tuple)) and value
                                                  and isinstance(value[0], (list, tuple))):
        layout = field_layout(name, value, ids, np.float64, refused)
        if layout is None:
            return None
        out: list[Any] = []
        for i in range(batch):
            s, n = int(layout.starts[i]), int(layout.lengths[i])
            row = layout.flat[s : s + n]
            if reduce == "sum" or mask is None:
                out.append(float(row.sum()) if reduce == "sum" else float(row.mean()) if n else None)
            else:
                ms = int(mask.starts[i])
                sel = row[mask.flat[ms : ms + n]] if int(mask.lengths[i]) == n else row
                out.append(float(sel.mean()) if sel.size else None)
        return out
    return _per_sample(name, value, batch, summary)


def _components(value: Any, batch: int, summary: TokenBatchSummary) -> list[dict[str, Any] | None] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):  # name -> per-sample values
        columns = {str(k): _per_sample(f"reward_components.{k}", v, batch, summary) for k, v in value.items()}
        return [{k: col[i] for k, col in columns.items() if col is not None and col[i] is not None}
                for i in range(batch)]
    rows = list(value)
    if len(rows) != batch:
        summary.problems.append(f"reward_components: {len(rows)} values for {batch} samples (alignment partial)")
        rows = (rows + [None] * batch)[:batch]
    return [dict(r) if isinstance(r, Mapping) else None for r in rows]


def _pick(column: list[Any] | None, i: int) -> Any:
    return None if column is None else column[i]


@guarded_or(TokenBatchSummary)
def record_token_batch(
    input_ids: Any,
    *,
    tokenizer: Any,
    step: int,
    loss_mask: Any,
    attention_mask: Any = None,
    rewards: Any = None,
    advantages: Any = None,
    group_ids: Any = None,
    versions: Any = None,
    split: str = "train",
    metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    episode_ids: Any = None,
    sample_indices: Any = None,
    finish_reasons: Any = None,
    statuses: Any = None,
    reward_components: Any = None,
    dataset_name: str | None = None,
    dataset_indices: Any = None,
    framework: str | None = None,
    model: str | None = None,
    max_length: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    skip_special_tokens: bool = False,
) -> TokenBatchSummary:
    """Record one episode per sample of a token-id batch; decode only the episodes that are kept.

    ``input_ids``: a padded 2-D tensor/array (``attention_mask`` marks the real tokens, left or
    right padding), or a list of 1-D tensors / arrays / lists of ints. ``loss_mask`` has the same
    shape: 1 = generated by the policy. Its first 0-run is the prompt (split into system/user
    messages by the chat template's role markers), each 1-run an assistant turn, each later 0-run
    the feedback to the turn before it (a tool result when that turn made a parseable tool call).
    ``versions`` (per token, −1 on prompt tokens) gives ``rl.policy.version`` from generated
    tokens only, with ``rl.policy.version.min/max`` when they differ. ``rewards``/``advantages``
    are per sample, or per token (rewards summed, advantages averaged over generated tokens).
    ``finish_reasons`` default to ``stop`` (last generated token is an EOS) or ``length`` (the
    sample reached ``max_length``, or the right edge of a right-padded batch).

    Returns a ``TokenBatchSummary``. A sample whose masks do not match its ids is refused with a
    reason naming it (recorded as an error episode); the rest of the batch is still recorded.
    """
    summary = TokenBatchSummary()
    rt = _runtime.current()
    if not rt.enabled or rt.pipeline is None:
        return summary
    info = _info(tokenizer)
    eos_ids = frozenset(int(x) for x in eos_token_ids) if eos_token_ids is not None else info.eos_ids
    capture = rt.capture_content

    ids, refused = layout_of(input_ids, attention_mask)
    batch = len(ids.starts)
    mask = field_layout("loss_mask", loss_mask, ids, np.bool_, refused)
    vers = None
    per_sample_versions = None
    if versions is not None:
        vshape = getattr(versions, "shape", None)
        if vshape is not None and len(vshape) == 1 and batch != 1 or (
                isinstance(versions, (list, tuple)) and versions and not isinstance(versions[0], (list, tuple))
                and not hasattr(versions[0], "shape") and batch != 1):
            per_sample_versions = _per_sample("versions", versions, batch, summary)
        else:
            vers = field_layout("versions", versions, ids, np.int64, refused)

    reward_col = _token_values("rewards", rewards, ids, mask, batch, refused, summary, "sum")
    advantage_col = _token_values("advantages", advantages, ids, mask, batch, refused, summary, "mean")
    components = _components(reward_components, batch, summary)
    group_col = _per_sample("group_ids", group_ids, batch, summary)
    episode_col = _per_sample("episode_ids", episode_ids, batch, summary)
    index_col = _per_sample("sample_indices", sample_indices, batch, summary)
    finish_col = _per_sample("finish_reasons", finish_reasons, batch, summary)
    status_col = _per_sample("statuses", statuses, batch, summary)
    dataset_col = _per_sample("dataset_indices", dataset_indices, batch, summary)
    if isinstance(metadata, Mapping) or metadata is None:
        meta_col = None
    else:
        meta_col = _per_sample("metadata", metadata, batch, summary)
    for problem in summary.problems:
        report(f"record_token_batch: {problem}")

    # mask-run edges for the whole batch at once
    if mask is not None:
        mflat = mask.flat
        edges = np.flatnonzero(mflat[1:] != mflat[:-1]) + 1
        mstarts = mask.starts
        lo = np.searchsorted(edges, mstarts, side="right")
        hi = np.searchsorted(edges, mstarts + mask.lengths, side="left")
    right_padded = (
        ids.width is not None and ids.last_column is not None
        and bool(np.any((ids.lengths > 0) & (ids.last_column < ids.width - 1)))
    )
    flat_ids = ids.flat
    starts_list = ids.starts.tolist()
    lengths_list = ids.lengths.tolist()
    last_col = ids.last_column.tolist() if ids.last_column is not None else None

    for i in range(batch):
        try:
            reason = refused.get(i)
            sample = i if index_col is None or index_col[i] is None else index_col[i]
            ep = new_episode(
                step, split,
                group_id=_pick(group_col, i),
                sample_index=sample,
                episode_id=_pick(episode_col, i),
                dataset_name=dataset_name,
                dataset_index=_pick(dataset_col, i),
                framework=framework,
                metadata=metadata if meta_col is None else meta_col[i],
            )
            with ep:
                if reason is not None:
                    summary.refused.append((i, reason))
                    report(f"record_token_batch: {reason}")
                    ep.set_attribute(c.RL_INVALID_FIELDS, [reason])
                    _finish_reward(ep, i, reward_col, advantage_col, components, None, c.STATUS_ERROR, reason)
                    summary.recorded += 1
                    continue
                s, n = starts_list[i], lengths_list[i]
                ms = int(mask.starts[i])
                cuts = (edges[lo[i] : hi[i]] - ms).tolist() if n else []
                bounds = [0, *cuts, n] if n else []
                first_value = bool(mflat[ms]) if n else False
                # policy versions from generated tokens only
                vmin = vmax = None
                if vers is not None and n:
                    vs = int(vers.starts[i])
                    gen = vers.flat[vs : vs + n][mflat[ms : ms + n]]
                    gen = gen[gen >= 0]
                    if gen.size:
                        vmin, vmax = int(gen.min()), int(gen.max())
                elif per_sample_versions is not None:
                    vmax = vmin = per_sample_versions[i]
                if vmax is not None:
                    ep.set_attribute(c.RL_POLICY_VERSION, vmax)
                    if vmin != vmax:
                        ep.set_attribute(c.RL_POLICY_VERSION_MIN, vmin)
                        ep.set_attribute(c.RL_POLICY_VERSION_MAX, vmax)
                decoded = _Decoded(info, flat_ids[s : s + n], bounds, first_value, skip_special_tokens) if capture else None
                # structure: prompt, then one turn per generated run
                nseg = len(bounds) - 1
                k0 = 0
                if nseg > 0 and not first_value:
                    if capture:
                        ep.prompt(_Field(decoded, "prompt"))
                    else:
                        ep.prompt(None)
                    k0 = 1
                finish = _pick(finish_col, i)
                turns = (nseg - k0 + 1) // 2
                for t in range(turns):
                    k = k0 + 2 * t
                    a, b = bounds[k], bounds[k + 1]
                    turn_finish = FINISH_STOP if int(flat_ids[s + b - 1]) in eos_ids else None
                    with ep.turn() as turn:
                        gen_attrs: dict[str, Any] = {"input_tokens": a, "output_tokens": b - a}
                        if t == turns - 1:
                            if finish is None:
                                finish = _infer_finish(turn_finish, n, max_length, right_padded,
                                                       last_col[i] if last_col else None, ids.width)
                            if finish is not None:
                                gen_attrs["finish_reason"] = finish
                        elif turn_finish is not None:
                            gen_attrs["finish_reason"] = turn_finish
                        turn.record_generation(_Field(decoded, "assistant", t) if capture else None,
                                               model=model, **gen_attrs)
                        _tail_span(decoded, t, k + 2 <= nseg, capture)
                if capture and turns:
                    ep.set_attribute(c.RL_TOOL_PARSE_ERROR, _Field(decoded, "errors"))
                status = _pick(status_col, i)
                if status is None and finish == FINISH_LENGTH:
                    status = c.STATUS_TRUNCATED
                _finish_reward(ep, i, reward_col, advantage_col, components, finish, status, None)
                summary.recorded += 1
        except InvalidValue:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad sample never stops the batch
            reason = f"sample {i}: {type(exc).__name__}: {exc}"
            summary.refused.append((i, reason))
            report(f"record_token_batch: {reason}", exc=exc)
    return summary


def _infer_finish(turn_finish: str | None, n: int, max_length: int | None, right_padded: bool,
                  last_column: int | None, width: int | None) -> str | None:
    if turn_finish is not None:
        return turn_finish
    if max_length is not None and n >= max_length:
        return FINISH_LENGTH
    if right_padded and last_column is not None and width is not None and last_column == width - 1:
        return FINISH_LENGTH
    return None


def _finish_reward(ep: Any, i: int, reward_col: list[Any] | None, advantage_col: list[Any] | None,
                   components: list[dict[str, Any] | None] | None, finish: str | None,
                   status: str | None, reason: str | None) -> None:
    reward = _pick(reward_col, i)
    advantage = _pick(advantage_col, i)
    comps = _pick(components, i)
    if reward is not None or advantage is not None or comps:
        if reward is not None:
            number, _ = to_float(reward, "reward")
            reward = reward if number is None else number
        ep.reward(reward, components=comps or None, advantage=advantage)
    if finish is not None or status is not None:
        ep.finish(reason=finish if finish is not None else reason, status=status)
