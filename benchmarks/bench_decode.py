"""Tracing a step of token-id rollouts: decode-everything-then-cap versus otel_rollouts' lazy path.

One script, one run, both variants on the same batch: 4,096 samples x 1,024 tokens (right-padded
``input_ids`` / ``attention_mask`` / ``loss_mask`` / per-token ``versions`` torch tensors, rewards),
cap 32 episodes per step (top 16 + bottom 16 by reward). The tokenizer is a real byte-level BPE
trained here (tests/tokenizer_fixture.py, a vocabulary of ~2.6k), wrapped in PreTrainedTokenizerFast.

  decode_all   what RL frameworks' rollout loggers do today: per sample ``.tolist()`` of ids and
               loss mask, split the sequence into loss-mask runs, ``tokenizer.decode`` each run,
               build the messages; then cap (top/bottom by reward) and record the 32 kept
               episodes with otel_rollouts' episode API.
  lazy         ``otr.record_token_batch(...)``: tensors to the host once per batch (a CPU batch
               read in place), the batch's rewards offered to the sampler as columns in one
               call, only the rows it may keep recorded as episodes (their ids copied), text
               decoded on the export thread for the 32 kept episodes.
  api_floor    for reference, not a competitor: one bare ``otr.episode`` + ``ep.reward`` +
               ``ep.finish`` per sample and nothing else (no tokens at all) - the cost of
               offering 4,096 episodes one by one, which the batch path no longer pays: it
               offers the batch's columns to the sampler at once and records only the rows the
               sampler may keep.

Reported per step: training-thread time (CPU time of the thread running the call(s) the training
loop waits for, including ``otr.end_step``: robust to other processes on a shared machine; wall
time next to it), the export thread's work (``otr.flush``: decoding and rendering the kept
episodes), their ratio, and peak traced memory (tracemalloc, a separate pass: numpy buffers are
counted, torch's are not).

    python benchmarks/bench_decode.py                  # 4096 x 1024, cap 32, 3 repetitions
    python benchmarks/bench_decode.py --samples 1024 --repeat 1
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from tokenizer_fixture import CORPUS, build_tokenizer  # noqa: E402

import otel_rollouts as otr  # noqa: E402

CAP = 32


def bench_tokenizer():
    """A larger vocabulary than the tests' (longer tokens, closer to a real model's)."""
    words = " ".join(CORPUS).split()
    corpus = [" ".join(words[(i * 7) % len(words):] + words[: (i * 7) % len(words)]) for i in range(400)]
    corpus += [f"step {i} reward {i % 7} value {i * 31 % 1000} item {i * 17 % 97}" for i in range(2000)]
    return build_tokenizer(vocab_size=8000, corpus=CORPUS + corpus)


def make_batch(tokenizer, samples: int, width: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special and i < tokenizer.vocab_size]
    table = torch.tensor(vocab, dtype=torch.int64)
    ids = table[torch.randint(len(vocab), (samples, width), generator=g)]
    prompt_len = torch.randint(width // 8, width // 3, (samples,), generator=g)
    total = torch.clamp(prompt_len + torch.randint(16, width, (samples,), generator=g), max=width)
    cols = torch.arange(width).expand(samples, width)
    attention = cols < total[:, None]
    loss = (cols >= prompt_len[:, None]) & attention
    eos = tokenizer.eos_token_id
    ends = total - 1
    stop = torch.rand(samples, generator=g) < 0.8  # 80% end with EOS, the rest ran out of room
    ids[torch.arange(samples)[stop], ends[stop]] = eos
    ids[~attention] = tokenizer.pad_token_id
    # async RL: most samples come from one policy version, a quarter straddle a weight update
    base = torch.randint(3, 6, (samples, 1), generator=g)
    switch = torch.where(torch.rand(samples, generator=g) < 0.25, prompt_len + (total - prompt_len) // 2, width)
    per_token = base + (cols >= switch[:, None]).to(torch.int64)
    versions = torch.where(loss, per_token, torch.full_like(ids, -1))
    rewards = torch.rand(samples, generator=g)
    return {"input_ids": ids, "attention_mask": attention.to(torch.int64), "loss_mask": loss.to(torch.int32),
            "versions": versions, "rewards": rewards}


def decode_all(batch, tokenizer, step: int) -> None:
    """Per-sample decode of everything, then the cap, then record the kept (today's loggers)."""
    ids_t, attn_t, mask_t, rew_t = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["rewards"]
    rows = []
    for i in range(ids_t.shape[0]):
        n = int(attn_t[i].sum().item())
        ids = ids_t[i, :n].tolist()
        mask = mask_t[i, :n].tolist()
        runs, start = [], 0
        for j in range(1, n + 1):
            if j == n or mask[j] != mask[start]:
                runs.append((mask[start], ids[start:j]))
                start = j
        messages = []
        for k, (m, run) in enumerate(runs):
            role = "assistant" if m else ("user" if k == 0 else "tool")
            messages.append({"role": role, "content": tokenizer.decode(run, skip_special_tokens=False)})
        rows.append((float(rew_t[i].item()), i, messages))
    rows.sort(key=lambda r: r[0])
    kept = rows[: CAP // 2] + rows[-CAP // 2 :]
    for reward, i, messages in kept:
        with otr.episode(step=step, sample_index=i) as ep:
            ep.prompt([m for m in messages[:1]])
            for m in messages[1:]:
                if m["role"] == "assistant":
                    with ep.turn() as turn:
                        turn.record_generation(m["content"])
            ep.reward(reward)
    otr.end_step(step)


def lazy(batch, tokenizer, step: int) -> None:
    otr.record_token_batch(
        batch["input_ids"], tokenizer=tokenizer, step=step, loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"], rewards=batch["rewards"], versions=batch["versions"],
    )
    otr.end_step(step)


def api_floor(batch, tokenizer, step: int) -> None:
    rewards = batch["rewards"].tolist()
    for i, reward in enumerate(rewards):
        with otr.episode(step=step, sample_index=i) as ep:
            ep.reward(reward)
            ep.finish("stop")
    otr.end_step(step)


def run(variant, batch, tokenizer, repeat: int) -> dict[str, float]:
    exporter = InMemorySpanExporter()
    otr.configure(exporters=[exporter], sampler=otr.TailSampler(CAP, "top_bottom"))
    fn = {"decode_all": decode_all, "lazy": lazy, "api_floor": api_floor}[variant]
    train, wall, export = [], [], []
    try:
        for step in range(repeat):
            gc.collect()  # each step starts from the same heap state (collections inside count)
            c0, t0 = time.thread_time(), time.perf_counter()
            fn(batch, tokenizer, step)
            c1, t1 = time.thread_time(), time.perf_counter()
            otr.flush()
            t2 = time.perf_counter()
            train.append(c1 - c0)
            wall.append(t1 - t0)
            export.append(t2 - t1)
        roots = [s for s in exporter.get_finished_spans() if s.parent is None]
        assert len(roots) == CAP * repeat, (variant, len(roots))
        tracemalloc.start()
        fn(batch, tokenizer, repeat)
        otr.flush()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        otr.shutdown()
    return {"train": statistics.median(train), "wall": statistics.median(wall),
            "export": statistics.median(export), "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tokenizer = bench_tokenizer()
    batch = make_batch(tokenizer, args.samples, args.width)
    print(f"batch: {args.samples} samples x {args.width} tokens, {int(batch['attention_mask'].sum())} real tokens,"
          f" vocab {len(tokenizer)}, cap {CAP}/step, median of {args.repeat} steps")
    results = {v: run(v, batch, tokenizer, args.repeat) for v in ("decode_all", "lazy", "api_floor")}
    print(f"{'variant':<12}{'training thread CPU':>21}{'(wall)':>12}{'export (flush)':>16}{'peak traced mem':>18}")
    for v, r in results.items():
        print(f"{v:<12}{r['train'] * 1000:>18.1f} ms{r['wall'] * 1000:>9.1f} ms{r['export'] * 1000:>13.1f} ms"
              f"{r['peak'] / 2**20:>15.1f} MiB")
    a, b = results["decode_all"], results["lazy"]
    print(f"training-thread CPU time: lazy is {a['train'] / b['train']:.1f}x less than decode_all (target >= 20x);"
          f" wall {a['wall'] / b['wall']:.1f}x")
    f = results["api_floor"]
    print(f"per sample: decode_all {a['train'] / args.samples * 1e6:.0f} us, lazy {b['train'] / args.samples * 1e6:.0f} us,"
          f" (one bare episode offered one by one, api_floor: {f['train'] / args.samples * 1e6:.0f} us)")
    print(f"peak traced memory: decode_all {a['peak'] / 2**20:.1f} MiB, lazy {b['peak'] / 2**20:.1f} MiB"
          f" ({a['peak'] / max(b['peak'], 1):.1f}x)")


if __name__ == "__main__":
    main()
