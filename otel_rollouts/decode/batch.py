"""Token-id batches (what RL frameworks hold) recorded as episodes, decoded only when kept.

    summary = otr.record_token_batch(
        batch["input_ids"], tokenizer=tokenizer, step=step, loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"], rewards=batch["rewards"], versions=batch["versions"],
    )

Why it is cheap: each tensor leaves the device once per batch (a batch already on the host is
read in place), and everything that can be vectorized over the batch is (loss-mask run edges,
sequence ranges from the attention mask). The batch is then offered to the tail sampler as
columns, in one call (``record.batch``): only the samples it may keep are recorded as episodes
through the episode API — the root with its ``rl.*`` values, the reward, the finish reason —
plus one ``_EpisodeBody`` span record holding a copy of the sample's ids and its segment edges.
Nothing is decoded there, and a dropped sample is never an object.

When the tail sampler keeps an episode, the materializer (export thread) expands its body: the
segments are decoded with one ``batch_decode`` call, cached, and turned into the spans the
episode API would have made — ``prompt`` (split into system/user messages by the chat template's
role markers), one ``turn`` per loss-mask-1 run with its ``chat`` span, then ``execute_tool``
spans when the turn made parseable tool calls (the following mask-0 run is their result) or a
``feedback`` span (role from the template's markers, else ``environment``). Tool calls can only be
known after decoding, which is why these spans are built at materialization rather than
recorded up front; the root's ``rl.tool.parse_error`` is a ``Deferred`` read from the same cache.
A dropped episode is never decoded and costs a few small objects.

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
from typing import TYPE_CHECKING, Any

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import Entry
from otel_rollouts._core.guard import guarded_or, report, takes_instance
from otel_rollouts._core.logprobs import (
    MismatchOptions,
    RowTotals,
    TokenView,
    read_array,
    row_totals,
    totals_of,
)
from otel_rollouts._core.spans import SpanRecord
from otel_rollouts._core.values import to_float
from otel_rollouts.decode.chat_roles import RoleMarkers, learn_markers
from otel_rollouts.decode.toolcalls import ParsedMessage, parse_tool_calls, tool_responses
from otel_rollouts.record.batch import Rows, record_rows
from otel_rollouts.record.episode import status_value

if TYPE_CHECKING:  # numpy (and torch) are imported only when a batch is recorded
    import numpy as np

    from otel_rollouts.decode.layout import Layout

__all__ = ["record_token_batch", "TokenBatchSummary"]

FEEDBACK_SPAN = c.SPAN_FEEDBACK
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


class TokenizerCache:
    """What was learned of each tokenizer (special tokens, chat-template markers): learning it
    renders the template, so it is done once per tokenizer object and shared by every run of
    the process. A cache, not run state: weakly keyed (it goes with the tokenizer); a tokenizer
    that cannot be weakly referenced is kept by id, at most ``max_by_id`` of them."""

    def __init__(self, max_by_id: int = 64) -> None:
        self._weak: weakref.WeakKeyDictionary[Any, _TokenizerInfo] = weakref.WeakKeyDictionary()
        self._by_id: dict[int, _TokenizerInfo] = {}
        self._max_by_id = max_by_id
        self._lock = threading.Lock()

    def get(self, tokenizer: Any) -> _TokenizerInfo:
        with self._lock:
            try:
                info = self._weak.get(tokenizer)
            except TypeError:  # not weak-referenceable / unhashable
                info = self._by_id.get(id(tokenizer))
            if info is None:
                info = _TokenizerInfo(tokenizer)
                try:
                    self._weak[tokenizer] = info
                except TypeError:
                    if len(self._by_id) >= self._max_by_id:
                        self._by_id.pop(next(iter(self._by_id)))
                    self._by_id[id(tokenizer)] = info
            return info

    def __len__(self) -> int:
        """How many tokenizers it knows now (a weakly held one leaves with its tokenizer)."""
        with self._lock:
            return len(self._weak) + len(self._by_id)


TokenizerInfo = _TokenizerInfo  # its public name, for type hints (what ``tokenizer_info`` returns)
TOKENIZERS = TokenizerCache()  # the process's documented cache (see the class)


def tokenizer_info(tokenizer: Any) -> _TokenizerInfo:
    """What was learned of ``tokenizer`` (learned on first use)."""
    return TOKENIZERS.get(tokenizer)


def tokenizer_knowledge(tokenizer: Any) -> tuple[RoleMarkers, tuple[str, ...], str | None]:
    """(chat-template role markers, special-token strings, EOS string) of ``tokenizer``, learned
    once per tokenizer; what turns decoded text back into readable messages."""
    info = tokenizer_info(tokenizer)
    eos = getattr(tokenizer, "eos_token", None)
    return info.markers, info.special, eos if isinstance(eos, str) and eos else None


# --- the lazy episode body ----------------------------------------------------------------------
class _EpisodeBody(SpanRecord):
    """Stands for an episode's prompt, turns, generations, tool calls and feedback.

    On the training thread it holds only a view of the sample's token ids and its loss-mask
    segment edges. The materializer calls ``expand`` only when the episode is kept: the segments
    are decoded then (one ``batch_decode`` call), and the spans are built as the episode API
    builds them: ``prompt``; per loss-mask-1 run a ``turn`` with its ``chat`` span; after it
    ``execute_tool`` spans when the turn made parseable tool calls (their results from the
    following mask-0 tokens), else a ``feedback`` span (role from the chat template's markers,
    else ``environment``).
    """

    __slots__ = ("info", "ids", "bounds", "first_value", "skip_special", "model", "finish",
                 "capture", "eos_ids", "_decoded", "logprobs", "options")
    info: _TokenizerInfo
    ids: np.ndarray
    bounds: list[int]
    first_value: bool
    skip_special: bool
    model: str | None
    finish: str | None
    capture: bool
    eos_ids: frozenset[int]
    _decoded: dict[str, Any] | None
    # (engine, trainer) logprobs aligned with ``ids`` (copies, NaN where unknown), or None
    logprobs: tuple[np.ndarray, np.ndarray] | None
    options: MismatchOptions | None

    # --- decoding (export thread, kept episodes only) ------------------------------------------
    def decoded(self) -> dict[str, Any]:
        if self._decoded is None:
            self._decoded = self._decode()
        return self._decoded

    def _decode(self) -> dict[str, Any]:
        info = self.info
        b = self.bounds
        segments = [self.ids[b[k] : b[k + 1]].tolist() for k in range(len(b) - 1)]
        texts = info.decoder.batch_decode(segments, skip_special_tokens=False) if segments else []
        markers = info.markers
        prompt: list[dict[str, Any]] = []
        turns: list[ParsedMessage] = []
        feedback: list[str | None] = []
        for k, text in enumerate(texts):
            generated = self.first_value if k % 2 == 0 else not self.first_value
            if k == 0 and not generated:
                prompt = markers.messages(text)
            elif generated:
                turns.append(parse_tool_calls(self._assistant_text(text), f"call_{len(turns)}_"))
                feedback.append(None)
            elif feedback:
                feedback[-1] = text
        if self.skip_special:
            prompt = [dict(m, content=self._unspecial(m["content"])) for m in prompt]
            for t in turns:
                t.content = self._unspecial(t.content)
        errors = [f"turn {i}: {e}" for i, t in enumerate(turns) for e in t.errors]
        return {"prompt": prompt, "turns": turns, "feedback": feedback, "errors": errors or None}

    def _assistant_text(self, text: str) -> str:
        markers = self.info.markers
        prefix = markers.prefixes.get("assistant")
        if prefix and text.startswith(prefix):
            text = text[len(prefix) :]
        text = markers.clean(text)
        eos = getattr(self.info.decoder, "eos_token", None)
        if isinstance(eos, str) and eos and text.endswith(eos):
            text = text[: -len(eos)]
        return text

    def _unspecial(self, text: str) -> str:
        for s in self.info.special:
            text = text.replace(s, "")
        return text

    # --- spans (export thread) -----------------------------------------------------------------
    def expand(self) -> list[SpanRecord]:
        out: list[SpanRecord] = []
        try:
            self._expand(out)
        except Exception as exc:  # noqa: BLE001 - a decoding problem must not lose the episode
            span = self._span(out, c.SPAN_PROMPT, c.KIND_SPAN, self.parent_id, {})
            span.name = "decode"
            span.fail(exc)
        return out

    def _span(self, out: list[SpanRecord], name: str, kind: str, parent_id: int | None,
              attrs: dict[str, Any]) -> SpanRecord:
        """A finished span like ``episode.child_span`` makes (never ``end()``: not a late span)."""
        start = self.start_ns + len(out)  # keeps the recorded order when sorted by start time
        span = SpanRecord(self.episode, name, _runtime.new_id64(), parent_id, kind, dict(attrs), start)
        span.end_ns = max(self.end_ns or start, start)
        out.append(span)
        return span

    def _expand(self, out: list[SpanRecord]) -> None:
        root = self.parent_id
        b = self.bounds
        nseg = len(b) - 1
        content = self.decoded() if self.capture else None
        k0 = 0
        if nseg > 0 and not self.first_value:
            prompt = {c.GEN_AI_INPUT_MESSAGES: content["prompt"]} if content is not None else {}
            self._span(out, c.SPAN_PROMPT, c.KIND_PROMPT, root, prompt)
            k0 = 1
        turns = (nseg - k0 + 1) // 2
        for t in range(turns):
            k = k0 + 2 * t
            start, end = b[k], b[k + 1]
            turn = self._span(out, c.SPAN_TURN, c.KIND_TURN, root, {c.RL_TURN_INDEX: t})
            attrs: dict[str, Any] = {
                c.GEN_AI_USAGE_INPUT_TOKENS: start,
                c.GEN_AI_USAGE_OUTPUT_TOKENS: end - start,
            }
            if self.model:
                attrs[c.GEN_AI_REQUEST_MODEL] = self.model
            if self.logprobs is not None and self.options is not None:
                self._mismatch(attrs, start, end, self.options)
            finish = self.finish if t == turns - 1 else None
            if finish is None and int(self.ids[end - 1]) in self.eos_ids:
                finish = FINISH_STOP
            if finish is not None:
                attrs[c.GEN_AI_RESPONSE_FINISH_REASONS] = [finish]
            parsed = None
            if content is not None:
                parsed = content["turns"][t]
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                attrs[c.GEN_AI_OUTPUT_MESSAGES] = [message]
                if parsed.errors:
                    attrs[c.RL_TOOL_PARSE_ERROR] = list(parsed.errors)
            self._span(out, c.chat_span_name(self.model), c.KIND_GENERATION, turn.span_id, attrs)
            has_feedback = k + 2 <= nseg
            text = content["feedback"][t] if content is not None else None
            if parsed is not None and parsed.tool_calls:
                self._tools(out, turn.span_id, parsed, text)
            elif has_feedback:
                self._feedback(out, turn.span_id, text)

    def _mismatch(self, attrs: dict[str, Any], start: int, end: int, options: MismatchOptions) -> None:
        """A generation's own mismatch statistics and worst tokens (its tokens are one loss-mask run)."""
        assert self.logprobs is not None
        rollout, trainer = (x[start:end] for x in self.logprobs)
        attrs.update(totals_of(rollout, trainer, None, options).attributes(options))
        if options.top_tokens and self.capture:
            decoder = self.info.decoder
            view = TokenView(rollout, trainer, None, options.top_tokens, self.ids[start:end],
                             lambda ids: [decoder.decode([i], skip_special_tokens=False) for i in ids])
            attrs.update(view.worst())

    def _tools(self, out: list[SpanRecord], parent: int, parsed: ParsedMessage, text: str | None) -> None:
        results: list[str | None] = [None] * len(parsed.tool_calls)
        if text is not None:
            blocks = tool_responses(text)
            if blocks:
                results[: len(blocks)] = blocks[: len(results)]
            else:
                messages = self.info.markers.messages(text)
                results[0] = "\n".join(m["content"] for m in messages) if messages else text.strip()
        for call, result in zip(parsed.tool_calls, results, strict=True):
            name = call["function"]["name"]
            attrs = {
                c.GEN_AI_TOOL_NAME: name,
                c.GEN_AI_TOOL_CALL_ID: call["id"],
                c.GEN_AI_TOOL_CALL_ARGUMENTS: call["function"]["arguments"],
                c.RL_FEEDBACK_ROLE: ROLE_TOOL,
            }
            if result is not None:
                attrs[c.GEN_AI_TOOL_CALL_RESULT] = self._unspecial(result) if self.skip_special else result
            self._span(out, c.tool_span_name(name), c.KIND_TOOL, parent, attrs)

    def _feedback(self, out: list[SpanRecord], parent: int, text: str | None) -> None:
        if text is None:  # content not captured
            self._span(out, FEEDBACK_SPAN, c.KIND_SPAN, parent, {c.RL_FEEDBACK_ROLE: ROLE_ENVIRONMENT})
            return
        messages = self.info.markers.messages(text, default_role=ROLE_ENVIRONMENT)
        roles = {m["role"] for m in messages}
        role = roles.pop() if len(roles) == 1 else ROLE_ENVIRONMENT
        if role in ("assistant", ROLE_TOOL):
            role = ROLE_ENVIRONMENT  # no parsed tool call before it: no evidence it is a tool result
        content = "\n".join(m["content"] for m in messages) if messages else text
        if self.skip_special:
            content = self._unspecial(content)
        self._span(out, FEEDBACK_SPAN, c.KIND_SPAN, parent, {
            c.RL_FEEDBACK_ROLE: role,
            c.GEN_AI_INPUT_MESSAGES: [{"role": role, "content": content}],
        })


