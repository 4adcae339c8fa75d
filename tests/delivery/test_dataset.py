"""Kept episodes as a dataset: the same rows from an OTLP/JSON file, a Trackio project and a live
exporter; loaded back with pyarrow and ``datasets``; queried with DuckDB; bad input counted."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import otel_rollouts as otr
from otel_rollouts.cli import main as cli_main
from otel_rollouts.exporters import OtlpJsonFileExporter, TrackioExporter
from otel_rollouts.exporters.dataset import SCHEMA_VERSION, DatasetExporter

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

STEPS, GROUPS, SIZE = 3, 3, 4
PHOENIX = "http://127.0.0.1:6006/redirects/traces/{trace_id}"


def _run(tmp: Path, project: str, fmt: str = "messages", *, late_reward: bool = False) -> tuple[Path, Path]:
    """A small GRPO-like run: prompts with tool-using multi-turn episodes, one failing episode per
    step, rewards with components; exported to an OTLP/JSON file, Trackio and a live dataset."""
    file = tmp / "kept.jsonl"
    live = tmp / f"live-{fmt}"
    otr.configure(
        exporters=[OtlpJsonFileExporter(str(file)), TrackioExporter(project, run="r1"),
                   DatasetExporter(live, fmt, trace_ui_url=PHOENIX)],
        sampler=otr.TailSampler(8, "top_bottom"), run_id="run-a",
    )
    try:
        for step in range(STEPS):
            for g in range(GROUPS):
                question = f"What is {step} + {g}? (step {step})"
                for k in range(SIZE):
                    reward = float((k * 7 + g + step) % 5) / 4
                    with otr.episode(step=step, group_id=f"s{step}-g{g}", sample_index=k,
                                     policy_version=step) as ep:
                        ep.prompt([{"role": "system", "content": "Use the calculator."},
                                   {"role": "user", "content": question}])
                        with ep.turn() as turn:
                            turn.record_generation(f"Let me compute {step}+{g}.", model="policy",
                                                   input_tokens=20 + k, output_tokens=7)
                            with turn.tool_call("calc", arguments={"a": step, "b": g}) as call:
                                if g == 1 and k == 1:  # a failed tool call the episode recovers from
                                    call.error("calculator timed out")
                                else:
                                    call.result(step + g)
                        with ep.turn() as turn:
                            extra = {}
                            if k == 0:  # train–inference mismatch measured on this generation
                                engine = np.log(np.linspace(0.2, 0.9, 8, dtype=np.float32))
                                extra = {"logprobs": engine, "trainer_logprobs": engine + np.float32(0.05 * g)}
                            turn.record_generation(f"The answer is {step + g + (k % 2)}.", model="policy",
                                                   input_tokens=40, output_tokens=5 + k, **extra)
                        if g == 2 and k == 3:
                            ep.finish(status="error")
                        ep.reward(reward, components={"correct": float(k % 2 == 0), "format": 0.5},
                                  advantage=reward - 0.5)
            otr.end_step(step)
        otr.flush()
    finally:
        otr.shutdown()
    return file, live


def _rows(path: Path) -> list[dict]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda r: (r.get("trace_id") or r.get("chosen_trace_id")))


@pytest.fixture()
def run_dir(tmp_path: Path) -> tuple[Path, str, Path, Path]:
    project = f"ds-{uuid.uuid4().hex[:8]}"
    file, live = _run(tmp_path, project)
    return tmp_path, project, file, live


def test_the_same_rows_from_the_otlp_file_trackio_and_the_live_exporter(run_dir) -> None:
    tmp, project, file, live = run_dir
    from_file = otr.build_dataset([file], tmp / "from-file", trace_ui_url=PHOENIX, progress=False)
    from_trackio = otr.build_dataset([], tmp / "from-trackio", trackio_project=project,
                                     trace_ui_url=PHOENIX, progress=False)
    assert from_file.failed_sources == [] and from_trackio.failed_sources == []
    a, b, c = (_rows(p / "messages.parquet") for p in (tmp / "from-file", tmp / "from-trackio", live))
    assert len(a) == STEPS * 8  # the cap kept 8 per step; every one has a reward
    assert a == b == c
    row = a[0]
    assert row["run_id"] == "run-a" and row["link"] == PHOENIX.replace("{trace_id}", row["trace_id"])
    assert row["turns"] == 2 and row["tool_calls"] == 1 and row["input_tokens"] >= 60
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert [m["role"] for m in row["completion"]] == ["assistant", "tool", "assistant"]
    call = row["completion"][0]["tool_calls"][0]
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"a": row["step"], "b": int(row["group_id"][-1])}
    assert row["completion"][1]["tool_call_id"] == call["id"]
    assert row["final_answer"].startswith("The answer is")
    assert json.loads(row["reward_components"]).keys() == {"correct", "format"}
    assert row["duration_seconds"] > 0 and row["start_time"] is not None
    statuses = {r["status"] for r in a}
    assert statuses == {"ok", "error"}
    measured = [r for r in a if r["mismatch_tokens"] is not None]
    assert measured and all(r["sample_index"] == 0 and r["mismatch_tokens"] == 8 for r in measured)
    assert {round(r["mismatch_abs_max"], 3) for r in measured} >= {0.0}
    assert any(r["mismatch_kl"] > 0 for r in measured)
    failed = [r for r in a if r["failed_spans"] and r["status"] == "ok"]  # (an error episode's root fails)
    assert failed and all(r["group_id"].endswith("-g1") and r["sample_index"] == 1 for r in failed)
    assert all(m["content"].startswith("error: calculator timed out") for r in failed
               for m in r["completion"] if m["role"] == "tool")


def test_loaded_back_with_datasets_and_pyarrow_with_the_schema_version(run_dir) -> None:
    tmp, project, file, _ = run_dir
    otr.build_dataset([file], tmp / "out", progress=False)
    table = pq.read_table(tmp / "out" / "messages.parquet")
    assert table.schema.metadata[b"otel_rollouts.schema_version"] == str(SCHEMA_VERSION).encode()
    ds = datasets.load_from_disk(str(tmp / "out" / "hf"))
    assert len(ds) == table.num_rows == STEPS * 8
    first = ds.sort("trace_id")[0]
    assert first["messages"][0]["role"] == "system" and first["messages"][-1]["role"] == "assistant"
    assert str(SCHEMA_VERSION) in ds.info.description


def test_pairs_are_the_best_and_worst_of_each_kept_group(run_dir) -> None:
    tmp, project, file, _ = run_dir
    otr.build_dataset([file], tmp / "pairs", format="pairs", progress=False)
    otr.build_dataset([], tmp / "pairs-t", format="pairs", trackio_project=project, progress=False)
    messages = _rows((otr.build_dataset([file], tmp / "m", progress=False)).parquet)
    pairs = _rows(tmp / "pairs" / "pairs.parquet")
    assert pairs == _rows(tmp / "pairs-t" / "pairs.parquet")
    by_group: dict = {}
    for r in messages:
        by_group.setdefault((r["step"], r["group_id"]), []).append(r)
    expected = {k for k, rs in by_group.items() if len(rs) >= 2 and len({r["reward"] for r in rs}) > 1}
    assert {(p["step"], p["group_id"]) for p in pairs} == expected and expected
    for p in pairs:
        rs = by_group[(p["step"], p["group_id"])]
        assert p["chosen_reward"] == max(r["reward"] for r in rs)
        assert p["rejected_reward"] == min(r["reward"] for r in rs)
        assert p["margin"] > 0 and p["chosen"][-1]["role"] == "assistant"
        assert p["prompt"] == rs[0]["prompt"]


def test_duckdb_answers_the_five_lowest_rewards_per_step(run_dir) -> None:
    duckdb = pytest.importorskip("duckdb")
    tmp, _, file, _ = run_dir
    otr.build_dataset([file], tmp / "flat", format="flat", hf=False, progress=False)
    parquet = str(tmp / "flat" / "flat.parquet")
    got = duckdb.sql(
        f"SELECT step, trace_id, reward FROM (SELECT *, row_number() OVER (PARTITION BY step "
        f"ORDER BY reward, trace_id) AS n FROM '{parquet}') WHERE n <= 5 ORDER BY step, n").fetchall()
    rows = pq.read_table(parquet).to_pylist()
    assert "messages" not in rows[0]
    expected = []
    for step in range(STEPS):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: (r["reward"], r["trace_id"]))[:5]
        expected += [(step, r["trace_id"], r["reward"]) for r in mine]
    assert got == expected and len(got) == STEPS * 5


def test_filters_by_step_status_reward_and_reason(run_dir) -> None:
    tmp, _, file, _ = run_dir
    all_rows = _rows(otr.build_dataset([file], tmp / "all", format="flat", hf=False, progress=False).parquet)
    f = otr.DatasetFilters(steps=(1, 2), statuses=frozenset({"ok"}), reward_min=0.25, reward_max=0.75)
    result = otr.build_dataset([file], tmp / "some", format="flat", filters=f, hf=False, progress=False)
    some = _rows(result.parquet)
    assert some == [r for r in all_rows if 1 <= r["step"] <= 2 and r["status"] == "ok"
                    and 0.25 <= r["reward"] <= 0.75]
    assert 0 < len(some) < len(all_rows) and result.tally.filtered == len(all_rows) - len(some)
    reasons = {r["keep_reason"] for r in all_rows}
    one = sorted(reasons)[0]
    only = _rows(otr.build_dataset([file], tmp / "why", format="flat", hf=False, progress=False,
                                   filters=otr.DatasetFilters(reasons=frozenset({one}))).parquet)
    assert only and all(r["keep_reason"] == one for r in only)


def test_the_command_writes_each_format_and_reports_in_one_line(run_dir, capsys) -> None:
    tmp, project, file, _ = run_dir
    for fmt in ("messages", "pairs", "flat"):
        assert cli_main(["dataset", str(file), "--format", fmt, "--out", str(tmp / f"cli-{fmt}"),
                         "--no-progress"]) == 0
        assert (tmp / f"cli-{fmt}" / f"{fmt}.parquet").exists() and (tmp / f"cli-{fmt}" / "hf").is_dir()
    err = capsys.readouterr().err
    assert "wrote 24 messages rows from 24 episodes read" in err
    assert cli_main(["dataset", "--trackio", project, "--steps", "2", "--out", str(tmp / "t2"),
                     "--no-progress", "--no-hf"]) == 0
    assert {r["step"] for r in _rows(tmp / "t2" / "messages.parquet")} == {2}
    assert cli_main(["dataset", "--out", str(tmp / "x")]) == 2
    for bad in (["--steps", "5:2"], ["--steps", "a:b"], ["--reward-min", "nan"], ["--window-steps", "-1"],
                ["--format", "csv"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["dataset", str(file), "--out", str(tmp / "z"), *bad])
        assert exit_info.value.code == 2
        assert bad[0] in capsys.readouterr().err
    assert cli_main(["dataset", str(tmp / "missing.jsonl"), "--out", str(tmp / "y")]) == 2
    err = capsys.readouterr().err
    assert "could not read" in err and "Traceback" not in err
    assert cli_main(["dataset", str(file), "--out", str(file)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_bad_input_is_skipped_with_a_count_and_one_reason_per_kind(run_dir, capsys) -> None:
    tmp, project, file, _ = run_dir
    damaged = tmp / "damaged.jsonl"
    lines = file.read_text().splitlines()
    # a torn line, a line that is JSON but no trace, and an episode without a reward
    otr.configure(exporters=[OtlpJsonFileExporter(str(tmp / "noreward.jsonl"))],
                  sampler=otr.TailSampler(4, "first"), run_id="run-b")
    with otr.episode(step=9, group_id="x") as ep:
        ep.prompt("no reward here")
    otr.end_step(9)
    otr.shutdown()
    noreward = (tmp / "noreward.jsonl").read_text().splitlines()
    damaged.write_text("\n".join([lines[0][: len(lines[0]) // 2], *lines[1:], '{"resourceSpans": 7}',
                                  *noreward]) + "\n")
    # a foreign Trackio project: traces logged by someone else's code
    import trackio

    foreign = f"foreign-{uuid.uuid4().hex[:6]}"
    run = trackio.init(project=foreign, name="other")
    trackio.log({"t": trackio.Trace(messages=[{"role": "user", "content": "hi"}], metadata={"x": 1})}, step=0)
    trackio.finish()
    del run
    code = cli_main(["dataset", str(damaged), "--trackio", foreign, "--out", str(tmp / "bad"),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err
    assert "skipped 2 × a damaged line of an OTLP/JSON file" in err
    assert "skipped 1 × no reward (a training set needs one)" in err
    assert "skipped 1 × not an otel_rollouts episode" in err
    rows = _rows(tmp / "bad" / "messages.parquet")
    assert len(rows) == STEPS * 8 - 1  # the torn line held one kept episode
    # flat keeps an episode without a reward (reward null): an analysis table shows it
    flat = _rows(otr.build_dataset([damaged], tmp / "bad-flat", format="flat", hf=False, progress=False).parquet)
    assert any(r["run_id"] == "run-b" and r["reward"] is None for r in flat)
    # a file that is not a database at all, given as a Trackio project (in a TRACKIO_DIR of its
    # own: in the shared one it would break every later Trackio server, which opens all projects)
    own = tmp / "own-trackio"
    own.mkdir()
    (own / "broken.db").write_bytes(b"not sqlite at all" * 100)
    proc = _cli(["dataset", "--trackio", "broken", "--out", str(tmp / "broken"), "--no-progress"], own)
    assert proc.returncode == 2 and "could not read trackio:broken" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(sqlite3.DatabaseError):
        sqlite3.connect(own / "broken.db").execute("select 1 from sqlite_master").fetchall()


def _cli(argv: list[str], trackio_dir: Path) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own, reading ``trackio_dir`` (Trackio reads TRACKIO_DIR
    once, when it is imported)."""
    exe = shutil.which("otel-rollouts")
    cmd = [exe] if exe else [sys.executable, "-m", "otel_rollouts.cli"]
    return subprocess.run([*cmd, *argv], env=dict(os.environ, TRACKIO_DIR=str(trackio_dir)),
                          capture_output=True, text=True, timeout=300)


