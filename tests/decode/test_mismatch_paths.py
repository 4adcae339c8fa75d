"""The ``mismatch`` policy part on every recording path: one episode at a time
(``turn.record_generation(..., logprobs=, trainer_logprobs=, mask=)``), ``otr.record_batch``
(lists of 1-D sequences, or padded 2-D with ``logprob_masks``) and ``otr.record_token_batch``
(logprobs laid out like ``input_ids``, as response-only ``[B, R]`` tensors, or ragged lists).

For the same data, every path keeps the same episodes for the same reasons, alone and composed
with other parts, with samples that have no logprobs (never chosen by ``mismatch``). The values
are dyadic (multiples of 1/16, small): every sum is exact in float32 on every path, so ties are
real ties and the tie-break (the earlier to finish) is tested too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory
from profiles import examples
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c

torch = pytest.importorskip("torch")

PROMPT = 3  # prompt tokens of every sample


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# --- data ----------------------------------------------------------------------------------------
@st.composite
def samples(draw: Any) -> list[dict[str, Any]]:
    """Samples with distinct rewards; some without logprobs, some with masked tokens."""
    n = draw(st.integers(1, 14))
    rewards = draw(st.permutations(list(range(n))))
    out = []
    for i in range(n):
        length = draw(st.integers(1, 6))
        has = draw(st.booleans() | st.just(True))  # most samples have logprobs
        rollout = [-draw(st.integers(0, 40)) / 16 for _ in range(length)]
        delta = [draw(st.integers(-24, 24)) / 16 for _ in range(length)]
        mask = [draw(st.integers(0, 4)) > 0 for _ in range(length)]  # mostly counted
        mask[0] = True  # the response starts with a generated token (not the prompt's run)
        out.append({
            "reward": float(rewards[i]),
            "status": draw(st.sampled_from(["ok", "ok", "ok", "error"])),
            "ids": [draw(st.integers(30, 200)) for _ in range(length)],
            "rollout": np.array(rollout, dtype=np.float32) if has else None,
            "trainer": np.array([r + d for r, d in zip(rollout, delta, strict=True)], dtype=np.float32)
            if has else None,
            "mask": np.array(mask),
        })
    return out


def _kl(s: dict[str, Any]) -> float | None:
    if s["rollout"] is None or not s["mask"].any():
        return None
    d = (s["trainer"] - s["rollout"]).astype(np.float64)[s["mask"]]
    return float(0.5 * (d * d).mean())


# --- the paths -----------------------------------------------------------------------------------
def _configure(policy: Any, cap: int) -> InMemorySpanExporter:
    exporter = configure_memory(cap, policy, sampler_options={"step_lag": None})
    return exporter


def _kept(exporter: InMemorySpanExporter) -> dict[int, tuple[str, float | None]]:
    """Sample index -> (reason, rl.mismatch.kl) of the kept episodes."""
    out = {}
    for s in exporter.get_finished_spans():
        if s.parent is None:
            i = s.attributes[c.RL_SAMPLE_INDEX]
            assert i not in out, i
            out[i] = (s.attributes[c.RL_KEEP_REASON], s.attributes.get(c.RL_MISMATCH_KL))
    return out


def _generate(turn: Any, i: int, s: dict[str, Any]) -> None:
    turn.record_generation(f"answer {i}", logprobs=s["rollout"], trainer_logprobs=s["trainer"],
                           mask=s["mask"].astype(np.int64))


def per_episode(data: list[dict[str, Any]], policy: Any, cap: int, tok: Any) -> dict:
    exporter = _configure(policy, cap)
    try:
        for i, s in enumerate(data):
            with otr.episode(step=0, sample_index=i) as ep:
                ep.prompt(f"question {i}")
                with ep.turn() as turn:
                    _generate(turn, i, s)
                ep.finish(reason="stop", status=s["status"])
                ep.reward(s["reward"])
        otr.end_step(0)
        assert otr.flush(10)
        return _kept(exporter)
    finally:
        otr.shutdown(timeout=10)


def _columns(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"rewards": [s["reward"] for s in data], "statuses": [s["status"] for s in data],
            "finish_reasons": ["stop"] * len(data), "sample_indices": list(range(len(data)))}


def batch_lists(data: list[dict[str, Any]], policy: Any, cap: int, tok: Any) -> dict:
    """record_batch with one 1-D sequence (or None) per sample."""
    exporter = _configure(policy, cap)

    def record(i: int, ep: Any) -> None:
        ep.prompt(f"question {i}")
        with ep.turn() as turn:
            turn.record_generation(f"answer {i}")

    try:
        summary = otr.record_batch(
            len(data), step=0, **_columns(data), record=record,
            logprobs=[None if s["rollout"] is None else s["rollout"].tolist() for s in data],
            trainer_logprobs=[None if s["trainer"] is None else torch.from_numpy(s["trainer"]) for s in data],
            logprob_masks=[s["mask"].astype(np.int64) for s in data],
        )
        assert summary.failed == [], summary
        otr.end_step(0)
        assert otr.flush(10)
        return _kept(exporter)
    finally:
        otr.shutdown(timeout=10)


def batch_padded(data: list[dict[str, Any]], policy: Any, cap: int, tok: Any) -> dict:
    """record_batch with [B, R] tensors, padding masked 0, a sample without logprobs all NaN."""
    exporter = _configure(policy, cap)
    width = max(len(s["ids"]) for s in data) + 2
    rollout = torch.full((len(data), width), -0.5)
    trainer = torch.full((len(data), width), -3.0)  # padding disagrees: it must not count
    masks = torch.zeros((len(data), width), dtype=torch.int64)
    for i, s in enumerate(data):
        n = len(s["ids"])
        if s["rollout"] is None:
            rollout[i, :n] = trainer[i, :n] = math.nan
        else:
            rollout[i, :n], trainer[i, :n] = torch.from_numpy(s["rollout"]), torch.from_numpy(s["trainer"])
        masks[i, :n] = torch.from_numpy(s["mask"].astype(np.int64))

    def record(i: int, ep: Any) -> None:
        ep.prompt(f"question {i}")
        with ep.turn() as turn:
            turn.record_generation(f"answer {i}")

    try:
        summary = otr.record_batch(len(data), step=0, **_columns(data), record=record,
                                   logprobs=rollout, trainer_logprobs=trainer, logprob_masks=masks)
        assert summary.failed == [], summary
        otr.end_step(0)
        assert otr.flush(10)
        return _kept(exporter)
    finally:
        otr.shutdown(timeout=10)


def _token_batch(data: list[dict[str, Any]], policy: Any, cap: int, tok: Any, layout: str) -> dict:
    """record_token_batch: verl's layout (prompt left-padded | response right-padded)."""
    exporter = _configure(policy, cap)
    n = len(data)
    resp = max(len(s["ids"]) for s in data) + 1
    width = PROMPT + 1 + resp
    pad = tok.pad_token_id
    ids = torch.full((n, width), pad, dtype=torch.int64)
    attention = torch.zeros((n, width), dtype=torch.int64)
    loss = torch.zeros((n, width), dtype=torch.int64)
    rollout = torch.full((n, width), -1.0)  # prompt and padding: values that must be ignored
    trainer = torch.full((n, width), 2.0)
    for i, s in enumerate(data):
        k = len(s["ids"])
        lo, hi = width - resp, width - resp + k
        ids[i, 1 : lo] = torch.tensor([10 + (i + j) % 7 for j in range(lo - 1)])  # prompt, one pad left
        attention[i, 1:hi] = 1
        ids[i, lo:hi] = torch.tensor(s["ids"])
        loss[i, lo:hi] = torch.from_numpy(s["mask"].astype(np.int64))
        if s["rollout"] is None:
            rollout[i, lo:hi] = math.nan
        else:
            rollout[i, lo:hi], trainer[i, lo:hi] = torch.from_numpy(s["rollout"]), torch.from_numpy(s["trainer"])
    kwargs: dict[str, Any] = {}
    if layout == "padded":
        kwargs.update(input_ids=ids, attention_mask=attention, loss_mask=loss, logprobs=rollout,
                      trainer_logprobs=trainer)
    elif layout == "response":
        kwargs.update(input_ids=ids, attention_mask=attention, loss_mask=loss,
                      logprobs=rollout[:, width - resp :].contiguous(),
                      trainer_logprobs=trainer[:, width - resp :].contiguous())
    else:  # ragged lists of the real tokens
        rows = [attention[i].bool() for i in range(n)]
        kwargs.update(input_ids=[ids[i][r] for i, r in enumerate(rows)],
                      loss_mask=[loss[i][r] for i, r in enumerate(rows)],
                      logprobs=[rollout[i][r] for i, r in enumerate(rows)],
                      trainer_logprobs=[trainer[i][r].numpy() for i, r in enumerate(rows)])
    try:
        summary = otr.record_token_batch(tokenizer=tok, step=0, **_columns(data), **kwargs)
        assert summary.refused == [] and summary.problems == [], summary
        otr.end_step(0)
        assert otr.flush(10)
        return _kept(exporter)
    finally:
        otr.shutdown(timeout=10)


