"""Kept episodes as a dataset: rows for training and analysis, as Parquet and a Hugging Face dataset.

One row per kept episode (``messages``, ``flat``) or per kept group (``pairs``), built from the
episode's spans (an OTLP/JSON file, the spool, or live as an exporter) or from the trace a
``TrackioExporter`` stored. Both read the same facts of an episode (its root's ``rl.*`` values,
its conversation as the Trackio exporter writes it, its spans' kinds, token counts and times), so
one episode gives the same row from either source.

Formats (``SCHEMA_VERSION`` names this layout; a change of a column bumps it):

* ``messages``: every column of ``flat`` plus ``prompt`` (the messages before the first
  assistant message), ``completion`` (the rest) and ``messages`` (the whole conversation), each a
  list of chat messages ``{role, content, name, tool_call_id, tool_calls}`` in OpenAI's shape, the
  shape TRL's SFT trainer reads (``messages``, or ``prompt``/``completion``).
* ``pairs``: per kept group (run, step, split, group) with at least two rewarded episodes of
  different rewards and the same prompt: ``prompt``, ``chosen`` (completion of the best),
  ``rejected`` (of the worst), their rewards, trace ids and links: TRL's preference shape.
* ``flat``: scalar columns only, for pandas or DuckDB.

``DatasetExporter`` writes the rows of a live run as episodes are kept; ``otel-rollouts
dataset`` (``otel_rollouts.build_dataset``) builds them afterwards from where episodes landed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core.content import exception_text
from otel_rollouts._core.messages import as_text
from otel_rollouts._core.values import fits_int64
from otel_rollouts.exporters._trackio_rows import (
    META_SPAN_ERRORS,
    META_TRACE_ID,
    episode_messages,
    is_snapshot,
)
from otel_rollouts.exporters._tree import (
    by_trace,
    hex_id,
    is_error,
    kind_of,
    parse,
    root_of,
    trace_link,
)

__all__ = [
    "FORMATS",
    "SCHEMA_VERSION",
    "DatasetExporter",
    "Episode",
    "Filters",
    "RowWriter",
    "Shaper",
    "episode_from_spans",
    "episode_from_trackio",
    "schema",
]

logger = logging.getLogger("otel_rollouts")

SCHEMA_VERSION = 2
FORMAT_MESSAGES, FORMAT_PAIRS, FORMAT_FLAT = "messages", "pairs", "flat"
FORMATS = (FORMAT_MESSAGES, FORMAT_PAIRS, FORMAT_FLAT)
# the Parquet file's key-value metadata (and the Hugging Face dataset's description)
META_SCHEMA_VERSION = "otel_rollouts.schema_version"
META_FORMAT = "otel_rollouts.format"

# why an episode gave no row (counted per reason; the first example of each is kept)
SKIP_FRAGMENT = "only late spans of an episode (no episode span)"
SKIP_FOREIGN = "not an otel_rollouts episode (no trace id or rl.* values)"
SKIP_SNAPSHOT = "a running episode's snapshot (not a kept episode)"
SKIP_DUPLICATE = "the same episode again (a trace id already read)"
SKIP_NO_REWARD = "no reward (a training set needs one)"
SKIP_ONE_MEMBER = "pairs: a group with fewer than two rewarded episodes"
SKIP_NO_SPREAD = "pairs: a group whose episodes all have the same reward"
SKIP_PROMPTS_DIFFER = "pairs: the best and the worst episode of a group have different prompts"
SKIP_LATE_MEMBER = "pairs: a group member read after its group was written"
FLAGGED = "a value of the wrong type, written as null"

# how many trace ids (and written groups) are remembered to tell a repeat or a late member: the
# newest ones, about 10 MiB at most (a repeat comes soon after: a spool batch sent again)
REMEMBERED = 65_536

_STAGE_COLUMNS = {stage: f"{stage}_seconds" for stage in c.STAGES}
_MISMATCH_INT = {"mismatch_tokens": c.RL_MISMATCH_TOKENS, "mismatch_tokens_outside": c.RL_MISMATCH_OUTSIDE}
_MISMATCH_FLOAT = {
    "mismatch_kl": c.RL_MISMATCH_KL,
    "mismatch_abs_mean": c.RL_MISMATCH_ABS_MEAN,
    "mismatch_abs_max": c.RL_MISMATCH_ABS_MAX,
    "mismatch_ratio_min": c.RL_MISMATCH_RATIO_MIN,
    "mismatch_ratio_max": c.RL_MISMATCH_RATIO_MAX,
}


# --- the facts of one episode -----------------------------------------------------------------
@dataclass
class Episode:
    """What a row is made of, the same whichever source it was read from."""

    trace_id: str  # 32 hex digits
    values: dict[str, object]  # the episode span's rl.* values (JSON text parsed)
    messages: list[dict[str, object]]  # the conversation in OpenAI's shape
    start_us: int | None = None  # the episode span's start and end (µs since the epoch)
    end_us: int | None = None
    turns: int = 0
    tool_calls: int = 0
    failed_spans: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    problems: list[str] = field(default_factory=list)  # values written as null, and why


def _add(total: int | None, value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if total is None else total + value
    return total


def episode_from_spans(spans: Sequence[ReadableSpan]) -> Episode | str:
    """The facts of one trace's spans, or why it gives no row (``SKIP_*``)."""
    root = root_of(spans)
    if root is None:
        return SKIP_FRAGMENT
    attrs = c.current_names(root.attributes or {})  # an earlier release's names, as today's
    values = {key: parse(value) for key, value in attrs.items()
              if key.startswith(c.RL_PREFIX) and key != c.RL_SPAN_KIND}
    episode = Episode(hex_id(root.context.trace_id, 32), values, episode_messages(spans))
    if root.start_time is not None:
        episode.start_us = root.start_time // 1000
    if root.end_time is not None:
        episode.end_us = root.end_time // 1000
    for span in spans:
        kind = kind_of(span)
        span_attrs = span.attributes or {}
        if kind == c.KIND_TURN:
            episode.turns += 1
        elif kind == c.KIND_TOOL:
            episode.tool_calls += 1
        elif kind == c.KIND_GENERATION:
            episode.input_tokens = _add(episode.input_tokens, span_attrs.get(c.GEN_AI_USAGE_INPUT_TOKENS))
            episode.output_tokens = _add(episode.output_tokens, span_attrs.get(c.GEN_AI_USAGE_OUTPUT_TOKENS))
        elif kind == c.KIND_REWARD and c.RL_REWARD not in values:
            # a reward recorded after the decision reaches the file as a late span only
            for key, value in c.current_names(span_attrs).items():
                if key == c.RL_REWARD or key == c.RL_ADVANTAGE or key.startswith(c.RL_REWARD_COMPONENT_PREFIX):
                    values.setdefault(key, value)
        if is_error(span):
            episode.failed_spans += 1
    return episode