# --- the batch ------------------------------------------------------------------------------------
def _per_sample(name: str, value: Any, batch: int, summary: TokenBatchSummary) -> list[Any] | None:
    """A per-sample column aligned to the batch: short columns leave ``None`` and are noted."""
    from otel_rollouts.decode.layout import host_column

    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if (shape is not None and len(shape) == 0) or isinstance(value, (int, float, str, bytes)):
        # one value for the whole batch (a 0-d tensor, a number, a text): given to every sample,
        # and said so; it once lost the whole batch
        one = host_column(value.reshape(1)) if shape is not None else [value]
        summary.problems.append(f"{name}: one value for {batch} samples (given to each)")
        return list(one or [None]) * batch
    column = host_column(value)
    if column is None:
        return None
    if len(column) != batch:
        summary.problems.append(f"{name}: {len(column)} values for {batch} samples (alignment partial)")
        column = (column + [None] * batch)[:batch]
    return column


def _token_values(name: str, value: Any, ids: Layout, mask: Layout | None, batch: int,
                  summary: TokenBatchSummary, reduce: str) -> list[Any] | None:
    """Rewards/advantages given per sample ([B]) or per token ([B, L]: summed / averaged)."""
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 2 or (isinstance(value, (list, tuple)) and value
                                                  and isinstance(value[0], (list, tuple))):
        import numpy as np

        from otel_rollouts.decode.layout import field_layout

        misfit: dict[int, str] = {}  # a misshapen reward column leaves the tokens usable
        layout = field_layout(name, value, ids, np.float64, misfit)
        if misfit:
            summary.problems.append(f"{name}: per-token values do not match input_ids ({len(misfit)} samples)")
        if layout is None:
            return None
        out: list[Any] = []
        for i in range(batch):
            if i in misfit:
                out.append(None)
                continue
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