PATHS = {
    "record_batch_lists": batch_lists,
    "record_batch_padded": batch_padded,
    "token_batch_padded": lambda d, p, cap, tok: _token_batch(d, p, cap, tok, "padded"),
    "token_batch_response": lambda d, p, cap, tok: _token_batch(d, p, cap, tok, "response"),
    "token_batch_ragged": lambda d, p, cap, tok: _token_batch(d, p, cap, tok, "ragged"),
}
POLICIES = {
    "mismatch": lambda: "mismatch",
    "errors+mismatch+top_bottom": lambda: "errors+mismatch+top_bottom",
    "mismatch+top_bottom": lambda: "mismatch+top_bottom",
    **{f"errors+mismatch(by={by})+top_bottom": (lambda by=by: otr.Compose(
        otr.Errors(), otr.Mismatch(by=by), otr.TopBottom(), equal_shares=True)) for by in c.MISMATCH_STATS},
}


def _check_reference(data: list[dict[str, Any]], kept: dict, policy: str) -> None:
    """What the mismatch part kept: samples with statistics only; its choice by KL is the top."""
    chosen = {i for i, (reason, _) in kept.items() if reason == c.REASON_MISMATCH}
    for i in chosen:
        assert _kl(data[i]) is not None, ("chosen without logprobs", i)
    for i, (_, kl) in kept.items():
        want = _kl(data[i])
        assert (kl is None) == (want is None), (i, kl, want)
        if want is not None:
            assert kl == pytest.approx(want, rel=1e-6, abs=1e-12), i
    if policy == "mismatch" and chosen:
        scored = sorted((-_kl(s), i) for i, s in enumerate(data) if _kl(s) is not None)  # type: ignore[operator]
        assert chosen == {i for _, i in scored[: len(chosen)]}