def _iso_us(value: object) -> int | None:
    """An ISO 8601 time the Trackio exporter wrote (``iso_utc``) as µs since the epoch."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    whole = int(moment.replace(microsecond=0).timestamp())
    return whole * 1_000_000 + moment.microsecond


def episode_from_trackio(trace: Mapping[str, object]) -> Episode | str:
    """The facts of one trace as ``SQLiteStorage.get_traces`` returns it (``messages``,
    ``metadata``, ``spans``), or why it gives no row."""
    metadata = trace.get("metadata")
    if not isinstance(metadata, Mapping):
        return SKIP_FOREIGN
    metadata = c.current_names(metadata)  # an earlier release's names, as today's
    if is_snapshot(metadata):
        return SKIP_SNAPSHOT
    trace_id = metadata.get(META_TRACE_ID)
    values = {key: value for key, value in metadata.items() if isinstance(key, str) and key.startswith(c.RL_PREFIX)}
    if not isinstance(trace_id, str) or len(trace_id) != 32 or c.RL_STEP not in values:
        return SKIP_FOREIGN
    messages = trace.get("messages")
    items = trace.get("spans")
    episode = Episode(trace_id, values, [m for m in messages if isinstance(m, dict)]
                      if isinstance(messages, list) else [])
    errors = metadata.get(META_SPAN_ERRORS)
    episode.failed_spans = len(errors) if isinstance(errors, list) else 0
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        more = item.get("metadata")
        kind = more.get(c.RL_SPAN_KIND) if isinstance(more, Mapping) else None
        kind = kind if isinstance(kind, str) else item.get("kind")
        if kind == c.KIND_EPISODE and item.get("parent_id") is None:
            episode.start_us = _iso_us(item.get("start_time"))
            episode.end_us = _iso_us(item.get("end_time"))
        elif kind == c.KIND_TURN:
            episode.turns += 1
        elif kind == c.KIND_TOOL:
            episode.tool_calls += 1
        elif kind == c.KIND_GENERATION:
            usage = item.get("usage")
            if isinstance(usage, Mapping):
                episode.input_tokens = _add(episode.input_tokens, usage.get("input_tokens"))
                episode.output_tokens = _add(episode.output_tokens, usage.get("output_tokens"))
    return episode


# --- rows -------------------------------------------------------------------------------------
def _message(message: Mapping[str, object]) -> dict[str, object]:
    """One chat message with exactly the schema's fields (others are not kept)."""
    calls = message.get("tool_calls")
    out_calls = None
    if isinstance(calls, list):
        out_calls = []
        for call in calls:
            if not isinstance(call, Mapping):
                continue
            found = call.get("function")
            function: Mapping[str, object] = found if isinstance(found, Mapping) else {}
            arguments = function.get("arguments")
            out_calls.append({
                "id": _text(call.get("id")),
                "type": _text(call.get("type")) or "function",
                "function": {"name": _text(function.get("name")),
                             "arguments": _text(arguments)},
            })
    content = message.get("content")
    return {
        "role": _text(message.get("role")) or "user",
        "content": content if isinstance(content, str) else "" if content is None else as_text(content),
        "name": _text(message.get("name")),
        "tool_call_id": _text(message.get("tool_call_id")),
        "tool_calls": out_calls,
    }