@takes_instance
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
    attributes: Sequence[Mapping[str, Any] | None] | None = None,
    logprobs: Any = None,
    trainer_logprobs: Any = None,
    rollouts: _runtime.Runtime | None = None,
) -> TokenBatchSummary:
    """Record one episode per sample of a token-id batch; decode only the episodes that are kept.

    ``input_ids``: a padded 2-D tensor/array (``attention_mask`` marks the real tokens, left or
    right padding), or a list of 1-D tensors / arrays / lists of ints. ``loss_mask`` has the same
    shape: 1 = generated by the policy. Its first 0-run is the prompt (split into system/user
    messages by the chat template's role markers), each 1-run an assistant turn, each later 0-run
    the feedback to the turn before it (a tool result when that turn made a parseable tool call).
    ``versions`` (per token, −1 on prompt tokens) gives ``rl.policy.version`` from generated
    tokens only, with ``rl.policy.version_min/max`` when they differ. ``rewards``/``advantages``
    are per sample, or per token (rewards summed, advantages averaged over generated tokens).
    ``finish_reasons`` default to ``stop`` (last generated token is an EOS) or ``length`` (the
    sample reached ``max_length``, or the right edge of a right-padded batch).

    ``logprobs`` / ``trainer_logprobs``: the inference engine's and the trainer's logprob of
    each token, laid out like ``input_ids`` (or ``[B, R]``: the last R columns of a 2-D
    ``input_ids``, a response-only tensor), read where ``loss_mask`` is 1. With both, every
    sample's train–inference mismatch statistics (``rl.mismatch.*``) are computed in one
    vectorised pass (what the ``mismatch`` policy part ranks by and the step's percentiles
    summarise); a kept sample's generations get their own statistics and worst tokens, at export.

    ``attributes``: per sample, extra attributes for the episode root (e.g. an adapter's
    ``rl.alignment.kind``: "partial"). Returns a ``TokenBatchSummary``. A sample whose masks do not match its ids is refused with a
    reason naming it (recorded as an error episode); the rest of the batch is still recorded.

    ``rollouts``: the instance to record into (``otr.configure(install=False)``); default: the
    one active in this context (``Rollouts.activate()``), else the installed one.
    """
    summary = TokenBatchSummary()
    rt = _runtime.current()
    if not rt.enabled or rt.pipeline is None:
        return summary
    info = tokenizer_info(tokenizer)
    eos_ids = frozenset(int(x) for x in eos_token_ids) if eos_token_ids is not None else info.eos_ids
    # 1. the batch's arrays, read once (problems noted and reported)
    cols = _read_columns(
        input_ids, attention_mask, loss_mask, versions, summary,
        logprobs=logprobs, trainer_logprobs=trainer_logprobs, options=rt.mismatch, rewards=rewards,
        advantages=advantages, reward_components=reward_components, group_ids=group_ids,
        episode_ids=episode_ids, sample_indices=sample_indices, finish_reasons=finish_reasons,
        statuses=statuses, dataset_indices=dataset_indices, metadata=metadata, attributes=attributes,
    )
    # 2. its structure, vectorised over the batch; what each sample's episode reads from it
    rows = _TokenRows(cols, info, eos_ids, max_length, model, rt.capture_content, skip_special_tokens)
    for i, reason in sorted(cols.refused.items()):  # reported whether or not the sample is kept
        summary.refused.append((i, reason))
        report(f"record_token_batch: {reason}")
    # 3. the batch offered to the sampler as columns; the rows it may keep built as episodes
    versions_col: Any = cols.per_sample_versions
    if rows.vrange is not None:  # read for the recorded samples only
        versions_col = _Lazy(rows.version)
    offered = Rows(
        cols.batch, step, split,
        rewards=cols.rewards, advantages=cols.advantages, group_ids=cols.group_ids,
        sample_indices=cols.sample_indices, episode_ids=cols.episode_ids, policy_versions=versions_col,
        dataset_indices=cols.dataset_indices, statuses=rows.statuses, dataset_name=dataset_name,
        framework=framework, metadata=cols.metadata,
        scores=None if cols.mismatch is None else cols.mismatch.columns,
    )
    _, failed = record_rows(offered, rows.build)
    summary.recorded = cols.batch - len(failed)  # offered to the sampler as episodes
    for i, reason in failed:
        summary.refused.append((i, reason))
    return summary