def _big_file(path: Path, episodes: int, per_step: int = 20) -> Path:
    """Every episode kept, ~8 KB of content each, ``per_step`` episodes a step."""
    otr.configure(exporters=[OtlpJsonFileExporter(str(path))], sampler=otr.TailSampler(per_step, "first"),
                  run_id="big")
    try:
        for i in range(episodes):
            step = i // per_step
            with otr.episode(step=step, group_id=f"g{i // 4}", sample_index=i % 4) as ep:
                ep.prompt(f"question {i} " + "context " * 100)
                with ep.turn() as turn:
                    turn.record_generation(f"answer {i} " + "reasoning " * 100, output_tokens=400)
                ep.reward(float(i % 7))
            if i % per_step == per_step - 1:
                otr.end_step(step)
                otr.flush()  # a step's episodes written before the next: nothing dropped
        otr.flush()
    finally:
        otr.shutdown()
    return path


@pytest.mark.slow
def test_memory_stays_bounded_whatever_the_input_size(tmp_path: Path) -> None:
    """Peak memory of a build over 4x the episodes stays where it was: spans are read a line at a
    time and held only within the step window; rows a row group at a time."""
    import tracemalloc

    small = _big_file(tmp_path / "small.jsonl", 200)
    large = _big_file(tmp_path / "large.jsonl", 800)
    size = {p: sum(f.stat().st_size for f in tmp_path.glob(p.name + "*")) for p in (small, large)}
    assert size[large] > 3.5 * size[small] > 2 << 20  # (rotated backups included)
    peaks = {}
    for name, path in (("small", small), ("large", large)):
        tracemalloc.start()
        result = otr.build_dataset([path], tmp_path / f"out-{name}", hf=False, progress=False,
                                   rows_per_group=64)
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert result.rows == (200 if name == "small" else 800)
    # what the large input would hold if read whole: its file size (the rows, more)
    assert peaks["large"] < 1.3 * peaks["small"], peaks
    assert peaks["large"] < size[large] / 3, (peaks, size)