def _text(value: object) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else as_text(value)


class _Reader:
    """Typed reads of an episode's values: a value of the wrong type is null and said so."""

    def __init__(self, episode: Episode) -> None:
        self.values = episode.values
        self.problems = episode.problems

    def _bad(self, key: str, value: object, wanted: str) -> None:
        self.problems.append(f"{key}: expected {wanted}, got {type(value).__name__}")

    def int(self, key: str) -> int | None:
        value = self.values.get(key)
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and fits_int64(value):
            return value
        self._bad(key, value, "an integer")
        return None

    def float(self, key: str) -> float | None:
        value = self.values.get(key)
        if value is None:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        self._bad(key, value, "a number")
        return None

    def text(self, key: str) -> str | None:
        value = self.values.get(key)
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return as_text(value)
        self._bad(key, value, "text")
        return None


def _split_conversation(messages: list[dict[str, object]]) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """(prompt, completion): the messages before the first assistant message, and the rest."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return messages[:i], messages[i:]
    return messages, []


def full_row(episode: Episode, trace_url: str | None = None) -> dict[str, object]:
    """Every column of the ``messages`` format (``flat`` is the same without the lists)."""
    read = _Reader(episode)
    messages = [_message(m) for m in episode.messages]
    prompt, completion = _split_conversation(messages)
    users = [m for m in prompt if m["role"] == "user"]
    answers = [m for m in completion if m["role"] == "assistant"]
    components = {key[len(c.RL_REWARD_COMPONENT_PREFIX):]: value for key, value in sorted(episode.values.items())
                  if key.startswith(c.RL_REWARD_COMPONENT_PREFIX)}
    duration = read.float(c.RL_DURATION_SECONDS)
    if duration is None and episode.start_us is not None and episode.end_us is not None:
        duration = (episode.end_us - episode.start_us) / 1e6
    row: dict[str, object] = {
        "run_id": read.text(c.RL_RUN_ID),
        "step": read.int(c.RL_STEP),
        "split": read.text(c.RL_SPLIT),
        "group_id": read.text(c.RL_GROUP_ID),
        "sample_index": read.int(c.RL_SAMPLE_INDEX),
        "episode_id": read.text(c.RL_EPISODE_ID),
        "trace_id": episode.trace_id,
        "link": trace_link(trace_url, int(episode.trace_id, 16)),
        "status": read.text(c.RL_STATUS),
        "finish_reason": read.text(c.RL_FINISH_REASON),
        "keep_reason": read.text(c.RL_KEEP_REASON),
        "reward": read.float(c.RL_REWARD),
        "reward_components": json.dumps(components, sort_keys=True, allow_nan=True) if components else None,
        "advantage": read.float(c.RL_ADVANTAGE),
        "policy_version": read.int(c.RL_POLICY_VERSION),
        "dataset_name": read.text(c.RL_DATASET_NAME),
        "dataset_index": read.text(c.RL_DATASET_INDEX),
        "prompt_text": users[-1]["content"] if users else None,
        "final_answer": answers[-1]["content"] if answers else None,
        "turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "failed_spans": episode.failed_spans,
        "input_tokens": episode.input_tokens,
        "output_tokens": episode.output_tokens,
        "start_time": episode.start_us,
        "duration_seconds": duration,
    }
    for stage, column in _STAGE_COLUMNS.items():
        row[column] = read.float(c.stage_seconds(stage))
    for column, key in _MISMATCH_INT.items():
        row[column] = read.int(key)
    for column, key in _MISMATCH_FLOAT.items():
        row[column] = read.float(key)
    row["prompt"], row["completion"], row["messages"] = prompt, completion, messages
    return row


_LISTS = ("prompt", "completion", "messages")


def schema(fmt: str) -> Any:
    """The Arrow schema of ``fmt`` (pyarrow imported here: only the dataset feature needs it)."""
    import pyarrow as pa

    text, integer, number = pa.string(), pa.int64(), pa.float64()
    call = pa.struct([("id", text), ("type", text),
                      ("function", pa.struct([("name", text), ("arguments", text)]))])
    message = pa.struct([("role", text), ("content", text), ("name", text), ("tool_call_id", text),
                         ("tool_calls", pa.list_(call))])
    chat = pa.list_(message)
    identity = [("run_id", text), ("step", integer), ("split", text), ("group_id", text)]
    if fmt == FORMAT_PAIRS:
        fields = [*identity, ("prompt", chat), ("chosen", chat), ("rejected", chat),
                  ("chosen_reward", number), ("rejected_reward", number), ("margin", number),
                  ("chosen_trace_id", text), ("rejected_trace_id", text),
                  ("chosen_link", text), ("rejected_link", text)]
    else:
        fields = [*identity, ("sample_index", integer), ("episode_id", text), ("trace_id", text),
                  ("link", text), ("status", text), ("finish_reason", text), ("keep_reason", text),
                  ("reward", number), ("reward_components", text), ("advantage", number),
                  ("policy_version", integer), ("dataset_name", text), ("dataset_index", text),
                  ("prompt_text", text), ("final_answer", text), ("turns", integer),
                  ("tool_calls", integer), ("failed_spans", integer), ("input_tokens", integer),
                  ("output_tokens", integer), ("start_time", pa.timestamp("us", tz="UTC")),
                  ("duration_seconds", number),
                  *((column, number) for column in _STAGE_COLUMNS.values()),
                  *((column, integer) for column in _MISMATCH_INT),
                  *((column, number) for column in _MISMATCH_FLOAT)]
        if fmt == FORMAT_MESSAGES:
            fields += [(name, chat) for name in _LISTS]
    return pa.schema(fields, metadata={META_SCHEMA_VERSION: str(SCHEMA_VERSION), META_FORMAT: fmt})


# --- which episodes, in which shape -----------------------------------------------------------
@dataclass(frozen=True)
class Filters:
    """Which episodes become rows: every given condition must hold (None: any)."""

    steps: tuple[int | None, int | None] | None = None  # inclusive; either end open
    splits: frozenset[str] | None = None
    statuses: frozenset[str] | None = None
    reasons: frozenset[str] | None = None  # why the tail sampler kept it (rl.trace.keep_reason)
    reward_min: float | None = None
    reward_max: float | None = None

    def keep(self, row: Mapping[str, Any]) -> bool:
        if self.steps is not None:
            low, high = self.steps
            step = row.get("step")
            if step is None or (low is not None and step < low) or (high is not None and step > high):
                return False
        if self.splits is not None and row.get("split") not in self.splits:
            return False
        if self.statuses is not None and row.get("status") not in self.statuses:
            return False
        if self.reasons is not None and row.get("keep_reason") not in self.reasons:
            return False
        if self.reward_min is not None or self.reward_max is not None:
            reward = row.get("reward")
            if reward is None or math.isnan(reward):
                return False
            if self.reward_min is not None and reward < self.reward_min:
                return False
            if self.reward_max is not None and reward > self.reward_max:
                return False
        return True


@dataclass
class Tally:
    """What happened to every episode read: rows written, filtered out, skipped by reason."""

    read: int = 0
    rows: int = 0
    filtered: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason -> its first occurrence
    flagged: int = 0  # values written as null (of the wrong type)
    flagged_example: str | None = None

    def flag(self, where: str, count: int = 1) -> None:
        self.flagged += count
        if self.flagged_example is None:
            self.flagged_example = where

    def skip(self, reason: str, where: str, count: int = 1) -> None:
        self.skipped[reason] += count
        self.examples.setdefault(reason, where)

    def lines(self) -> list[str]:
        """One line per kind of skip: how many, why, and the first one."""
        lines = [f"skipped {n} × {reason} (first: {self.examples.get(reason, '?')})"
                 for reason, n in self.skipped.most_common()]
        if self.flagged:
            lines.append(f"wrote {self.flagged} × {FLAGGED} (first: {self.flagged_example})")
        return lines


class Shaper:
    """Episodes in, rows of ``fmt`` out, filtered; ``pairs`` holds each group until its step is
    ``window_steps`` behind the newest step read of its run (or ``finish``): two rows per group,
    at most ``max_groups`` groups (the oldest written first past it)."""

    def __init__(self, fmt: str = FORMAT_MESSAGES, filters: Filters | None = None, *,
                 trace_url: str | None = None, window_steps: int = 2, max_groups: int = 4096,
                 tally: Tally | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.filters = filters or Filters()
        self.trace_url = trace_url
        self.window_steps = window_steps
        self.max_groups = max_groups
        self.tally = tally if tally is not None else Tally()
        self._seen: OrderedDict[str, None] = OrderedDict()  # trace ids read (bounded)
        # pairs: (run, step, split, group) -> [members, best row, worst row]
        self._groups: OrderedDict[tuple[Any, ...], list[Any]] = OrderedDict()
        self._written: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self._newest: dict[Any, int] = {}  # run id -> the newest step read of it

    def add(self, episode: Episode | str, where: str) -> list[dict[str, Any]]:
        """The rows ``episode`` completes (none, one, or a finished group's pair)."""
        tally = self.tally
        tally.read += 1
        if isinstance(episode, str):
            tally.skip(episode, where)
            return []
        if episode.trace_id in self._seen:
            tally.skip(SKIP_DUPLICATE, f"{where} (trace {episode.trace_id})")
            return []
        self._seen[episode.trace_id] = None
        if len(self._seen) > REMEMBERED:
            self._seen.popitem(last=False)
        row: dict[str, Any] = full_row(episode, self.trace_url)  # its values: read as the shape set them
        if episode.problems:
            tally.flag(f"{where} (trace {episode.trace_id}): {episode.problems[0]}", len(episode.problems))
        if not self.filters.keep(row):
            tally.filtered += 1
            return []
        if self.fmt == FORMAT_FLAT:
            for name in _LISTS:
                del row[name]
            return [row]
        if row["reward"] is None or math.isnan(row["reward"]):
            tally.skip(SKIP_NO_REWARD, f"{where} (trace {episode.trace_id})")
            return []
        if self.fmt == FORMAT_MESSAGES:
            return [row]
        return self._pair(row, where)

    def _pair(self, row: dict[str, Any], where: str) -> list[dict[str, Any]]:
        key = (row["run_id"], row["step"], row["split"], row["group_id"])
        if key in self._written:
            self.tally.skip(SKIP_LATE_MEMBER, f"{where} (trace {row['trace_id']})")
            return []
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = [0, row, row, where]
        else:
            if row["reward"] > group[1]["reward"]:
                group[1] = row
            if row["reward"] < group[2]["reward"]:
                group[2] = row
        group[0] += 1
        run, step = row["run_id"], row["step"]
        newest = self._newest.get(run)
        if step is not None and (newest is None or step > newest):
            newest = self._newest[run] = step
        out: list[dict[str, Any]] = []
        while len(self._groups) > self.max_groups:
            out.extend(self._close(*self._groups.popitem(last=False)))
        if newest is not None:
            # a run's steps only: another run (the next source, the next run of a Trackio
            # project) counts its steps from 0 again
            horizon = newest - self.window_steps
            for old in [k for k in self._groups if k[0] == run and k[1] is not None and k[1] < horizon]:
                out.extend(self._close(old, self._groups.pop(old)))
        return out

    def _close(self, key: tuple[Any, ...], group: list[Any]) -> list[dict[str, Any]]:
        self._written[key] = None
        if len(self._written) > REMEMBERED:
            self._written.popitem(last=False)
        members, best, worst, where = group
        if members < 2:
            self.tally.skip(SKIP_ONE_MEMBER, f"{where} (group {key[3]!r} of step {key[1]})", members)
            return []
        if best["reward"] == worst["reward"]:
            self.tally.skip(SKIP_NO_SPREAD, f"{where} (group {key[3]!r} of step {key[1]})", members)
            return []
        if best["prompt"] != worst["prompt"]:
            self.tally.skip(SKIP_PROMPTS_DIFFER, f"{where} (group {key[3]!r} of step {key[1]})", members)
            return []
        return [{
            "run_id": key[0], "step": key[1], "split": key[2], "group_id": key[3],
            "prompt": best["prompt"], "chosen": best["completion"], "rejected": worst["completion"],
            "chosen_reward": best["reward"], "rejected_reward": worst["reward"],
            "margin": best["reward"] - worst["reward"],
            "chosen_trace_id": best["trace_id"], "rejected_trace_id": worst["trace_id"],
            "chosen_link": best["link"], "rejected_link": worst["link"],
        }]

    def finish(self) -> list[dict[str, Any]]:
        """The rows of every group still held (the end of the input)."""
        out: list[dict[str, Any]] = []
        while self._groups:
            out.extend(self._close(*self._groups.popitem(last=False)))
        return out


# --- writing ----------------------------------------------------------------------------------
class RowWriter:
    """Rows to ``<out>/<format>.parquet`` (row groups of ``rows_per_group`` rows or about
    ``max_group_bytes`` of text, whichever comes first; memory holds one group) and, at ``close``,
    a Hugging Face dataset saved to ``<out>/hf`` built from that file (memory-mapped, not loaded).

    Both are written under temporary names in ``out`` (``.<format>.parquet.partial``,
    ``.hf.partial``) and given their final names only once both are complete: a run that fails
    (a disk that fills, an interrupt) leaves neither, removes what it wrote, and leaves a
    dataset already at the final names as it was; a complete one replaces it whole."""

    def __init__(self, out: str | os.PathLike[str], fmt: str, *, hf: bool = True,
                 rows_per_group: int = 512, max_group_bytes: int = 8 << 20) -> None:
        try:
            import pyarrow.parquet as pq
            if hf:
                import datasets  # noqa: F401 - needed at close: missing, said now
        except ImportError as exc:
            raise ImportError(f"the dataset feature needs pyarrow and datasets ({exc}): "
                              "pip install 'otel-rollouts[dataset]'") from exc

        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.fmt = fmt
        self.hf = hf
        self.rows_per_group = rows_per_group
        self.schema = schema(fmt)
        self.path = self.out / f"{fmt}.parquet"
        self.hf_path = self.out / "hf" if hf else None
        self._partial = self.out / f".{fmt}.parquet.partial"
        self._hf_partial = self.out / ".hf.partial"
        try:
            self._writer = pq.ParquetWriter(str(self._partial), self.schema)
        except BaseException:
            _remove(self._partial)
            raise
        self._rows: list[dict[str, object]] = []
        self._bytes = 0
        self.max_group_bytes = max_group_bytes
        self.written = 0
        self.closed = False

    def write(self, rows: Iterable[dict[str, object]]) -> None:
        for row in rows:
            self._rows.append(row)
            self._bytes += _row_bytes(row)
        if len(self._rows) >= self.rows_per_group or self._bytes >= self.max_group_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        import pyarrow as pa

        rows, self._rows, self._bytes = self._rows, [], 0
        self._writer.write_table(pa.Table.from_pylist([_arrow_row(r) for r in rows], schema=self.schema))
        self.written += len(rows)

    def close(self) -> None:
        """Complete both outputs, then give them their final names together. Whatever fails
        (the last row group, the Parquet footer, the Hugging Face save, a rename) raises, after
        the temporary files are removed: nothing half-written is left under any name."""
        if self.closed:
            return
        self.closed = True
        try:
            try:
                self.flush()
            finally:
                self._writer.close()  # (closed in any case: its file is removed below on failure)
            staged = [(self._partial, self.path)]
            if self.hf_path is not None:
                _save_hf(self._partial, self._hf_partial, self.schema, self.fmt)
                staged.append((self._hf_partial, self.hf_path))
            _swap_in(staged)
        except BaseException:
            self._discard()
            raise

    def abort(self) -> None:
        """Stop without a result: the temporary files are removed, the final names untouched.
        Never raises (it runs while another error is on its way)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - its file is removed anyway (a full disk: the footer fails)
            pass
        finally:
            self._discard()

    def _discard(self) -> None:
        """Remove the temporary outputs (what of them exists); never raises."""
        _remove(self._partial)
        _remove(self._hf_partial)


def _remove(path: Path) -> None:
    """Remove the file or directory tree at ``path`` if there is one; never raises."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _swap_in(staged: Sequence[tuple[Path, Path]]) -> None:
    """Rename each complete ``(temporary, final)`` into place, all or none: what is at a final
    name is set aside first, and put back (the new ones removed) if any rename fails; set aside
    copies are removed once all are in place."""
    aside: list[tuple[Path, Path]] = []  # (final, where its old content waits)
    placed: list[Path] = []
    try:
        for new, final in staged:
            if final.exists() or final.is_symlink():
                old = final.with_name(f".{final.name}.old")
                _remove(old)
                os.replace(final, old)
                aside.append((final, old))
            os.replace(new, final)
            placed.append(final)
    except BaseException:
        for final in placed:
            _remove(final)
        for final, old in aside:
            try:
                os.replace(old, final)
            except OSError:
                pass
        raise
    for _, old in aside:
        _remove(old)


def _row_bytes(row: Mapping[str, object]) -> int:
    """About what a row holds: its texts (messages' contents included)."""
    total = 512
    for value in row.values():
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):
            total += sum(len(m.get("content") or "") + 64 for m in value if isinstance(m, dict))
    return total


