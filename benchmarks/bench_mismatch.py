"""Train–inference mismatch on the batch path: what ``logprobs=`` + ``trainer_logprobs=`` add to
``otr.record_token_batch``.

One script, one run, on bench_decode.py's batch (4,096 samples x 1,024 tokens, right-padded
torch tensors, a real byte-level BPE tokenizer; imported from it, not copied), cap 32 per step.
Each variant is one step: ``otr.record_token_batch(...)`` + ``otr.end_step`` on the training
thread, measured as that thread's CPU time (``time.thread_time``: robust to other processes on a
shared machine); the export thread's work on the kept episodes is left to ``otr.flush``, not
counted. The variants are alternated round by round (A, B, C ... then rotated), so that a noisy
machine drifts on all of them alike; each variant's ratio is taken within its round against the
baseline of the same policy.

  without         top_bottom, no logprobs: today's cost (the baseline)
  with            top_bottom, logprobs + trainer_logprobs float32 [B, W], laid out like input_ids
  response_only   the same, as [B, R] response-only tensors (verl's layout: the last R columns)
  one_sided       [B, W], Δ < 0 on every generated token (the trainer always lower): the slow
                  path of row_totals (every row's max is a masked 0, taken again)
  without_mix     errors+mismatch+top_bottom, no logprobs (the baseline of the next one)
  diverge         errors+mismatch+top_bottom, [B, W], a few samples whose trainer diverges

Before timing, every variant runs once checked (fails loudly otherwise): the kept episodes
carry ``rl.mismatch.*`` (and none without logprobs), the diverging samples are the ones the
mismatch part kept (its choice equals the top by KL computed here in numpy), and no dropped
sample became a Python object (EpisodeRecord instances made in the step: at most 4x the cap (a composition holds each part's candidates),
while all the rows were offered to the sampler).

    python benchmarks/bench_mismatch.py                      # 4096 x 1024, cap 32, 7 rounds
    python benchmarks/bench_mismatch.py --samples 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import bench_tokenizer, make_batch  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import otel_rollouts as otr  # noqa: E402
from otel_rollouts import conventions as c  # noqa: E402
from otel_rollouts._core import spans as _spans  # noqa: E402

CAP = 32
MIX = "errors+mismatch+top_bottom"
DIVERGING = 6  # samples whose trainer logprobs diverge in the "diverge" variant
VARIANTS = {  # name -> (policy, logprobs kind, baseline)
    "without": ("top_bottom", None, None),
    "with": ("top_bottom", "full", "without"),
    "response_only": ("top_bottom", "response", "without"),
    "one_sided": ("top_bottom", "one_sided", "without"),
    "without_mix": (MIX, None, None),
    "diverge": (MIX, "diverge", "without_mix"),
}


def make_logprobs(batch: dict[str, Any], seed: int = 1) -> dict[str, Any]:
    """Engine and trainer logprobs for the batch, float32 [B, W] (values on prompt and padding
    tokens too, as a framework's buffer holds them; only loss-mask tokens are read)."""
    import torch

    ids = batch["input_ids"]
    samples, width = ids.shape
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(samples, width, generator=g) * 3  # log p of sampled tokens
    noise = torch.randn(samples, width, generator=g) * 0.02  # a healthy run: small Δ both ways
    trainer = rollout + noise
    diverged = trainer.clone()
    rows = torch.randperm(samples, generator=g)[:DIVERGING]
    diverged[rows] += torch.randn(DIVERGING, width, generator=g) * 0.5  # these disagree
    one_sided = rollout - noise.abs() - 1e-3  # the trainer always lower
    # verl: prompt (left part) | response [B, R]; every generated token here is past width // 8
    start = width // 8
    assert not bool(batch["loss_mask"][:, :start].any())
    return {
        "full": (rollout, trainer),
        "response": (rollout[:, start:].contiguous(), trainer[:, start:].contiguous()),
        "one_sided": (rollout, one_sided),
        "diverge": (rollout, diverged),
        "diverging_rows": sorted(rows.tolist()),
    }


def record(batch: dict[str, Any], tokenizer: Any, lp: dict[str, Any], kind: str | None, step: int) -> Any:
    extra = {} if kind is None else {"logprobs": lp[kind][0], "trainer_logprobs": lp[kind][1]}
    summary = otr.record_token_batch(
        batch["input_ids"], tokenizer=tokenizer, step=step, loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"], rewards=batch["rewards"], versions=batch["versions"],
        **extra,
    )
    otr.end_step(step)
    return summary


def one_step(variant: str, batch: dict[str, Any], tokenizer: Any, lp: dict[str, Any], step: int,
             warm: dict[str, Any], made: list[int] | None = None) -> tuple[float, Any, InMemorySpanExporter]:
    """Training-thread CPU seconds of one step of ``variant``, its summary and its exporter
    (``made``: a counter set to 0 after the warm-up step)."""
    policy, kind, _ = VARIANTS[variant]
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(CAP, policy, step_lag=None), run_id="bench")
    try:
        record(warm, tokenizer, lp["warm"], kind, step - 1)  # warm-up step (a slice of the batch)
        otr.flush()
        gc.collect()
        if made is not None:
            made[0] = 0
        t0 = time.thread_time()
        summary = record(batch, tokenizer, lp, kind, step)
        spent = time.thread_time() - t0
        otr.flush()
        return spent, summary, exporter
    finally:
        otr.shutdown()


