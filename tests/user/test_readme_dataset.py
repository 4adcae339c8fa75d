"""The docs' "Kept episodes as a dataset" (docs/dataset.md), run as written: the demo, then each command of the
section's bash block, then its Python block; what they wrote is loaded back."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import page_blocks

ROOT = Path(__file__).resolve().parents[2]
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")


def _blocks(kind: str) -> list[str]:
    found = [b.code for b in page_blocks("dataset.md", kind)]
    assert found, f"docs/dataset.md has no {kind} block"
    return found


def _block(kind: str) -> str:
    return _blocks(kind)[0]


def _cli() -> list[str]:
    exe = shutil.which("otel-rollouts")
    return [exe] if exe else [sys.executable, "-m", "otel_rollouts.cli"]


@pytest.mark.slow
def test_the_readme_dataset_commands_and_code_run_as_written(tmp_path: Path) -> None:
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"))
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env.pop(key, None)
    demo = subprocess.run([*_cli(), "demo", "--no-progress"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr
    hint = "  otel-rollouts dataset --trackio otel-rollouts-demo --out otel-rollouts-demo-dataset"
    assert hint in demo.stdout.splitlines()  # what the demo itself says to run next, run too
    hinted = subprocess.run([*_cli(), *shlex.split(hint)[1:], "--no-hf"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert hinted.returncode == 0 and (tmp_path / "otel-rollouts-demo-dataset" / "messages.parquet").exists()
    # one command a line; a line ending in `\` goes on on the next, as a shell reads it
    commands = [line for line in _block("bash").replace("\\\n", " ").splitlines() if line.strip()]
    assert len(commands) == 3
    for line in commands:
        argv = shlex.split(line)
        assert argv[0] == "otel-rollouts"
        proc = subprocess.run([*_cli(), *argv[1:]], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, (line, proc.stderr)
        assert "Traceback" not in proc.stderr and re.search(r"wrote [1-9]\d* \w+ rows", proc.stderr), proc.stderr
    sft = datasets.load_from_disk(str(tmp_path / "sft" / "hf"))
    assert len(sft) > 0 and sft[0]["messages"][0]["role"] in ("system", "user")
    assert sft[0]["completion"][0]["role"] == "assistant"
    prefs = pq.read_table(tmp_path / "prefs" / "pairs.parquet").to_pylist()
    assert prefs and all(p["chosen_reward"] > p["rejected_reward"] for p in prefs)
    table = pq.read_table(tmp_path / "table" / "flat.parquet").to_pylist()
    assert {r["step"] for r in table} == {2, 3} and not (tmp_path / "table" / "hf").exists()

    live_code, duckdb_code = _blocks("python")
    worst = subprocess.run([sys.executable, "-c", duckdb_code], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert worst.returncode == 0, worst.stderr
    lowest = {}
    for r in table:
        lowest.setdefault(r["step"], []).append((r["reward"], r["trace_id"]))
    for step in (2, 3):  # each step's five lowest rewards, in the table DuckDB printed
        for _, trace_id in sorted(lowest[step])[:5]:
            assert trace_id[:8] in worst.stdout, (trace_id, worst.stdout)

    code = subprocess.run([sys.executable, "-c", live_code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert code.returncode == 0, code.stderr
    live = pq.read_table(tmp_path / "live" / "messages.parquet").to_pylist()
    assert len(live) == 16  # 8 kept per step (all), 2 steps, every one rewarded
    assert datasets.load_from_disk(str(tmp_path / "live" / "hf")).num_rows == 16
    pairs = pq.read_table(tmp_path / "prefs" / "pairs.parquet").to_pylist()
    rows = int(code.stdout.split()[0])
    assert rows == len(pairs) > 0
    assert all(p["chosen"][-1]["content"] != p["rejected"][-1]["content"] for p in pairs)