def test_a_reward_recorded_after_the_decision_reaches_the_row_from_the_file(tmp_path: Path) -> None:
    """The episode's root ended without a reward; its step closed and kept it; the reward came
    later and went out as a late span on its own line. The file's row joins them (the window)."""
    file = tmp_path / "late.jsonl"
    otr.configure(exporters=[OtlpJsonFileExporter(str(file))], sampler=otr.TailSampler(4, "first"),
                  run_id="late")
    try:
        ep = otr.episode(step=0, group_id="g", sample_index=0)
        with ep:
            ep.prompt("Late question?")
            with ep.turn() as turn:
                turn.record_generation("Late answer.")
        otr.end_step(0)  # offered as it is, and kept
        otr.flush()
        ep.reward(0.75, components={"judge": 0.75})  # after the decision: a late span
        otr.flush()
    finally:
        otr.shutdown()
    assert len(file.read_text().splitlines()) == 2
    (row,) = _rows(otr.build_dataset([file], tmp_path / "out", hf=False, progress=False).parquet)
    assert row["reward"] == 0.75 and json.loads(row["reward_components"]) == {"judge": 0.75}
    assert row["final_answer"] == "Late answer."


def test_a_long_read_shows_a_progress_bar(run_dir, capsys) -> None:
    tmp, _, file, _ = run_dir
    otr.build_dataset([file], tmp / "bar", hf=False, progress=True)
    err = capsys.readouterr().err
    assert "otel-rollouts dataset" in err and f"{STEPS * 8} episodes" in err


