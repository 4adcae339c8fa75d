"""Train–inference mismatch: token logprobs of the engine and of the trainer.

The statistics are checked against numpy written out here (not the library's kernel): the
per-episode API, ``record_token_batch`` (padded, response-only, ragged, several generations per
sample) and ``record_batch`` give the same numbers; the ``mismatch`` part keeps the episodes made
to diverge; the step's summary has their percentiles; bad input is flagged, never raised.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core.logprobs import MismatchOptions, row_totals, totals_of


class _Exporter(InMemorySpanExporter):
    """In-memory spans, and the step summaries (the exporters' ``log_metrics`` interface)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        self.logged.setdefault(step, {}).update(values)


@pytest.fixture
def run():
    exporter = _Exporter()

    def start(sampler=None, **kw):
        otr.configure(exporters=[exporter], sampler=sampler or otr.TailSampler(64, "first"),
                      handle_signals=False, **kw)
        return exporter

    yield start
    otr.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def expected(rollout, trainer, mask=None, band=(0.5, 2.0)) -> dict[str, float]:
    """The statistics as the README defines them, in float64 from the float32 Δ."""
    d = (np.asarray(trainer, np.float32) - np.asarray(rollout, np.float32)).astype(np.float64)
    keep = np.isfinite(d) if mask is None else np.isfinite(d) & np.asarray(mask, bool)
    d = d[keep]
    r = np.exp(d)
    return {
        c.RL_MISMATCH_TOKENS: d.size,
        c.RL_MISMATCH_ABS_MEAN: float(np.abs(d).mean()),
        c.RL_MISMATCH_ABS_MAX: float(np.abs(d).max()),
        c.RL_MISMATCH_KL: float(0.5 * (d * d).mean()),
        c.RL_MISMATCH_RATIO_MIN: float(r.min()),
        c.RL_MISMATCH_RATIO_MAX: float(r.max()),
        c.RL_MISMATCH_OUTSIDE: int(((r < band[0]) | (r > band[1])).sum()),
    }


def assert_stats(attrs, want, rel=1e-5):
    for key, value in want.items():
        assert attrs[key] == pytest.approx(value, rel=rel, abs=1e-7), key


def spans_by(exporter, name_prefix):
    return [s for s in exporter.get_finished_spans() if s.name.startswith(name_prefix)]


def roots(exporter):
    return {s.attributes[c.RL_SAMPLE_INDEX]: s for s in spans_by(exporter, c.SPAN_EPISODE)}


# --- the statistics ------------------------------------------------------------------------------
def test_a_generation_and_its_episode_carry_the_statistics_and_the_worst_tokens(run):
    exporter = run()
    rng = np.random.default_rng(1)
    r1 = np.log(rng.uniform(0.05, 1, 12)).astype(np.float32)
    t1 = r1 + rng.normal(0, 0.05, 12).astype(np.float32)
    t1[7] -= 2.5  # the trainer finds token 7 far less likely
    r2 = np.log(rng.uniform(0.05, 1, 5)).astype(np.float32)
    t2 = r2 + np.float32(0.9)  # every token over the band's high end (ratio 2.46)
    tokens = [f"tok{i}" for i in range(12)]
    with otr.episode(step=0) as ep:
        turn = ep.turn()
        turn.record_generation("first", logprobs=torch.from_numpy(r1), trainer_logprobs=t1.tolist(), tokens=tokens)
        with turn.generation() as gen:
            gen.output("second", logprobs=r2, trainer_logprobs=torch.from_numpy(t2))
        ep.reward(1.0)
    otr.end_step(0)
    assert otr.flush(30)
    first, second = sorted(spans_by(exporter, "chat"), key=lambda s: s.start_time)
    assert_stats(first.attributes, expected(r1, t1))
    assert_stats(second.attributes, expected(r2, t2))
    assert second.attributes[c.RL_MISMATCH_OUTSIDE] == 5
    assert list(first.attributes[c.RL_MISMATCH_BAND]) == [0.5, 2.0]
    # the episode: its generations' tokens together (token-weighted, not a mean of means)
    (root,) = spans_by(exporter, c.SPAN_EPISODE)
    assert_stats(root.attributes, expected(np.concatenate([r1, r2]), np.concatenate([t1, t2])))
    # the worst tokens, largest |Δ| first; texts from the tokens given; ids (#position) without
    worst = first.attributes[c.RL_MISMATCH_WORST_POSITION]
    assert worst[0] == 7 and len(worst) == 12
    assert list(first.attributes[c.RL_MISMATCH_WORST_TOKEN][:1]) == ["tok7"]
    d = np.abs(t1 - r1)
    assert [round(x, 5) for x in d[list(worst)]] == sorted((round(x, 5) for x in d), reverse=True)
    assert first.attributes[c.RL_MISMATCH_WORST_ROLLOUT][0] == pytest.approx(float(r1[7]))
    assert first.attributes[c.RL_MISMATCH_WORST_TRAINER][0] == pytest.approx(float(t1[7]))
    assert second.attributes[c.RL_MISMATCH_WORST_TOKEN][0].startswith("#")


def test_options_mask_and_one_sided_logprobs(run):
    exporter = run(mismatch=otr.MismatchOptions(band=(0.8, 1.25), top_tokens=2))
    r = np.log(np.full(6, 0.5, np.float32))
    t = r + np.array([0.0, 0.1, -0.3, 0.5, 2.0, -4.0], np.float32)
    mask = [1, 1, 1, 1, 0, 0]  # the last two are not the policy's (not counted)
    with otr.episode(step=0) as ep:
        turn = ep.turn()
        turn.record_generation("masked", logprobs=r, trainer_logprobs=t, mask=mask)
        turn.record_generation("engine only", logprobs=r)  # nothing to compare: nothing recorded
        turn.record_generation("trainer only", trainer_logprobs=t)
    otr.end_step(0)
    assert otr.flush(30)
    masked, engine_only, trainer_only = sorted(spans_by(exporter, "chat"), key=lambda s: s.start_time)
    assert_stats(masked.attributes, expected(r, t, mask, band=(0.8, 1.25)))
    assert masked.attributes[c.RL_MISMATCH_OUTSIDE] == 2  # -0.3 and 0.5 leave (0.8, 1.25)
    assert list(masked.attributes[c.RL_MISMATCH_WORST_POSITION]) == [3, 2]  # top 2, masked left out
    for span in (engine_only, trainer_only):
        assert not any(k.startswith(c.RL_MISMATCH_PREFIX) for k in span.attributes)


def test_the_kernel_is_exact_on_rows_with_one_sided_nan_and_empty_tokens():
    rng = np.random.default_rng(3)
    rollout = np.log(rng.uniform(0.01, 1, (6, 9))).astype(np.float32)
    trainer = rollout + rng.normal(0, 0.3, (6, 9)).astype(np.float32)
    mask = rng.random((6, 9)) < 0.7
    trainer[1] = rollout[1] - np.abs(trainer[1] - rollout[1]) - 0.01  # every Δ < 0
    trainer[2] = rollout[2] + 0.2  # every Δ > 0
    trainer[3, 2] = np.nan  # an unknown logprob: left out
    mask[3, 2] = True
    rollout[4, 5] = -np.inf
    mask[5] = False  # nothing to compare
    trainer[0] = rollout[0]  # identical: all Δ 0
    options = MismatchOptions()
    for starts in (None, np.arange(6) * 9):
        args = (rollout, trainer, mask) if starts is None else (rollout.ravel(), trainer.ravel(), mask.ravel())
        cols = row_totals(*args, options, starts=starts).columns()
        for i in range(5):
            want = expected(rollout[i], trainer[i], mask[i])
            got = {k: cols[k][i] for k in want if k != c.RL_MISMATCH_TOKENS}
            assert_stats(got, {k: v for k, v in want.items() if k != c.RL_MISMATCH_TOKENS}, rel=1e-4)
            assert totals_of(rollout[i], trainer[i], mask[i], options).n == want[c.RL_MISMATCH_TOKENS]
        assert all(math.isnan(col[5]) for col in cols.values())  # none, never 0


# --- the batch paths -------------------------------------------------------------------------------
def _token_batch(seed=0, samples=8, width=48, prompt=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 200, (samples, width), generator=g)
    loss = torch.zeros(samples, width, dtype=torch.int64)
    loss[:, prompt:30] = 1  # two generations: 16..30 and 36..48, feedback between
    loss[:, 36:] = 1
    rollout = -torch.rand(samples, width, generator=g) * 2
    trainer = rollout + 0.01 * torch.randn(samples, width, generator=g)
    return ids, loss, rollout, trainer


@pytest.mark.parametrize("layout", ["padded", "response_only", "ragged"])
def test_record_token_batch_keeps_the_diverging_samples_with_their_statistics(run, tokenizer, layout):
    exporter = run(sampler=otr.TailSampler(2, "mismatch"))
    ids, loss, rollout, trainer = _token_batch()
    trainer[3, 20] -= 4.0  # sample 3: one token in its first generation
    trainer[6, 40] += 3.0  # sample 6: one token in its second generation
    kw: dict = {"logprobs": rollout, "trainer_logprobs": trainer}
    if layout == "response_only":
        kw = {"logprobs": rollout[:, 16:], "trainer_logprobs": trainer[:, 16:]}
    given_ids, given_loss = ids, loss
    if layout == "ragged":
        given_ids, given_loss = list(ids), list(loss)
        kw = {"logprobs": list(rollout), "trainer_logprobs": list(trainer)}
    summary = otr.record_token_batch(given_ids, tokenizer=tokenizer, step=0, loss_mask=given_loss,
                                     rewards=torch.rand(8), **kw)
    assert not summary.problems and not summary.refused
    otr.end_step(0)
    assert otr.flush(30)
    kept = roots(exporter)
    assert set(kept) == {3, 6}
    for i, root in kept.items():
        assert root.attributes[c.RL_KEEP_REASON] == c.REASON_MISMATCH
        assert_stats(root.attributes, expected(rollout[i], trainer[i], loss[i]), rel=1e-4)
    chats = {}
    for span in spans_by(exporter, "chat"):
        chats.setdefault(span.context.trace_id, []).append(span)
    first, second = sorted(chats[kept[3].context.trace_id], key=lambda s: s.start_time)
    assert_stats(first.attributes, expected(rollout[3, 16:30], trainer[3, 16:30]), rel=1e-4)
    assert first.attributes[c.RL_MISMATCH_WORST_POSITION][0] == 4  # column 20 of input_ids
    token = tokenizer.decode([int(ids[3, 20])])
    assert first.attributes[c.RL_MISMATCH_WORST_TOKEN][0] == token
    assert second.attributes[c.RL_MISMATCH_ABS_MAX] < 0.1
    _, second6 = sorted(chats[kept[6].context.trace_id], key=lambda s: s.start_time)
    assert second6.attributes[c.RL_MISMATCH_WORST_POSITION][0] == 4  # column 40, run from 36


def test_record_token_batch_with_misshapen_logprobs_records_the_batch_and_says_why(run, tokenizer):
    exporter = run()
    ids, loss, rollout, trainer = _token_batch()
    summary = otr.record_token_batch(ids, tokenizer=tokenizer, step=0, loss_mask=loss,
                                     logprobs=rollout[:, :5].T, trainer_logprobs=trainer)
    assert any("logprobs" in p and "no mismatch recorded" in p for p in summary.problems)
    otr.end_step(0)
    assert otr.flush(30)
    assert len(roots(exporter)) == 8
    assert not any(k.startswith(c.RL_MISMATCH_PREFIX) for s in exporter.get_finished_spans() for k in s.attributes)


def test_record_batch_from_lists_and_from_padded_arrays(run):
    exporter = run(sampler=otr.TailSampler(1, "mismatch"))
    rng = np.random.default_rng(5)
    rollout = [np.log(rng.uniform(0.1, 1, 4 + i)).astype(np.float32) for i in range(5)]
    trainer = [r + np.float32(0.02) for r in rollout]
    trainer[2] = trainer[2].copy()
    trainer[2][1] += 1.5
    trainer[4] = None  # the trainer's are not known for this one

    def build(i, ep):
        ep.turn().record_generation(f"answer {i}")

    otr.record_batch(5, step=0, rewards=[0.1] * 5, logprobs=rollout, trainer_logprobs=trainer,
                     response_tokens=[[f"w{j}" for j in range(4 + i)] for i in range(5)], record=build)
    width = 9
    padded_r = np.zeros((5, width), np.float32)
    padded_t = np.zeros((5, width), np.float32)
    masks = np.zeros((5, width), np.int64)
    for i, r in enumerate(rollout):
        padded_r[i, : len(r)] = r
        padded_t[i, : len(r)] = r + 0.02
        masks[i, : len(r)] = 1
    padded_t[4, 2] += 2.5
    otr.record_batch(5, step=1, rewards=[0.1] * 5, logprobs=padded_r, trainer_logprobs=torch.from_numpy(padded_t),
                     logprob_masks=masks, record=build)
    otr.end_step(0)
    otr.end_step(1)
    assert otr.flush(30)
    kept = {(s.attributes[c.RL_STEP], s.attributes[c.RL_SAMPLE_INDEX]): s for s in spans_by(exporter, c.SPAN_EPISODE)}
    assert set(kept) == {(0, 2), (1, 4)}
    assert_stats(kept[0, 2].attributes, expected(rollout[2], trainer[2]))
    assert_stats(kept[1, 4].attributes, expected(padded_r[4], padded_t[4], masks[4]))
    chats = {s.context.trace_id: s for s in spans_by(exporter, "chat")}
    chat = chats[kept[0, 2].context.trace_id]
    assert chat.attributes[c.RL_MISMATCH_WORST_TOKEN][0] == "w1"
    assert_stats(chat.attributes, expected(rollout[2], trainer[2]))


def test_compositions_and_options_of_the_part():
    policy = otr.TailSampler(8, "errors+mismatch+top_bottom").policy
    assert "Mismatch" in repr(policy)
    assert repr(otr.Mismatch(3, by="ratio_min")) == "Mismatch(3, by='ratio_min')"
    with pytest.raises(ValueError, match="Mismatch\\(by\\)"):
        otr.Mismatch(by="entropy")
    with pytest.raises(ValueError, match="band"):
        otr.MismatchOptions(band=(2.0, 0.5))
    with pytest.raises(ValueError, match="top_tokens"):
        otr.MismatchOptions(top_tokens=1000)


def test_ratio_min_ranks_smallest_first_and_episodes_without_logprobs_are_never_chosen(run):
    exporter = run(sampler=otr.TailSampler(3, otr.Mismatch(by="ratio_min")))
    r = np.log(np.full(4, 0.5, np.float32))
    for i, shift in enumerate([0.0, -1.0, None, -3.0, 0.5, None]):
        with otr.episode(step=0, sample_index=i) as ep:
            if shift is None:
                ep.turn().record_generation("no logprobs")
            else:
                ep.turn().record_generation("x", logprobs=r, trainer_logprobs=r + np.float32(shift))
    otr.end_step(0)
    assert otr.flush(30)
    kept = roots(exporter)
    assert set(kept) == {3, 1, 0}  # ratio_min exp(-3) < exp(-1) < 1 (== exp(0)) < exp(0.5)


# --- per-step percentiles --------------------------------------------------------------------------
def test_the_step_summary_has_the_mismatch_percentiles_of_kept_and_dropped_samples(run, tokenizer):
    exporter = run(sampler=otr.TailSampler(2, "first"))
    ids, loss, rollout, trainer = _token_batch(samples=40)
    shifts = torch.linspace(0, 1, 40)
    trainer = rollout + shifts[:, None]  # sample i: Δ = shift_i on every token
    otr.record_token_batch(ids, tokenizer=tokenizer, step=0, loss_mask=loss, logprobs=rollout, trainer_logprobs=trainer)
    r = np.log(np.full(4, 0.5, np.float32))
    for shift in (2.0, 3.0):  # two per-episode ones into step 1
        with otr.episode(step=1) as ep:
            ep.turn().record_generation("x", logprobs=r, trainer_logprobs=r + np.float32(shift))
    otr.end_step(0)
    otr.end_step(1)
    assert otr.flush(30)
    s0 = exporter.logged[0]
    kl = 0.5 * shifts.double().numpy() ** 2
    assert s0["rollouts/mismatch/kl_p50"] == pytest.approx(np.percentile(kl, 50), rel=1e-3)
    assert s0["rollouts/mismatch/kl_p95"] == pytest.approx(np.percentile(kl, 95), rel=1e-3)
    assert s0["rollouts/mismatch/kl_max"] == pytest.approx(0.5, rel=1e-4)
    assert s0["rollouts/mismatch/abs_max_max"] == pytest.approx(1.0, rel=1e-4)
    assert s0["rollouts/mismatch/tokens_outside_max"] == 26  # Δ = 1 > log 2 on all 26 tokens
    s1 = exporter.logged[1]
    assert s1["rollouts/mismatch/kl_max"] == pytest.approx(4.5)
    want = np.percentile([math.exp(2.0), math.exp(3.0)], 50)
    assert s1["rollouts/mismatch/ratio_max_p50"] == pytest.approx(want, rel=1e-4)


# --- bad input -----------------------------------------------------------------------------------
class _Hostile:
    def __float__(self):
        raise SystemExit("hostile")

    def __index__(self):
        raise SystemExit("hostile")

    def __repr__(self):
        raise SystemExit("hostile")


def test_hostile_and_misaligned_logprobs_are_flagged_naming_the_field(run):
    exporter = run()
    r = np.log(np.full(4, 0.5, np.float32))
    with otr.episode(step=0, sample_index=0) as ep:
        turn = ep.turn()
        turn.record_generation("a", logprobs=[_Hostile()] * 4, trainer_logprobs=r)
        turn.record_generation("b", logprobs=r, trainer_logprobs=r[:3])
        turn.record_generation("c", logprobs=r, trainer_logprobs=r, mask=[1, 0])
        turn.record_generation("d", logprobs="not numbers", trainer_logprobs=r)
    otr.record_batch(2, step=0, logprobs=[[_Hostile()], r], trainer_logprobs=[[0.0], r + 1],
                     record=lambda i, ep: ep.turn().record_generation("e"))
    otr.end_step(0)
    assert otr.flush(30)
    chats = sorted(spans_by(exporter, "chat"), key=lambda s: s.start_time)
    notes = [list(s.attributes.get(c.RL_INVALID_FIELDS, [])) for s in chats[:4]]
    assert "logprobs" in notes[0][0] and "not per-token numbers" in notes[0][0]
    assert "trainer_logprobs: 3 values for 4 logprobs" in notes[1][0]
    assert "mask: 2 values for 4 logprobs" in notes[2][0]
    assert "logprobs" in notes[3][0]
    assert not any(k.startswith(c.RL_MISMATCH_PREFIX) for s in chats[:4] for k in s.attributes)
    batch_roots = [s for s in spans_by(exporter, c.SPAN_EPISODE) if s.attributes.get(c.RL_SAMPLE_INDEX) == 1]
    assert any(s.attributes.get(c.RL_MISMATCH_TOKENS) == 4 for s in batch_roots)  # the good sample


def test_two_dimensional_logprobs_of_one_generation_are_flagged_with_their_shape_not_measured(run):
    # one generation's logprobs are one value per token: a [2, 3] batch (a tensor, an array, a
    # nested list) flattened into 6 "tokens" would measure the other row (or padding) as its own
    exporter = run()
    flat = np.log(np.full(6, 0.5, np.float32))
    grid = flat.reshape(2, 3)
    cases = {
        "torch": dict(logprobs=torch.from_numpy(grid.copy()), trainer_logprobs=torch.from_numpy(grid + 1)),
        "numpy": dict(logprobs=flat, trainer_logprobs=grid + 1),
        "nested": dict(logprobs=grid.tolist(), trainer_logprobs=(grid + 1).tolist()),
        "row": dict(logprobs=flat[None, :], trainer_logprobs=flat[None, :] + 1),
        "mask": dict(logprobs=flat, trainer_logprobs=flat + 1, mask=torch.ones(2, 3)),
        "good": dict(logprobs=flat, trainer_logprobs=flat + 1),
    }
    with otr.episode(step=0) as ep:
        turn = ep.turn()
        for name, given in cases.items():
            turn.record_generation("a", model=name, **given)
    summary = otr.record_batch(2, step=0, logprobs=[grid, flat], trainer_logprobs=[grid + 1, flat + 1],
                               record=lambda i, ep: ep.turn().record_generation("b", model="batch"))
    otr.end_step(0)
    assert otr.flush(30)
    chats = {s.attributes[c.GEN_AI_REQUEST_MODEL]: s for s in spans_by(exporter, "chat")}
    notes = {name: list(chats[name].attributes.get(c.RL_INVALID_FIELDS, [])) for name in cases}
    assert notes["torch"] == ["logprobs: expected one value per token (1-D), got shape (2, 3) (no mismatch recorded)"]
    assert notes["numpy"] == ["trainer_logprobs: expected one value per token (1-D), got shape (2, 3) "
                              "(no mismatch recorded)"]
    assert notes["nested"] == ["logprobs: expected one value per token (1-D), got shape (2, 3) (no mismatch recorded)"]
    assert notes["row"] == ["logprobs: expected one value per token (1-D), got shape (1, 6) (no mismatch recorded)"]
    assert notes["mask"] == ["mask: expected one value per token (1-D), got shape (2, 3) (no mismatch recorded)"]
    assert notes["good"] == []
    measured = {name: chats[name].attributes.get(c.RL_MISMATCH_TOKENS) for name in cases}
    assert measured == {"torch": None, "numpy": None, "nested": None, "row": None, "mask": None, "good": 6}
    own = [s for s in spans_by(exporter, c.SPAN_EPISODE) if s.attributes.get(c.RL_SAMPLE_INDEX) is None]
    assert [r.attributes.get(c.RL_MISMATCH_TOKENS) for r in own] == [6]  # the good one only
    # record_batch, one sequence per sample: the 2-D sample is refused and named, the other measured
    batch = {s.attributes.get(c.RL_SAMPLE_INDEX): s.attributes.get(c.RL_MISMATCH_TOKENS)
             for s in spans_by(exporter, c.SPAN_EPISODE) if s.attributes.get(c.RL_SAMPLE_INDEX) is not None}
    assert batch == {0: None, 1: 6}
    assert ("sample 0: logprobs: expected one value per token (1-D), got shape (2, 3) (no mismatch recorded)"
            in summary.problems)
