"""One training run is one Trackio run, wherever its processes record (issue 53).

A trainer's workers (verl's agent-loop workers, Ray actors, a process pool) each configure
otel_rollouts in their own process. With the run id given (``OTEL_ROLLOUTS_RUN_ID`` or
``configure(run_id=)``), the default Trackio exporter names its run after it, so every process
writes that one run (Trackio's ``resume="allow"``); before, each process got a Trackio run of its
own with a random name, and one training run showed as several. Two real processes, at once,
with the default exporters and the real Trackio storage.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from otel_rollouts import conventions as c

WORKER = """
import sys
import otel_rollouts as otr
otr.configure(service_name="worker")
with otr.episode(step=0, group_id="g", sample_index=int(sys.argv[1])) as ep:
    ep.prompt("question")
    ep.reward(float(sys.argv[1]))
otr.end_step(0)
otr.shutdown()
"""


def _workers(tmp_path: Path, env: dict[str, str]) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(i)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-3000:]


def _runs(db: Path, table: str) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute(f"SELECT run_name, COUNT(*) FROM {table} GROUP BY run_name").fetchall())


def test_processes_given_one_run_id_write_one_trackio_run(tmp_path: Path) -> None:
    store = tmp_path / "trackio"
    env = {**os.environ, "TRACKIO_DIR": str(store), c.ENV_TRACKIO_PROJECT: "one-run",
           c.ENV_RUN_ID: "grpo-run-7"}
    env.pop(c.ENV_TRACES_EXPORTER, None)
    _workers(tmp_path, env)
    db = store / "one-run.db"
    assert _runs(db, "traces") == {"grpo-run-7": 2}  # both processes' episodes, one run
    assert set(_runs(db, "metrics")) == {"grpo-run-7"}


def test_without_a_run_id_each_process_still_gets_a_run_of_its_own(tmp_path: Path) -> None:
    store = tmp_path / "trackio"
    env = {**os.environ, "TRACKIO_DIR": str(store), c.ENV_TRACKIO_PROJECT: "two-runs"}
    env.pop(c.ENV_TRACES_EXPORTER, None)
    env.pop(c.ENV_RUN_ID, None)
    _workers(tmp_path, env)
    runs = _runs(store / "two-runs.db", "traces")
    assert sorted(runs.values()) == [1, 1]  # two processes, two runs: no id was given to join them
