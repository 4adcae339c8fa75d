"""The benchmarks run and check what they measure.

Each benchmark runs in its quick mode, as a subprocess, and must exit 0 having run its sanity
checks (its ``checked:`` line); the figures themselves are not asserted (speed is never asserted
in tests). bench_render's check is shown to fail when a render produced nothing, or spans without
their content: the way the benchmark once measured empty episodes.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# bench_loop's variants on every path of its own code that needs nothing beyond the project's
# dependencies (a child process each: the A/A control and the unsampled raw SDK add time, not
# paths; the peers' packages are not installed in CI, the full run measures them where they are)
LOOP_VARIANTS = "otr_cap32,otr_traced_cap32,otr_batch_cap32,otr_keep_all,raw_sdk_head16"


def load(name: str) -> Any:
    """A benchmark script as a module (they import each other from their own folder)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True,
                          text=True, timeout=180, cwd=BENCHMARKS.parent,
                          env={**os.environ, "OTEL_SDK_DISABLED": "false"})
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_bench_loop_quick_checks_every_variant() -> None:
    proc = run_benchmark("bench_loop.py", "--mode", "steps", "--quick", "--variants", LOOP_VARIANTS)
    checked = [line for line in proc.stdout.splitlines() if line.startswith("checked: ")]
    assert sorted(line.split(":")[1].strip() for line in checked) == sorted(LOOP_VARIANTS.split(","))
    assert "CHECK FAILED" not in proc.stdout
    # what the checks verified, as printed: cap 32 of 32 episodes, head sampling exported some
    assert "checked: otr_cap32: 32 episodes x 11 spans exported per step" in proc.stdout
    assert "checked: otr_keep_all: 32 episodes x 11 spans exported per step" in proc.stdout


@pytest.mark.slow
def test_bench_loop_episodes_mode_checks_every_arm() -> None:
    # the default mode: traced and untraced episodes alternated in one process, the A/A arm, the
    # no-library floor and the previous release (here this checkout's HEAD, exported and imported
    # as otel_rollouts_prev)
    proc = run_benchmark("bench_loop.py", "--quick", "--kinds", "thread", "--prev", "HEAD")
    assert "CHECK FAILED" not in proc.stdout
    assert "checked: every traced step exported min(32, episodes) episodes x 9 spans" in proc.stdout
    arms = [line.split()[0] for line in proc.stdout.splitlines()
            if line.split()[:1] in (["aa"], ["floor"], ["otr"], ["prev"])]
    assert arms == ["aa", "floor", "otr", "prev"]  # (the floor's spans are among the checks)


@pytest.mark.slow
def test_bench_loop_segments_attributes_the_traced_episode_in_the_loop() -> None:
    proc = run_benchmark("bench_loop.py", "--segments", "8", "--steps", "1", "--work-ms", "1")
    assert ("checked: the untraced generations did their calibrated work; every step kept min(32, n) episodes; "
            "the floor built 9 spans an episode") in proc.stdout
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert {"enter", "prompt", "generations", "tool", "reward", "exit", "end_step", "all"} <= set(rows)
    _, untraced, floor, tracing, _ = rows["enter"].split()  # entering: untimed in the untraced arm
    assert float(untraced) == 0 and float(floor) > 0 and float(tracing) > 0
    assert "step overhead: floor +" in proc.stdout


@pytest.mark.slow
def test_bench_dropped_quick_checks_the_trees() -> None:
    proc = run_benchmark("bench_dropped.py", "--rounds", "2", "--per-step", "64", "--warmup", "300")
    assert "checked: every otr episode started and seen and dropped per the step stats" in proc.stdout
    assert "CHECK FAILED" not in proc.stdout


@pytest.mark.slow
def test_bench_idle_measures_a_live_renderer() -> None:
    proc = run_benchmark("bench_idle.py", "--seconds", "1", "--settle", "0.5")
    assert "renderer process" in proc.stdout
    assert "checked: the episode was delivered" in proc.stdout
    assert "CHECK FAILED" not in proc.stdout


def test_bench_loop_skips_a_missing_peer_with_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    bench_loop = load("bench_loop")
    monkeypatch.setitem(bench_loop.PACKAGES, "logfire", ("no_such_module_for_bench_loop", "logfire"))
    assert bench_loop.available("logfire") == "package logfire not installed"
    assert bench_loop.available("otr_cap32") is None


@pytest.mark.slow
def test_bench_render_quick_renders_whole_episodes() -> None:
    proc = run_benchmark("bench_render.py", "--quick")
    assert "checked: every render of every case and variant produced all 11 spans" in proc.stdout
    assert "CHECK FAILED" not in proc.stdout


@pytest.mark.slow
def test_bench_slow_receiver_quick_counts_each_kept_episode_once() -> None:
    proc = run_benchmark("bench_slow_receiver.py", "--quick")
    assert "checked: in every run, delivered + in the spool + dropped == kept" in proc.stdout
    assert "CHECK FAILED" not in proc.stdout


@pytest.mark.slow
def test_bench_dataset_quick_checks_rows_sources_and_memory() -> None:
    proc = run_benchmark("bench_dataset.py", "--quick")
    assert "checked: every episode a row, the same rows from both sources, memory bounded" in proc.stdout
    assert "CHECK FAILED" not in proc.stdout


@pytest.fixture
def bench_render() -> Any:
    return load("bench_render")


def test_bench_render_check_fails_when_nothing_is_rendered(bench_render: Any) -> None:
    problems = bench_render.sanity([], "empty render")
    assert problems and "rendered 0 spans, expected 11" in problems[0]


def test_bench_render_check_fails_when_the_content_is_missing(bench_render: Any) -> None:
    from opentelemetry.sdk.trace import ReadableSpan

    from otel_rollouts import conventions as c

    materializer, rec = bench_render.record(None)
    spans = materializer.episode(rec)
    assert bench_render.sanity(spans, "whole") == []

    def without_output(span: ReadableSpan) -> ReadableSpan:
        attributes = {k: v for k, v in (span.attributes or {}).items() if k != c.GEN_AI_OUTPUT_MESSAGES}
        return ReadableSpan(name=span.name, context=span.context, parent=span.parent,
                            attributes=attributes, start_time=span.start_time, end_time=span.end_time)

    problems = bench_render.sanity([without_output(s) for s in spans], "no content")
    assert any(c.GEN_AI_OUTPUT_MESSAGES in p for p in problems)