def _arrow_row(row: dict[str, object]) -> dict[str, object]:
    start = row.get("start_time")
    if isinstance(start, int):
        row = dict(row)
        row["start_time"] = datetime.fromtimestamp(start // 1_000_000, tz=timezone.utc).replace(
            microsecond=start % 1_000_000)
    return row


def _save_hf(parquet: Path, target: Path, arrow_schema: object, fmt: str) -> None:
    """``parquet`` as a Hugging Face dataset on disk (``datasets.load_from_disk(target)``);
    ``target`` is replaced, and removed again if the save fails."""
    import datasets
    import datasets.utils as hf_utils

    description = f"otel_rollouts kept episodes, format {fmt}, schema version {SCHEMA_VERSION}"
    # its own bars ("Generating train split", "Saving the dataset") would interleave with ours
    quiet = hf_utils.are_progress_bars_disabled()
    hf_utils.disable_progress_bars()
    try:
        _build_hf(datasets, parquet, target, arrow_schema, description)
    finally:
        if not quiet:
            hf_utils.enable_progress_bars()


def _build_hf(datasets: Any, parquet: Path, target: Path, arrow_schema: Any, description: str) -> None:
    with tempfile.TemporaryDirectory(prefix="otr-hf-") as cache:
        import pyarrow.parquet as pq

        if pq.ParquetFile(str(parquet)).metadata.num_rows == 0:
            features = datasets.Features.from_arrow_schema(arrow_schema)
            ds = datasets.Dataset.from_dict({name: [] for name in arrow_schema.names}, features=features)
        else:
            ds = datasets.Dataset.from_parquet(str(parquet), cache_dir=cache, keep_in_memory=False)
        ds.info.description = description
        _remove(target)
        try:
            ds.save_to_disk(str(target))
        except BaseException:
            _remove(target)
            raise