@dataclass(frozen=True, slots=True)
class _Columns:
    """A token batch's arrays, read once (``_read_columns``): the ids' layout and the samples
    refused, the per-token loss mask and versions laid out like the ids, the mismatch statistics,
    and the per-sample columns aligned to the batch (``None``: not given)."""

    ids: Layout
    refused: dict[int, str]  # sample -> why its tokens are unusable
    batch: int
    mask: Layout | None
    vers: Layout | None  # per-token versions
    per_sample_versions: list[Any] | None  # versions given one per sample
    mismatch: _Mismatch | None
    rewards: list[Any] | None
    advantages: list[Any] | None
    components: list[dict[str, Any] | None] | None
    group_ids: list[Any] | None
    episode_ids: list[Any] | None
    sample_indices: list[Any] | None
    finish_reasons: list[Any] | None
    statuses: list[Any] | None
    dataset_indices: list[Any] | None
    metadata: Mapping[str, Any] | list[Any] | None  # one mapping for every sample, or one per sample
    attributes: list[Any] | None


def _read_columns(input_ids: Any, attention_mask: Any, loss_mask: Any, versions: Any,
                  summary: TokenBatchSummary, *, logprobs: Any, trainer_logprobs: Any,
                  options: MismatchOptions, rewards: Any, advantages: Any, reward_components: Any,
                  group_ids: Any, episode_ids: Any, sample_indices: Any, finish_reasons: Any,
                  statuses: Any, dataset_indices: Any, metadata: Any, attributes: Any) -> _Columns:
    """``record_token_batch``'s arguments read into a ``_Columns``; the batch-level problems
    are added to ``summary`` and reported (the refused samples are reported by the caller)."""
    import numpy as np

    from otel_rollouts.decode.layout import field_layout, layout_of

    # the ids and versions of a batch already on the host are read in place, not copied: only
    # the samples recorded as episodes are, before record_token_batch returns
    ids, refused = layout_of(input_ids, attention_mask, view=True)
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
            vers = field_layout("versions", versions, ids, np.int32, refused, view=True)

    mismatch = None
    if logprobs is not None and trainer_logprobs is not None and mask is not None:
        mismatch = _Mismatch.of(logprobs, trainer_logprobs, ids, mask, options, summary)
    reward_col = _token_values("rewards", rewards, ids, mask, batch, summary, "sum")
    advantage_col = _token_values("advantages", advantages, ids, mask, batch, summary, "mean")
    components = _components(reward_components, batch, summary)
    group_col = _per_sample("group_ids", group_ids, batch, summary)
    episode_col = _per_sample("episode_ids", episode_ids, batch, summary)
    index_col = _per_sample("sample_indices", sample_indices, batch, summary)
    finish_col = _per_sample("finish_reasons", finish_reasons, batch, summary)
    status_col = _per_sample("statuses", statuses, batch, summary)
    dataset_col = _per_sample("dataset_indices", dataset_indices, batch, summary)
    meta: Mapping[str, Any] | list[Any] | None = metadata  # one mapping for every sample
    if not (isinstance(metadata, Mapping) or metadata is None):
        meta = _per_sample("metadata", metadata, batch, summary)
    attr_col = _per_sample("attributes", attributes, batch, summary)
    for problem in summary.problems:
        report(f"record_token_batch: {problem}")
    return _Columns(ids, refused, batch, mask, vers, per_sample_versions, mismatch, reward_col,
                    advantage_col, components, group_col, episode_col, index_col, finish_col,
                    status_col, dataset_col, meta, attr_col)


