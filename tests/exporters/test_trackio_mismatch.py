"""The tokens that disagree (issue 33), read back from Trackio's own SQLite storage: a batch where
a few samples are made to diverge on purpose (the trainer's logprob of chosen tokens moved by
several nats) is recorded with ``otr.record_token_batch`` and the ``mismatch`` policy part; the
step's ``rollouts/mismatch`` table lists the diverging samples' worst tokens on top, with their
positions, texts and both logprobs; the step table gains the episodes' statistics; the step's
``mismatch/*`` scalars reach Trackio. (Also used by ``test_trackio_mismatch_browser.py``, in a
child process: keep it importable.)
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import uuid
from typing import Any

import numpy as np
from test_trackio_exporter import trackio_tables
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter
from otel_rollouts.exporters import _trackio_rows as trackio_rows

QUESTION = "What is 17 * 23?"
ANSWERS = [
    "The answer is 391.",
    "Think step by step: 17 * 23 is 391.",
    "Use the calculator tool when you need arithmetic.",
    "The answer is 4.",
    "The quick brown fox jumps over the lazy dog.",
    "Please retry: your previous answer was wrong.",
    "The result was returned by the tool.",
    "What is 2 + 2? The answer is 4.",
]
# (sample, response position, Δ added to the trainer's logprob): made to diverge on purpose
DIVERGE = [(2, 3, -5.0), (5, 1, 3.0), (5, 6, -2.0)]
DELTA = trackio_rows.COLUMN_DELTA
DIVERGING = sorted({sample for sample, _, _ in DIVERGE})
NOISE = 1e-3  # every other token: the two sides agree to about this


def _readable(value: float) -> float:
    return float(f"{value:.4g}")


def batch(tokenizer: Any, step: int = 0, diverge: list[tuple[int, int, float]] = DIVERGE,
          seed: int = 0) -> dict[str, Any]:
    """A right-padded token batch (prompt | response), its loss mask, both sides' logprobs per
    token, and what is expected of each diverging token: sample -> [(position, text, rollout,
    trainer)] as floats the way they are exported (float32)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    responses = [tokenizer(a + "<|im_end|>", add_special_tokens=False)["input_ids"] for a in ANSWERS]
    width = len(prompt_ids) + max(len(r) for r in responses)
    B = len(ANSWERS)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((B, width), pad, dtype=np.int64)
    attention = np.zeros((B, width), dtype=np.int64)
    loss = np.zeros((B, width), dtype=np.int64)
    rng = np.random.default_rng(seed)
    rollout = (-rng.random((B, width)) * 2).astype(np.float32)
    trainer = (rollout + rng.normal(0, NOISE, (B, width))).astype(np.float32)
    start = len(prompt_ids)
    for i, response in enumerate(responses):
        ids[i, :start] = prompt_ids
        ids[i, start:start + len(response)] = response
        attention[i, :start + len(response)] = 1
        loss[i, start:start + len(response)] = 1
    expected: dict[int, list[tuple[int, str, float, float]]] = {}
    for sample, position, delta in diverge:
        trainer[sample, start + position] = rollout[sample, start + position] + np.float32(delta)
        token = tokenizer.decode([int(responses[sample][position])])
        expected.setdefault(sample, []).append((position, token, float(rollout[sample, start + position]),
                                                float(trainer[sample, start + position])))
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss, "logprobs": rollout,
            "trainer_logprobs": trainer, "expected": expected, "responses": responses}


def record(tokenizer: Any, step: int, data: dict[str, Any], *, logprobs: bool = True) -> None:
    """One step of ``data`` through ``otr.record_token_batch`` (rewards: the sample index / 10)."""
    extra = {"logprobs": data["logprobs"], "trainer_logprobs": data["trainer_logprobs"]} if logprobs else {}
    summary = otr.record_token_batch(data["input_ids"], tokenizer=tokenizer, step=step,
                                     loss_mask=data["loss_mask"], attention_mask=data["attention_mask"],
                                     rewards=np.arange(len(ANSWERS)) / 10, **extra)
    assert summary.recorded == len(ANSWERS) and not summary.refused, summary
    otr.end_step(step)


