"""Bounded memory: what the sampler holds depends on the cap, never on how many episodes a step saw.

48 steps × 4,096 small episodes with cap 32. Two measurements:

* tracemalloc (slow, so only over a few early and a few late steps): the peak of memory
  allocated while a step runs stays the same late in the run as early, and under a bound fit
  for the cap (an unbounded buffer of 4,096 episodes per step would be several MiB);
* ``sys.getallocatedblocks()`` after a collection, after every step: the memory blocks still
  alive do not grow with the steps once the per-step windows are full (shrunk to 8 steps here,
  ``otr_helpers.shrink_windows``: at their 4,096 steps they would be filling all run long); a
  leak of one object per episode would add 4,096 blocks a step, an unbounded per-step counter
  about 6. Before each sample the statistics' waiting events are added up (``otr.stats()``)
  and ``flush()`` has returned (the sender lets go of what it sent before it says it is idle),
  so a sample is the settled state: under load the samples moved by less than 60 blocks.

The hang watcher is off here (``hang=False``): the durations it is handed (a deque bounded at
1,020) are drained on its own thread's tick, so the blocks alive at a step's end moved by up to
~3,000 with when that tick ran. Until 2026-11 the samples also moved by ~1,000 with when the
statistics folded their events and whether the sender thread still held its last batch: on a
loaded CI machine they alternated high and low and one run failed the growth check on it.

Until 2026-11 the test ran 200 steps with the windows at full size and allowed 40 blocks a step
of growth (the windows filling): 4 times the work for a weaker bound.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tracemalloc
from array import array

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otr_helpers import configure_memory, root, shrink_windows, traces

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling.pipeline import READY_BATCH

STEPS = 48
PER_STEP = 4096
CAP = 32


def _step(exporter: InMemorySpanExporter, step: int) -> None:
    for i in range(PER_STEP):
        ep = otr.episode(step=step).start()  # no `with`: the smallest whole episode
        ep.reward(float((i * 7919) % PER_STEP))
        ep.end()
    otr.end_step(step)
    otr.flush()
    kept = traces(exporter)
    assert len(kept) == CAP, (step, len(kept))
    exporter.clear()


def measure() -> dict:
    """The run, in a fresh interpreter (``python -c "import test_memory; test_memory.measure()"``):
    ``sys.getallocatedblocks()`` counts the whole process, and in a test session's process what
    earlier tests left behind (their threads, their instances) would count too. Prints and
    returns the peaks of the traced steps and the blocks alive every 4 steps."""
    import json

    import pytest

    from otel_rollouts._core import redaction

    with pytest.MonkeyPatch.context() as monkeypatch:
        shrink_windows(monkeypatch, 8, 8)
        # the redactor's cache of clean labels (4,096, cleared when full) takes each kept
        # episode's id: 32 a step, filling until step 128; at 64 it turns over within a step
        monkeypatch.setattr(redaction, "_NAME_CACHE", 64)
        exporter = configure_memory(CAP, "top_bottom", sampler_options={"step_lag": None}, run_id="memory",
                                    handle_signals=False, hang=False)
        peaks: dict[int, int] = {}
        blocks = array("q", bytes(8 * STEPS))  # filled in place: no new object per sample
        traced = {4, 5, STEPS - 2, STEPS - 1}
        for step in range(STEPS):
            if step in traced:
                tracemalloc.start()
                base = tracemalloc.get_traced_memory()[0]
                _step(exporter, step)
                peaks[step] = tracemalloc.get_traced_memory()[1] - base
                tracemalloc.stop()
            else:
                _step(exporter, step)
            otr.stats()  # the step's counts added up: what waits to be (256 at most) is settled
            gc.collect()
            blocks[step] = sys.getallocatedblocks()
        last = otr.stats()["steps"][f"{STEPS - 1}/train"]
        otr.shutdown(timeout=10)
    result = {"peaks": peaks, "blocks": list(blocks), "seen": last["seen"], "sampled_out": last["dropped.sampled_out"]}
    print(json.dumps(result))
    return result


def test_peak_memory_is_flat_over_48_steps_of_4096_episodes() -> None:
    import json
    import subprocess

    from suite_paths import TESTS, with_test_paths

    done = subprocess.run([sys.executable, "-c", "import test_memory; test_memory.measure()"],
                          capture_output=True, text=True, timeout=300, cwd=TESTS,
                          env=with_test_paths({k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    peaks = {int(k): v for k, v in result["peaks"].items()}
    blocks = result["blocks"]
    assert result["seen"] == PER_STEP and result["sampled_out"] == PER_STEP - CAP

    early = max(peaks[4], peaks[5])
    late = max(peaks[STEPS - 2], peaks[STEPS - 1])
    assert early < 3 * 2**20, f"peak while a step runs: {early} bytes"
    assert late <= early * 1.25 + 64 * 1024, (early, late)
    # blocks alive between steps: flat once the per-step windows (8 steps) are full; steps 12-23
    # against 34-45 (not the traced ones), 22 steps apart: one per-step window left unbounded
    # adds about 6 blocks a step, 130 (measured: the medians 2 to 8 apart; 295 with the per-step
    # counters' window left unbounded)
    gained = statistics.median(blocks[34:46]) - statistics.median(blocks[12:24])
    assert gained < 100, f"{gained} blocks gained: {list(enumerate(blocks))}"


def test_what_a_dropped_episode_held_is_released_before_its_step_closes(configured):
    exporter = configured(2, "top_bottom", sampler_options={"step_lag": None})
    handles = []
    for i in range(10):
        with otr.episode(step=0) as ep:
            ep.prompt("a" * 10_000)
            ep.reward(float(i))
        handles.append(ep)
    for i in range(10, 10 + READY_BATCH):  # the ready queue offered: at most 64 wait for it
        with otr.episode(step=0) as ep:
            ep.reward(float(i))
    # before the step closes, the 9 large episodes that can no longer be chosen are let go
    # (cap 2: top 1, bottom 1; the bottom is episode 0)
    records = [h._record for h in handles]
    assert [i for i, r in enumerate(records) if r.spans] == [0]
    otr.end_step(0)
    otr.flush()
    assert sorted(root(s).attributes[c.RL_REWARD] for s in traces(exporter).values()) == [
        0.0, float(9 + READY_BATCH)]


def _full_episode(step: int, i: int) -> None:
    """The benchmarks' tree: prompt, three turns (a generation each, two tool calls), reward."""
    with otr.episode(step=step, group_id=f"g{i // 8}", sample_index=i % 8) as ep:
        ep.prompt([{"role": "user", "content": f"question {i}"}])
        for k in range(3):
            with ep.turn() as turn:
                turn.record_generation(f"answer {k}", model="policy", output_tokens=3)
                if k < 2:
                    with turn.tool_call("search", arguments={"q": i}) as call:
                        call.result(f"result {k}")
        ep.reward(float(i))


def test_a_decided_episode_leaves_no_cycle_of_its_tree_for_the_garbage_collector(configured):
    """A dropped episode is freed by reference counting the moment it is dropped; a kept one,
    once rendered, leaves at most its record, root and reward span (a late reward still updates
    them) for the cyclic GC. Before, each was a cycle of its whole tree (spans point at their
    record, the record at its spans and at the user's handle, which points back): the cyclic
    GC's passes over them cost a dropped episode more than recording it did."""
    exporter = configured(10, "top_bottom", sampler_options={"step_lag": None})
    for i in range(20):  # warm: first-use caches
        _full_episode(0, i)
    otr.end_step(0)
    assert otr.flush()
    gc.collect()
    gc.disable()
    try:
        for i in range(200):
            _full_episode(1, i)
        otr.end_step(1)
        assert otr.flush()
        found = gc.collect()
    finally:
        gc.enable()
    assert len(traces(exporter)) == 20  # 10 per step
    # 190 dropped episodes leave nothing; 10 kept ones a few objects each (record, root and
    # reward span, their attribute dicts); the whole tree of any one episode is ~80 objects
    assert found <= 10 * 8, found