class _TokenRows:
    """A token batch's structure, computed once and vectorised over the batch (loss-mask run
    edges, generated-token version ranges, right padding, last columns), and what each sample's
    episode reads from it: ``bounds`` (segment edges), ``finish_of``, ``status_of``; ``build``
    records a sample the sampler may keep. ``status_of`` runs for every sample of the batch (the
    sampler reads the statuses): the hot path, so what it reads is held here, not looked up."""

    __slots__ = ("cols", "refused", "finish_col", "status_col", "n_list", "s_list", "mask", "edges",
                 "lo", "hi", "ms_list", "first_values", "vrange", "right_padded", "last_col",
                 "flat_ids", "width", "info", "eos_ids", "max_length", "model", "capture",
                 "skip_special")
    cols: _Columns
    refused: dict[int, str]
    finish_col: list[Any] | None
    status_col: list[Any] | None
    n_list: list[int]
    s_list: list[int]
    mask: Layout | None
    edges: np.ndarray  # flat positions where the loss mask changes value (mask given)
    lo: list[int]  # sample i's edges are edges[lo[i] : hi[i]] (mask given)
    hi: list[int]
    ms_list: list[int]
    first_values: list[Any]  # loss-mask value of each sample's first token (mask given)
    vrange: _VersionRanges | None
    right_padded: bool
    last_col: list[int] | None
    flat_ids: np.ndarray
    width: int | None
    info: _TokenizerInfo
    eos_ids: frozenset[int]
    max_length: int | None
    model: str | None
    capture: bool
    skip_special: bool

    def __init__(self, cols: _Columns, info: _TokenizerInfo, eos_ids: frozenset[int], max_length: int | None,
                 model: str | None, capture: bool, skip_special: bool) -> None:
        import numpy as np

        ids, mask, batch = cols.ids, cols.mask, cols.batch
        self.cols, self.refused, self.mask = cols, cols.refused, mask
        self.finish_col, self.status_col = cols.finish_reasons, cols.statuses
        self.n_list = ids.lengths.tolist()
        self.s_list = ids.starts.tolist()
        if mask is not None:
            mflat = mask.flat
            self.edges = edges = np.flatnonzero(mflat[1:] != mflat[:-1]) + 1
            self.lo = np.searchsorted(edges, mask.starts, side="right").tolist()
            self.hi = np.searchsorted(edges, mask.starts + mask.lengths, side="left").tolist()
            self.ms_list = mask.starts.tolist()
            self.first_values = (mflat[np.minimum(mask.starts, max(len(mflat) - 1, 0))].tolist()
                                 if len(mflat) else [False] * batch)
        else:  # never read: every sample has no segments
            self.edges, self.lo, self.hi, self.ms_list, self.first_values = ids.flat[:0], [], [], [], []
        self.vrange = _VersionRanges(cols.vers, mask) if cols.vers is not None and mask is not None else None
        self.right_padded = (
            ids.width is not None and ids.last_column is not None
            and bool(np.any((ids.lengths > 0) & (ids.last_column < ids.width - 1)))
        )
        self.last_col = ids.last_column.tolist() if ids.last_column is not None else None
        self.flat_ids = ids.flat
        self.width = ids.width
        self.info, self.eos_ids, self.max_length = info, eos_ids, max_length
        self.model = str(model) if model is not None else None
        self.capture, self.skip_special = capture, skip_special

    def bounds(self, i: int) -> list[int]:
        """Sample ``i``'s loss-mask segment edges, from 0 to its length ([] without tokens or mask)."""
        n = self.n_list[i]
        return ([0, *(self.edges[self.lo[i] : self.hi[i]] - self.ms_list[i]).tolist(), n]
                if n and self.mask is not None else [])

    def finish_of(self, i: int) -> str | None:
        """The finish reason: given, else ``stop`` after an EOS, ``length`` at the limit."""
        finish = None if self.finish_col is None else self.finish_col[i]
        n = self.n_list[i]
        if finish is not None or i in self.refused or not n or self.mask is None:
            return finish
        bounds = self.bounds(i)
        first_value = bool(self.first_values[i])
        if len(bounds) > 1 + (0 if first_value else 1):  # something was generated
            s = self.s_list[i]
            last = bounds[-1] if (len(bounds) - 1) % 2 == (1 if first_value else 0) else bounds[-2]
            last_col = self.last_col
            finish = _infer_finish(int(self.flat_ids[s + last - 1]) in self.eos_ids, n, self.max_length,
                                   self.right_padded, last_col[i] if last_col else None, self.width)
        return finish

    def given_status(self, i: int, finish: str | None) -> Any:
        """The status handed to ``Episode.finish``: as given, else ``truncated`` at the limit."""
        given = None if self.status_col is None else self.status_col[i]
        return c.STATUS_TRUNCATED if given is None and finish == FINISH_LENGTH else given

    def status_of(self, i: int) -> str | None:
        """The ``rl.status`` the sample's episode will hold (what the sampler reads)."""
        if i in self.refused:
            return c.STATUS_ERROR
        return status_value(self.given_status(i, self.finish_of(i)))

    def statuses(self) -> list[str | None]:
        """Every sample's ``rl.status`` (read by the sampler when it needs them)."""
        status_of = self.status_of
        return [status_of(i) for i in range(self.cols.batch)]

    def version(self, i: int) -> int | None:
        """Sample ``i``'s ``rl.policy.version``: the newest over its generated tokens."""
        vrange = self.vrange
        return None if i in self.refused or vrange is None else vrange[i][1]

    def build(self, i: int, ep: Any) -> None:
        """Record sample ``i`` into ``ep`` (a row the sampler may keep): attributes, its lazy
        body (a copy of its ids), mismatch, reward and finish."""
        import numpy as np

        cols = self.cols
        extra = None if cols.attributes is None else cols.attributes[i]
        if isinstance(extra, Mapping):
            for key, value in extra.items():
                ep.set_attribute(str(key), value)
        reason = self.refused.get(i)
        if reason is not None:
            ep.set_attribute(c.RL_INVALID_FIELDS, [reason])
            _finish_reward(ep, i, cols.rewards, cols.advantages, cols.components, None, c.STATUS_ERROR, reason)
            return
        vrange = self.vrange
        if cols.per_sample_versions is None and vrange is not None:
            vmin, vmax = vrange[i]
            if vmin is not None and vmin != vmax:  # several policy versions: staleness
                ep.set_attribute(c.RL_POLICY_VERSION_MIN, vmin)
                ep.set_attribute(c.RL_POLICY_VERSION_MAX, vmax)
        s, n = self.s_list[i], self.n_list[i]
        bounds = self.bounds(i)
        first_value = bool(self.first_values[i]) if n and self.mask is not None else False
        generated = len(bounds) > 1 + (0 if first_value else 1)
        finish = self.finish_of(i)
        root = ep.root
        if isinstance(root, SpanRecord):
            own = np.array(self.flat_ids[s : s + n], dtype=np.int32)  # a copy: the caller's buffer may change
            body = _body(root, self.info, own, bounds, first_value, self.skip_special,
                         self.model, finish, self.capture, self.eos_ids)
            if cols.mismatch is not None:
                cols.mismatch.record(i, root, body, s, n)
            if self.capture and generated:
                root.set_attribute(c.RL_TOOL_PARSE_ERROR, Entry(body.decoded, "errors"))
        _finish_reward(ep, i, cols.rewards, cols.advantages, cols.components, finish,
                       self.given_status(i, finish), None)