def test_a_spool_directory_is_a_source_and_a_bad_batch_is_counted(run_dir, tmp_path: Path) -> None:
    """Batches an exporter had not delivered yet (OTLP protobuf files) give their rows too."""
    from otel_rollouts._core.codec import encode
    from otel_rollouts.delivery.replay import spans_from_file

    tmp, _, file, _ = run_dir
    spool = tmp / "spool"
    spool.mkdir()
    for i, spans in enumerate(spans_from_file(file)):
        (spool / f"{i:012d}-1.otlp").write_bytes(encode(spans))
    (spool / f"{999:012d}-1.otlp").write_bytes(b"\x00not a batch")
    result = otr.build_dataset([spool], tmp / "from-spool", hf=False, progress=False)
    from_file = otr.build_dataset([file], tmp / "from-file2", hf=False, progress=False)
    assert _rows(result.parquet) == _rows(from_file.parquet) and result.rows == STEPS * 8
    assert result.tally.skipped["a spool file that is not an OTLP batch"] == 1


def test_a_damaged_trackio_trace_is_skipped_and_the_rest_of_its_step_is_read(run_dir) -> None:
    """One stored trace's JSON is torn (written here straight into Trackio's database: the damage
    a crash or a disk can do); its page fails in Trackio, so it is read trace by trace."""
    from trackio.sqlite_storage import SQLiteStorage

    tmp, project, _, _ = run_dir
    own = tmp / "torn-trackio"  # a copy: the shared TRACKIO_DIR stays whole for later tests
    own.mkdir()
    source = sqlite3.connect(SQLiteStorage.get_project_db_path(project))
    copy = sqlite3.connect(own / SQLiteStorage.get_project_db_path(project).name)
    source.backup(copy)
    source.close()
    with copy:
        (torn,) = copy.execute("SELECT id FROM traces WHERE step = 1 ORDER BY id LIMIT 1").fetchone()
        copy.execute("UPDATE traces SET messages = '[{\"role\": \"us' WHERE id = ?", (torn,))
    copy.close()
    proc = _cli(["dataset", "--trackio", project, "--out", str(tmp / "torn"), "--no-hf", "--no-progress"], own)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {STEPS * 8 - 1} messages rows from {STEPS * 8} episodes read" in proc.stderr
    assert "skipped 1 × a Trackio trace that could not be read (first: " in proc.stderr
    assert "step 1" in proc.stderr and "Traceback" not in proc.stderr