def run_diverging(project: str, keep: int = 3) -> tuple[TrackioExporter, dict[str, Any]]:
    """A run of one step whose samples ``DIVERGING`` disagree on purpose, kept by ``mismatch``
    (``keep`` episodes: the diverging ones, then the largest of the noise); flushed."""
    tokenizer = build_tokenizer()
    exporter = TrackioExporter(project, run="r")
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(keep, "mismatch"))
    data = batch(tokenizer)
    record(tokenizer, 0, data)
    assert otr.flush(60)
    return exporter, data


def _project(name: str) -> str:
    return f"otr-test-{name}-{uuid.uuid4().hex[:6]}"


def _metrics(project: str) -> dict[int, dict[str, Any]]:
    db = sqlite3.connect(os.path.join(os.environ["TRACKIO_DIR"], f"{project}.db"))
    try:
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    finally:
        db.close()
    out: dict[int, dict[str, Any]] = {}
    for step, metrics in rows:
        out.setdefault(step, {}).update(json.loads(metrics.decode() if isinstance(metrics, bytes) else metrics))
    return out


def test_the_mismatch_table_shows_the_diverging_tokens_on_top(otr_shutdown):
    project = _project("mismatch")
    exporter, data = run_diverging(project)
    ((step, rows),) = trackio_tables(project, "rollouts/mismatch")
    assert step == 0
    assert list(rows[0]) == [DELTA, "ratio", "token", "rollout logprob", "trainer logprob", "position",
                             "generation", "kept because", "question", "group", "sample", "trace id"]
    expected = sorted(((s, *e) for s, tokens in data["expected"].items() for e in tokens),
                      key=lambda e: -abs(e[4] - e[3]))
    top = rows[:len(expected)]
    for row, (sample, position, text, rollout, trainer) in zip(top, expected, strict=True):
        delta = trainer - rollout
        assert row["sample"] == sample and row["position"] == position, (row, sample, position)
        assert row["token"] == trackio_rows.token_text(text)
        assert row["rollout logprob"] == _readable(rollout) and row["trainer logprob"] == _readable(trainer)
        assert row[DELTA] == _readable(delta) and row["ratio"] == _readable(math.exp(delta))
        assert (row["generation"], row["kept because"]) == ("turn 0", c.REASON_MISMATCH)
    assert [round(r[DELTA]) for r in top] == [-5, 3, -2]
    # below them: the rest of the kept episodes' tokens, noise, |Δ| descending across the step
    rest = rows[len(expected):]
    assert rest and all(abs(r[DELTA]) < 0.01 for r in rest)
    deltas = [abs(r[DELTA]) for r in rows]
    assert deltas == sorted(deltas, reverse=True)
    assert {r["sample"] for r in rows} == {*DIVERGING, next(r["sample"] for r in rest)}  # 3 kept
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["trace id"]] = counts.get(r["trace id"], 0) + 1
    assert len(counts) == 3 and max(counts.values()) == trackio_rows.MISMATCH_PER_GENERATION
    # the step table: the episodes' statistics, next to why they were kept
    ((_, table),) = trackio_tables(project)
    by_sample = {r["sample"]: r for r in table}
    assert set(by_sample) == {r["sample"] for r in rows}
    for sample in DIVERGING:
        row = by_sample[sample]
        assert row["kept because"] == c.REASON_MISMATCH
        assert row["tokens outside band"] == 1 + (sample == 5)  # exp(-2), exp(3), exp(-5): outside (0.5, 2)
        assert row["max |\u0394|"] == _readable(max(abs(e[3] - e[2]) for e in data["expected"][sample]))
        assert isinstance(row["mismatch kl"], float) and row["mismatch kl"] > 0.1
    columns = list(table[0])
    assert columns[columns.index("kept because") + 1:][:3] == ["mismatch kl", "max |\u0394|", "tokens outside band"]
    assert exporter.table_failures == 0