def _body(root: SpanRecord, info: _TokenizerInfo, ids: np.ndarray, bounds: list[int], first_value: bool,
          skip_special: bool, model: str | None, finish: str | None, capture: bool,
          eos_ids: frozenset[int]) -> _EpisodeBody:
    """Add the episode's lazy body under its root span."""
    record = root.episode
    body = _EpisodeBody(record, c.SPAN_TURN, _runtime.new_id64(), root.span_id, c.KIND_SPAN, {})
    body.info, body.ids, body.bounds, body.first_value = info, ids, bounds, first_value
    body.skip_special, body.model, body.finish, body.capture = skip_special, model, finish, capture
    body.eos_ids, body._decoded = eos_ids, None
    body.logprobs = body.options = None
    record.add(body)
    body.end()
    return body


class _Mismatch:
    """A batch's train–inference mismatch: every sample's statistics from one vectorised pass
    (``columns``: what the sampler ranks by), and, for the samples recorded as episodes, their
    root attributes and a copy of their logprobs for the body's generations (``record``)."""

    def __init__(self, rollout: np.ndarray, trainer: np.ndarray, offset: int, width: int | None,
                 totals: RowTotals, options: MismatchOptions) -> None:
        # 2-D: rows of ``width - offset`` columns standing for input_ids' columns offset..width;
        # flat (ragged): laid out like input_ids' flat array (offset 0, width None)
        self.rollout, self.trainer, self.offset, self.width = rollout, trainer, offset, width
        self.totals, self.options = totals, options
        self.columns = totals.columns()

    @classmethod
    def of(cls, logprobs: Any, trainer_logprobs: Any, ids: Layout, mask: Layout,
           options: MismatchOptions, summary: TokenBatchSummary) -> _Mismatch | None:
        import numpy as np

        from otel_rollouts.decode.layout import field_layout

        batch = len(ids.starts)
        rollout, _ = read_array(logprobs, "logprobs")  # a ragged list is read below
        trainer, _ = read_array(trainer_logprobs, "trainer_logprobs")
        if (rollout is not None and trainer is not None and rollout.ndim == 2 and ids.width is not None
                and rollout.shape == trainer.shape and rollout.shape[0] == batch
                and 0 < rollout.shape[1] <= ids.width):
            width = ids.width
            offset = width - rollout.shape[1]  # a response-only tensor: the last columns
            rows = mask.flat.reshape(batch, width)[:, offset:]
            totals = row_totals(rollout, trainer, rows, options)
            return cls(rollout, trainer, offset, width, totals, options)
        if ids.width is None:  # ragged: laid out like the ids (and so like the loss mask)
            refused: dict[int, str] = {}
            lr = field_layout("logprobs", logprobs, ids, np.float32, refused)
            lt = field_layout("trainer_logprobs", trainer_logprobs, ids, np.float32, refused)
            if (lr is not None and lt is not None and not refused and np.array_equal(lr.starts, mask.starts)
                    and np.array_equal(lr.lengths, mask.lengths) and np.array_equal(lt.lengths, mask.lengths)):
                totals = row_totals(lr.flat, lt.flat, mask.flat, options, starts=mask.starts)
                return cls(lr.flat, lt.flat, 0, None, totals, options)
        def shape(value: Any) -> Any:
            return tuple(getattr(value, "shape", ())) or type(value).__name__

        summary.problems.append(
            f"logprobs/trainer_logprobs: shapes {shape(logprobs)} and {shape(trainer_logprobs)} do not "
            f"match input_ids ({batch} samples{'' if ids.width is None else f' x {ids.width}'}): "
            "no mismatch recorded")
        return None

    def record(self, i: int, root: SpanRecord, body: _EpisodeBody, start: int, n: int) -> None:
        """Sample ``i``'s root statistics, and its logprobs (copies) for its body's generations."""
        import numpy as np

        totals = self.totals.row(i)
        if totals.n <= 0:
            return
        root.attributes.update(totals.attributes(self.options))
        record = root.episode
        record.mismatch = totals
        own = []
        for source in (self.rollout, self.trainer):
            if self.width is None:
                own.append(np.array(source[start : start + n], dtype=np.float32))
                continue
            row = i * self.width
            first = start - row  # the sample's first column in input_ids
            values = np.full(n, np.nan, dtype=np.float32)
            lo = max(self.offset - first, 0)
            if lo < n:
                values[lo:] = source[i, first + lo - self.offset : first + n - self.offset]
            own.append(values)
        body.logprobs = (own[0], own[1])
        body.options = self.options


class _VersionRanges:
    """(min, max) policy version over a sample's generated tokens, −1 placeholders ignored;
    read for the samples recorded as episodes only."""

    def __init__(self, vers: Layout, mask: Layout) -> None:
        self.vers, self.mask = vers, mask

    def __getitem__(self, i: int) -> tuple[int | None, int | None]:
        vers, mask = self.vers, self.mask
        vs, ms, n = int(vers.starts[i]), int(mask.starts[i]), int(vers.lengths[i])
        if int(mask.lengths[i]) != n:
            return (None, None)
        gen = vers.flat[vs : vs + n][mask.flat[ms : ms + n]]
        gen = gen[gen >= 0]
        return (int(gen.min()), int(gen.max())) if gen.size else (None, None)


class _Lazy:
    """A per-sample column computed for the samples that are read."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, i: int) -> Any:
        return self.fn(i)


def _infer_finish(ends_with_eos: bool, n: int, max_length: int | None, right_padded: bool,
                  last_column: int | None, width: int | None) -> str | None:
    """``stop`` after an EOS; ``length`` at ``max_length`` or the right edge of a right-padded batch."""
    if ends_with_eos:
        return FINISH_STOP
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