def test_the_live_exporter_writes_from_the_renderer_process_too(tmp_path: Path) -> None:
    """With render="process" the exporters are made again in the renderer process: the dataset
    is written there, the same rows as the file gives, and nothing by this process's instance."""
    file, live = tmp_path / "kept.jsonl", tmp_path / "live"
    exporter = DatasetExporter(live, "flat", hf=False)
    otr.configure(exporters=[OtlpJsonFileExporter(str(file)), exporter], render="process",
                  sampler=otr.TailSampler(3, "top_bottom"), run_id="proc")
    try:
        for step in range(2):
            for k in range(6):
                with otr.episode(step=step, group_id=f"g{step}", sample_index=k) as ep:
                    ep.prompt(f"q{step}")
                    with ep.turn() as turn:
                        turn.record_generation(f"a{k}", output_tokens=2)
                    ep.reward(k / 5)
            otr.end_step(step)
        otr.flush()
        assert not otr.stats()["totals"].get("render.process_fallback")  # the renderer process did it
    finally:
        assert otr.shutdown(timeout=60)
    assert exporter._writer is None  # this process's instance wrote nothing
    rows = _rows(live / "flat.parquet")
    assert len(rows) == 6 and rows == _rows(otr.build_dataset([file], tmp_path / "f", format="flat", hf=False,
                                                              progress=False).parquet)