# --- live ---------------------------------------------------------------------------------------
class DatasetExporter(SpanExporter):
    """Kept episodes as dataset rows while the run goes: ``<out>/<format>.parquet`` and
    ``<out>/hf``, complete at ``shutdown`` (``otr.shutdown()``).

    Rows are written a row group at a time (``rows_per_group``, and at each ``force_flush``); the
    Parquet file gets its footer and its final name at shutdown, so a process that dies first
    leaves ``.<format>.parquet.partial``: rebuild the dataset from the OTLP file or the Trackio
    project with ``otel-rollouts dataset`` (they are the durable record). A span of an episode
    already written (a late span) is counted in ``tally.skipped``, not added."""

    def __init__(self, out: str | os.PathLike[str], format: str = FORMAT_MESSAGES, *,
                 filters: Filters | None = None, trace_ui_url: str | None = None, hf: bool = True,
                 rows_per_group: int = 512) -> None:
        import importlib.util

        missing = [m for m in ("pyarrow", *(("datasets",) if hf else ())) if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"DatasetExporter needs {' and '.join(missing)}: pip install 'otel-rollouts[dataset]'")
        # what makes it again in another process (render="process"): its arguments, not its file
        self._arguments: dict[str, Any] = {"out": os.fspath(out), "format": format, "filters": filters,
                           "trace_ui_url": trace_ui_url, "hf": hf, "rows_per_group": rows_per_group}
        self.tally = Tally()
        url = (trace_ui_url or os.environ.get(c.ENV_TRACE_UI_URL) or "").rstrip("/") or None
        self.shaper = Shaper(format, filters, trace_url=url, tally=self.tally)
        self._writer: RowWriter | None = None  # opened by the first row (or at shutdown)
        self._lock = threading.Lock()
        self._done = False

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return _rebuild_dataset_exporter, (self._arguments,)

    @property
    def writer(self) -> RowWriter:
        if self._writer is None:
            a = self._arguments
            self._writer = RowWriter(a["out"], a["format"], hf=a["hf"], rows_per_group=a["rows_per_group"])
        return self._writer

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            with self._lock:
                if self._done:
                    return SpanExportResult.FAILURE
                for trace_id, group in by_trace(spans).items():
                    where = f"live export (trace {hex_id(trace_id, 32)})"
                    rows = self.shaper.add(episode_from_spans(group), where)
                    if rows:
                        self.tally.rows += len(rows)
                        self.writer.write(rows)
            return SpanExportResult.SUCCESS
        except Exception as exc:  # noqa: BLE001 - an exporter never raises into delivery
            logger.warning("otel_rollouts: dataset export failed: %s", exception_text(exc))
            return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            with self._lock:
                if not self._done and self._writer is not None:
                    self._writer.flush()
            return True
        except Exception as exc:  # noqa: BLE001
            logger.warning("otel_rollouts: dataset flush failed: %s", exception_text(exc))
            return False

    def shutdown(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                last = self.shaper.finish()
                self.tally.rows += len(last)
                self.writer.write(last)
                self.writer.close()
                for line in self.tally.lines():
                    logger.info("otel_rollouts: dataset %s", line)
            except Exception as exc:  # noqa: BLE001
                logger.warning("otel_rollouts: dataset could not be completed: %s", exception_text(exc))


def _rebuild_dataset_exporter(arguments: dict[str, Any]) -> DatasetExporter:
    """A ``DatasetExporter`` made again from its arguments (``pickle``: the renderer process)."""
    return DatasetExporter(**arguments)