@settings(max_examples=examples(90), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=samples(), cap=st.integers(1, 8), policy=st.sampled_from(sorted(POLICIES)),
       path=st.sampled_from(sorted(PATHS)))
def test_batched_choice_equals_per_episode_choice(tok, data, cap, policy, path):
    one_by_one = per_episode(data, POLICIES[policy](), cap, tok)
    batched = PATHS[path](data, POLICIES[policy](), cap, tok)
    assert batched == one_by_one, (path, policy)
    _check_reference(data, one_by_one, policy)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_path_keeps_the_diverging_samples_and_never_one_without_logprobs(tok, path):
    """A fixed step: samples 3 and 8 diverge; 5 has no logprobs and the largest reward."""
    rng = np.random.default_rng(0)
    data = []
    for i in range(12):
        rollout = (-rng.integers(0, 40, 5) / 16).astype(np.float32)
        delta = rng.integers(-1, 2, 5) / 16 * (12 if i in (3, 8) else 1)
        data.append({"reward": float(i if i != 5 else 100), "status": "error" if i == 10 else "ok",
                     "ids": rng.integers(30, 200, 5).tolist(), "rollout": None if i == 5 else rollout,
                     "trainer": None if i == 5 else (rollout + delta).astype(np.float32),
                     "mask": np.ones(5, dtype=bool)})
    for policy in ("mismatch", "errors+mismatch+top_bottom"):
        kept = PATHS[path](data, policy, 6 if policy == "errors+mismatch+top_bottom" else 2, tok)
        assert kept == per_episode(data, policy, 6 if policy == "errors+mismatch+top_bottom" else 2, tok)
        assert {i for i, (r, _) in kept.items() if r == c.REASON_MISMATCH} >= {3, 8}, kept
        assert kept.get(5, ("-",))[0] != c.REASON_MISMATCH
        if policy != "mismatch":
            assert kept[10][0] == "error" and kept[5][0] == "top"  # the other parts still choose
            assert kept[5][1] is None  # no logprobs: no statistic, never 0


# --- found by the property test: empty rows of the flat (ragged) layout -------------------------
def test_row_totals_flat_rows_with_empty_rows_before_and_after():
    """A sample without logprobs (an empty row) takes no token of its neighbours, and the last
    non-empty row keeps its last token when empty rows follow it."""
    from otel_rollouts._core.logprobs import MismatchOptions, row_totals

    rollout = np.zeros(3, dtype=np.float32)
    trainer = np.array([0.5, 0.25, -1.0], dtype=np.float32)
    counted = np.ones(3, dtype=bool)
    got = row_totals(rollout, trainer, counted, MismatchOptions(), starts=np.array([0, 0, 1, 3]))
    assert got.n.tolist() == [0, 1, 2, 0]
    assert got.sq_sum.tolist() == [0.0, 0.25, 1.0625, 0.0]
    assert got.d_min.tolist()[1:3] == [0.5, -1.0] and got.d_max.tolist()[1:3] == [0.5, 0.25]


def test_record_batch_lists_with_samples_without_logprobs_before_and_after(otr_shutdown):
    exporter = _configure("first", 10)
    zero = np.zeros(2, dtype=np.float32)
    logprobs = [None, zero, None, zero, None]
    trainer = [None, np.array([0.5, 0.0], dtype=np.float32), None, np.array([0.25, -1.0], dtype=np.float32), None]
    otr.record_batch(5, step=0, sample_indices=list(range(5)), logprobs=logprobs, trainer_logprobs=trainer,
                     record=lambda i, ep: ep.turn().record_generation(f"answer {i}"))
    otr.end_step(0)
    assert otr.flush(10)
    roots = {s.attributes[c.RL_SAMPLE_INDEX]: s.attributes for s in exporter.get_finished_spans() if s.parent is None}
    assert [roots[i].get(c.RL_MISMATCH_TOKENS) for i in range(5)] == [None, 2, None, 2, None]
    assert roots[1][c.RL_MISMATCH_KL] == 0.0625 and roots[3][c.RL_MISMATCH_KL] == pytest.approx(0.265625)