def test_pairs_of_two_runs_read_one_after_the_other_are_all_found() -> None:
    """Run b's steps start from 0 again after run a's step 9: its groups are not taken as old."""
    from otel_rollouts.exporters.dataset import Episode, Shaper

    shaper = Shaper("pairs", window_steps=2)
    rows = []
    for run in ("a", "b"):
        for step in range(10):
            for k in range(3):
                messages = [{"role": "user", "content": f"q{step}"}, {"role": "assistant", "content": f"a{k}"}]
                values = {"rl.run.id": run, "rl.step": step, "rl.split": "train", "rl.group.id": f"g{step}",
                          "rl.reward.score": float(k)}
                rows += shaper.add(Episode(f"{run}{step}{k}".ljust(32, "0"), values, messages), "here")
    rows += shaper.finish()
    assert len(rows) == 20 and not shaper.tally.skipped
    assert all(r["chosen"][0]["content"] == "a2" and r["rejected"][0]["content"] == "a0" for r in rows)


def test_a_file_written_by_two_runs_joins_a_late_reward_of_the_second(tmp_path: Path) -> None:
    """Run A wrote steps 0-4, then run B (a restart) appended its step 0, whose reward came after
    the decision on a line of its own: B's steps are not measured against A's."""
    file = tmp_path / "kept.jsonl"
    otr.configure(exporters=[OtlpJsonFileExporter(str(file))], sampler=otr.TailSampler(2, "first"), run_id="A")
    try:
        for step in range(5):
            with otr.episode(step=step, group_id="g") as ep:
                ep.prompt("a?")
                with ep.turn() as turn:
                    turn.record_generation("a.")
                ep.reward(1.0)
            otr.end_step(step)
    finally:
        otr.shutdown()
    otr.configure(exporters=[OtlpJsonFileExporter(str(file))], sampler=otr.TailSampler(2, "first"), run_id="B")
    try:
        ep = otr.episode(step=0, group_id="g")
        with ep:
            ep.prompt("b?")
            with ep.turn() as turn:
                turn.record_generation("b.")
        otr.end_step(0)
        otr.flush()
        ep.reward(0.5)  # a late span, on its own line
    finally:
        otr.shutdown()
    rows = _rows(otr.build_dataset([file], tmp_path / "out", hf=False, progress=False).parquet)
    assert [(r["run_id"], r["step"], r["reward"]) for r in sorted(rows, key=lambda r: (r["run_id"], r["step"]))] == [
        ("A", 0, 1.0), ("A", 1, 1.0), ("A", 2, 1.0), ("A", 3, 1.0), ("A", 4, 1.0), ("B", 0, 0.5)]