def test_the_steps_mismatch_scalars_reach_trackio(otr_shutdown):
    project = _project("mismatch-scalars")
    run_diverging(project)
    metrics = _metrics(project)[0]
    for stat in c.MISMATCH_STEP_STATS:
        for suffix in ("p50", "p95", "max"):
            assert isinstance(metrics.get(f"rollouts/mismatch/{stat}_{suffix}"), (int, float)), (stat, suffix, sorted(metrics))
    assert abs(metrics["rollouts/mismatch/abs_max_max"] - 5.0) < 1e-3
    assert metrics["rollouts/mismatch/tokens_outside_max"] == 2


def test_no_mismatch_table_or_columns_without_both_logprobs(otr_shutdown):
    project = _project("mismatch-none")
    tokenizer = build_tokenizer()
    otr.configure(exporters=[TrackioExporter(project, run="r")], sampler=otr.TailSampler(3, "first"))
    record(tokenizer, 0, batch(tokenizer), logprobs=False)
    assert otr.flush(60)
    assert trackio_tables(project, "rollouts/mismatch") == []
    ((_, table),) = trackio_tables(project)
    assert not {"mismatch kl", "max |\u0394|", "tokens outside band"} & set(table[0])
    assert not any("mismatch" in key for key in _metrics(project).get(0, {}))


def test_the_mismatch_table_is_bounded(otr_shutdown):
    """Every sample diverging at 12 tokens, 40 kept: 8 tokens per generation, MISMATCH_MAX_ROWS rows in all,
    the largest |Δ| of the step first."""
    project = _project("mismatch-bounded")
    tokenizer = build_tokenizer()
    exporter = TrackioExporter(project, run="r")
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(40, "mismatch"),
                  mismatch=otr.MismatchOptions(top_tokens=16))
    for part in range(5):  # 5 batches of 8 samples: one step of 40
        diverge = [(s, p, -(1.0 + 0.1 * p + 0.01 * s + part)) for s in range(8) for p in range(12)
                   if p < len(batch(tokenizer)["responses"][s])]
        data = batch(tokenizer, diverge=diverge, seed=part)
        summary = otr.record_token_batch(data["input_ids"], tokenizer=tokenizer, step=0,
                                         loss_mask=data["loss_mask"], attention_mask=data["attention_mask"],
                                         rewards=np.zeros(8), logprobs=data["logprobs"],
                                         trainer_logprobs=data["trainer_logprobs"])
        assert summary.recorded == 8
    otr.end_step(0)
    assert otr.flush(60)
    ((_, rows),) = trackio_tables(project, "rollouts/mismatch")
    assert len(rows) == trackio_rows.MISMATCH_MAX_ROWS
    per_episode: dict[str, int] = {}
    for r in rows:
        per_episode[r["trace id"]] = per_episode.get(r["trace id"], 0) + 1
    assert max(per_episode.values()) == trackio_rows.MISMATCH_PER_GENERATION
    deltas = [abs(r[DELTA]) for r in rows]
    assert deltas == sorted(deltas, reverse=True) and deltas[0] > 6  # part 4's position 11: ~6.1


def test_token_text_makes_whitespace_visible():
    text = trackio_rows.token_text
    assert text(" the") == "\u2423the"
    assert text("\n\n") == "\\n\\n" and text("\t") == "\\t" and text("a\\b") == "a\\\\b"
    assert text("    ") == "\u2423" * 4 and text("") == "''"
    assert text("\u200b") == "\\u200b" and text("\x00") == "\\x00"
    assert text("caf\u00e9") == "caf\u00e9" and text("\U0001f642") == "\U0001f642"
    assert text(1234) == "1234"
    long = text("x" * 100)
    assert len(long) == trackio_rows.TOKEN_CHARS and long.endswith("\u2026")