def kl_by_numpy(lp: dict[str, Any], kind: str, batch: dict[str, Any]) -> Any:
    """Each sample's KL estimate computed here, independently of the library (½·mean Δ² over
    its loss-mask tokens, float64)."""
    import numpy as np

    rollout, trainer = (x.double().numpy() for x in lp[kind])
    mask = batch["loss_mask"].numpy().astype(bool)
    mask = mask[:, mask.shape[1] - rollout.shape[1]:]
    d = np.where(mask, trainer - rollout, 0.0)
    return 0.5 * (d * d).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)


def check(variant: str, batch: dict[str, Any], tokenizer: Any, lp: dict[str, Any]) -> str:
    """Run ``variant`` once, counting the EpisodeRecords it makes; fail loudly unless real work
    was measured. Returns a line for the report."""
    import numpy as np

    _, kind, _ = VARIANTS[variant]
    made = [0]
    init = _spans.EpisodeRecord.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made[0] += 1
        init(self, *args, **kwargs)

    _spans.EpisodeRecord.__init__ = counting  # type: ignore[method-assign]
    try:
        _, summary, exporter = one_step(variant, batch, tokenizer, lp, 1, lp["warm_batch"], made)
    finally:
        _spans.EpisodeRecord.__init__ = init  # type: ignore[method-assign]
    samples = batch["input_ids"].shape[0]
    roots = [s for s in exporter.get_finished_spans() if s.parent is None and s.attributes[c.RL_STEP] == 1]
    recorded = made[0]
    assert summary.refused == [] and summary.problems == [], (variant, summary)
    assert summary.recorded == samples, (variant, summary.recorded)  # every row offered to the sampler
    assert len(roots) == CAP, (variant, len(roots))
    # a dropped sample never became a Python object: only the rows the sampler may keep were
    # recorded as episodes (EpisodeRecords made in the measured step)
    assert CAP <= recorded <= 4 * CAP, (variant, "EpisodeRecords made", recorded)
    if kind is None:
        assert not any(c.RL_MISMATCH_KL in s.attributes for s in exporter.get_finished_spans()), variant
        return f"{variant}: {recorded} of {samples} rows became episodes, no rl.mismatch.*"
    for r in roots:
        for key in (c.RL_MISMATCH_TOKENS, c.RL_MISMATCH_KL, c.RL_MISMATCH_ABS_MAX, c.RL_MISMATCH_RATIO_MIN):
            assert key in r.attributes, (variant, key)
    gens = [s for s in exporter.get_finished_spans()
            if s.parent is not None and c.RL_MISMATCH_KL in s.attributes and s.attributes.get(c.RL_STEP, 1) == 1]
    assert gens and all(s.attributes.get(c.RL_MISMATCH_WORST_POSITION) for s in gens), variant
    kl = kl_by_numpy(lp, "full" if kind == "response" else kind, batch)
    for r in roots:
        i = r.attributes[c.RL_SAMPLE_INDEX]
        got = r.attributes[c.RL_MISMATCH_KL]
        assert abs(got - kl[i]) <= 1e-3 * kl[i] + 1e-9, (variant, i, got, kl[i])
        if kind == "one_sided":
            assert r.attributes[c.RL_MISMATCH_RATIO_MAX] < 1.0, (variant, i)
    line = f"{variant}: {recorded} of {samples} rows became episodes, {len(roots)} kept with rl.mismatch.*"
    if kind == "diverge":
        chosen = sorted(r.attributes[c.RL_SAMPLE_INDEX] for r in roots
                        if r.attributes[c.RL_KEEP_REASON] == c.REASON_MISMATCH)
        diverging = lp["diverging_rows"]
        assert set(diverging) <= set(chosen), (variant, "diverging not kept", diverging, chosen)
        top = sorted(np.argsort(-kl, kind="stable")[: len(chosen)].tolist())
        assert chosen == top, (variant, "mismatch part's choice", chosen, top)
        line += f"; mismatch part kept {len(chosen)}: the {len(diverging)} diverging samples and the next by KL"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tokenizer = bench_tokenizer()
    batch = make_batch(tokenizer, args.samples, args.width)
    lp = make_logprobs(batch)
    warm_n = min(256, args.samples)
    warm = {k: v[:warm_n] for k, v in batch.items()}
    lp["warm_batch"] = warm
    lp["warm"] = {k: (v[0][:warm_n], v[1][:warm_n]) for k, v in lp.items()
                  if k in ("full", "response", "one_sided", "diverge")}
    tokens = int(batch["loss_mask"].sum())
    print(f"batch: {args.samples} samples x {args.width} tokens ({tokens} generated), cap {CAP}/step, "
          f"{args.rounds} rounds alternated; training-thread CPU per step (record_token_batch + end_step)")
    for variant in VARIANTS:
        print("  checked", check(variant, batch, tokenizer, lp))
    names = list(VARIANTS)
    times: dict[str, list[float]] = {v: [] for v in names}
    ratios: dict[str, list[float]] = {v: [] for v in names if VARIANTS[v][2]}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        got = {}
        for variant in order:
            got[variant] = one_step(variant, batch, tokenizer, lp, 10 + r, warm)[0]
            times[variant].append(got[variant])
        for variant, base in ((v, VARIANTS[v][2]) for v in ratios):
            ratios[variant].append(got[variant] / got[base])  # type: ignore[index]
    print(f"{'variant':<15}{'policy':<28}{'median ms':>10}{'(min-max)':>18}{'vs baseline':>14}{'(min-max)':>14}")
    for v in names:
        t = [x * 1e3 for x in times[v]]
        ratio = ""
        spread = ""
        if v in ratios:
            ratio = f"{statistics.median(ratios[v]):.2f}x"
            spread = f"({min(ratios[v]):.2f}-{max(ratios[v]):.2f})"
        print(f"{v:<15}{VARIANTS[v][0]:<28}{statistics.median(t):>10.1f}{f'({min(t):.1f}-{max(t):.1f})':>18}"
              f"{ratio:>14}{spread:>14}")
    head = statistics.median(ratios["with"])
    print(f"logprobs + trainer_logprobs [B, W]: {head:.2f}x the call without them (target <= 1.2x); "
          f"per generated token {(statistics.median(times['with']) - statistics.median(times['without'])) / tokens * 1e9:.1f} ns")


if __name__ == "__main__":
    main()