def test_a_named_pipe_given_as_a_source_is_refused_at_once_and_the_rest_is_read(run_dir, capsys) -> None:
    """A FIFO would block the read until some process writes to it (forever, for the command):
    it is refused as not a regular file, with no writer ever opening it."""
    import threading

    tmp, _, file, _ = run_dir
    fifo = tmp / "episodes.jsonl"
    os.mkfifo(fifo)
    codes: list[int] = []
    worker = threading.Thread(target=lambda: codes.append(cli_main(
        ["dataset", str(fifo), str(file), "--out", str(tmp / "fifo-out"), "--no-progress", "--no-hf"])),
        daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():  # blocked opening the pipe: let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=20)
        pytest.fail("the dataset command waited on a named pipe")
    err = capsys.readouterr().err
    assert codes == [1]  # a source could not be read; the rest was written
    assert f"could not read {fifo}: NotARegularFileError: {fifo}: a named pipe, not a regular file" in err
    assert len(_rows(tmp / "fifo-out" / "messages.parquet")) == STEPS * 8


def test_a_disk_that_fills_leaves_neither_output_and_the_dataset_already_there_as_it_was(
        run_dir, tmp_path: Path, capsys) -> None:
    """A real small filesystem (tmpfs) under --out, filled to the last byte, then given room for
    nothing, or for the Parquet file but not the Hugging Face dataset: the command says so (exit
    3), writes neither output, leaves no temporary file, and the dataset of an earlier run in
    another directory there is still whole."""
    from disk_faults import fill, mount_tmpfs, umount

    tmp, _, file, _ = run_dir
    reference = otr.build_dataset([file], tmp / "reference", progress=False)
    parquet_bytes = reference.parquet.stat().st_size
    hf_bytes = sum(p.stat().st_size for p in reference.hf.iterdir())
    small = tmp_path / "small"
    if not mount_tmpfs(small, "size=2m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        fresh, earlier = small / "fresh", small / "earlier"

        def command(out: Path, *more: str) -> int:
            return cli_main(["dataset", str(file), "--out", str(out), "--no-progress", *more])

        assert command(earlier, "--steps", "0") == 0  # an earlier dataset: step 0's rows
        before = _rows(earlier / "messages.parquet")
        assert len(before) == 8
        fresh.mkdir()
        filler = fill(small)
        page = 4096
        for room in (0, (parquet_bytes // page + 2) * page):  # nothing; the Parquet file only
            assert hf_bytes > room - parquet_bytes + page  # (the HF dataset cannot fit)
            os.truncate(filler, max(filler.stat().st_size - room, 0))
            for out in (fresh, earlier):
                capsys.readouterr()
                code = command(out)
                err = capsys.readouterr().err
                left = sorted(p.name for p in out.iterdir())
                assert left == ([] if out is fresh else ["hf", "messages.parquet"]), (room, code, err)
                assert code == 3, (room, err)
                assert "No space left on device" in err and "nothing was written" in err, err
                assert "Traceback" not in err
            assert _rows(earlier / "messages.parquet") == before
            assert len(datasets.load_from_disk(str(earlier / "hf"))) == 8
        # a row group that fails mid-read is the output's failure, not the source's: raised
        more = fill(small, "filler-2")
        os.truncate(more, more.stat().st_size - 2 * page)  # room for the header and a group or two
        with pytest.raises(OSError, match="No space left on device"):
            otr.build_dataset([file], fresh, rows_per_group=2, progress=False)
        assert list(fresh.iterdir()) == []
        more.unlink()
        filler.unlink()  # room again: a complete run replaces both, whole
        for out in (fresh, earlier):
            assert command(out) == 0
            assert sorted(p.name for p in out.iterdir()) == ["hf", "messages.parquet"]
            assert len(_rows(out / "messages.parquet")) == len(datasets.load_from_disk(str(out / "hf"))) == STEPS * 8
    finally:
        umount(small)


# An OTLP/JSON file with the attribute names of release 0.1.0 (``rl.reward``, the components as
# ``rl.reward.<name>`` with one named ``score``, ``rl.sampling.kept``/``reason``,
# ``rl.framework``): written by ``_two_episodes`` run under the package as it was before the
# names changed (checkout de7471f, exported with ``git archive``), the file kept as it came out.
V1_FILE = Path(__file__).parent / "data" / "otlp_json_names_0_1.jsonl"


def _two_episodes(otr_module) -> None:
    """The episodes of ``V1_FILE`` (the same calls, whichever release records them)."""
    for i, (r, comps) in enumerate([(1.0, {"score": 0.5, "acc": 1.0}), (0.25, {"score": 0.125, "acc": 0.0})]):
        with otr_module.episode(step=3, group_id="g0", sample_index=i, policy_version=7, framework="verl") as ep:
            ep.prompt([{"role": "user", "content": f"What is {i} + 2?"}])
            with ep.turn() as turn:
                turn.record_generation(f"It is {i + 2}.", model="tiny-policy", input_tokens=12, output_tokens=5)
                with turn.tool_call("calculator", {"expression": f"{i} + 2"}) as call:
                    call.result(i + 2)
            ep.reward(r, components=comps, advantage=r - 0.625)
    otr_module.end_step(3)


def test_a_file_with_the_names_of_release_0_1_gives_the_rows_of_today(tmp_path: Path) -> None:
    assert '"rl.reward"' in V1_FILE.read_text() and '"rl.sampling.reason"' in V1_FILE.read_text()
    now = tmp_path / "now.jsonl"
    otr.configure(exporters=[OtlpJsonFileExporter(str(now))], handle_signals=False,
                  sampler=otr.TailSampler(100, "first"), run_id="run-v1", render="thread")
    try:
        _two_episodes(otr)
    finally:
        otr.shutdown()
    assert '"rl.reward.score"' in now.read_text() and '"rl.reward"' not in now.read_text()
    old_rows = _rows(otr.build_dataset([V1_FILE], tmp_path / "old", format="flat", hf=False, progress=False).parquet)
    new_rows = _rows(otr.build_dataset([now], tmp_path / "new", format="flat", hf=False, progress=False).parquet)
    varies = {"trace_id", "episode_id", "link", "start_time", "duration_seconds", "generation_seconds",
              "tool_seconds"}  # ids and clocks of each recording

    def facts(rows: list[dict]) -> list[dict]:
        return sorted(({k: v for k, v in r.items() if k not in varies} for r in rows), key=lambda r: r["sample_index"])

    assert facts(old_rows) == facts(new_rows)
    best = facts(old_rows)[0]
    # the reward is the reward, a component named "score" stays a component, the reason is read
    assert best["reward"] == 1.0 and json.loads(best["reward_components"]) == {"acc": 1.0, "score": 0.5}
    assert best["keep_reason"] == "first" and best["policy_version"] == 7
