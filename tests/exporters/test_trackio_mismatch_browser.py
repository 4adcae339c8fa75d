"""What a researcher sees in Trackio's dashboard (headless Chromium) when they look for the tokens
the trainer and the inference engine disagree on at a step (issue 33): the ``rollouts/mismatch``
table, the token made to diverge most on its first row, and the episodes' statistics in the
step table.

A child process records a batch where a few samples diverge on purpose
(``test_trackio_mismatch.run_diverging``: real tokenizer, ``otr.record_token_batch``, the
``mismatch`` policy part, ``TrackioExporter``), prints what it expects and exits; the dashboard
(``trackio.show``) then serves the project.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from browser_support import media_tables, save_screenshot, scroll_to_table
from suite_paths import TEST_PATHS

PROJECT = "otr-mismatch-browser"

_CHILD = """
import json, math
import otel_rollouts as otr
from otel_rollouts.exporters import _trackio_rows as trackio_rows
from test_trackio_mismatch import run_diverging

exporter, data = run_diverging({project!r})
otr.shutdown(60)
tokens = sorted(((s, *e) for s, found in data["expected"].items() for e in found), key=lambda e: -abs(e[4] - e[3]))
print("READY " + json.dumps([{{"sample": s, "position": p, "token": trackio_rows.token_text(t),
                               "delta": f"{{tr - r:.4g}}", "rollout": f"{{r:.4g}}", "trainer": f"{{tr:.4g}}"}}
                              for s, p, t, r, tr in tokens]), flush=True)
"""


@pytest.fixture(scope="module")
def dashboard_with_run(tmp_path_factory, trackio_dashboard) -> tuple[str, list[dict[str, str]], Path]:
    """(dashboard URL, the diverging tokens as the child expects them shown, tmp dir): the
    child fills its project in the session's TRACKIO_DIR, served by the session's dashboard."""
    tmp = tmp_path_factory.mktemp("mismatch")
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(trackio_dir), PYTHONPATH=TEST_PATHS)
    done = subprocess.run([sys.executable, "-c", _CHILD.format(project=PROJECT)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = json.loads(done.stdout.split("READY", 1)[1])
    return trackio_dashboard(trackio_dir), expected, tmp


def test_the_worst_tokens_of_the_step_are_on_top(browser, dashboard_with_run) -> None:
    base, expected, tmp = dashboard_with_run
    ((step, rows),) = media_tables(browser, f"{base}/media?project={PROJECT}", "rollouts/mismatch",
                                   tmp / "failure-mismatch.png", 1)
    assert step == 0
    top = rows[0]
    first = expected[0]
    assert (top["sample"], top["position"], top["token"]) == (str(first["sample"]), str(first["position"]),
                                                              first["token"]), rows[:3]
    assert (top["\u03b4 (trainer\u2212rollout)"], top["rollout logprob"], top["trainer logprob"]) == (
        first["delta"], first["rollout"], first["trainer"]), top
    assert top["kept because"] == "mismatch" and top["generation"] == "turn 0"
    assert [(r["sample"], r["position"]) for r in rows[:len(expected)]] == [
        (str(e["sample"]), str(e["position"])) for e in expected]
    assert any(r["token"].startswith("\u2423") for r in rows), "a token with a leading space shows it"
    scroll_to_table(browser, "rollouts/mismatch")
    save_screenshot(browser, tmp / "mismatch-table.png")


def test_the_step_table_has_the_episodes_mismatch(browser, dashboard_with_run) -> None:
    base, expected, tmp = dashboard_with_run
    ((_, rows),) = media_tables(browser, f"{base}/media?project={PROJECT}", "rollouts/table",
                                tmp / "failure-step-table.png", 1)
    by_sample = {r["sample"]: r for r in rows}
    worst = by_sample[str(expected[0]["sample"])]
    assert worst["max |\u03b4|"] == expected[0]["delta"].lstrip("-") and worst["tokens outside band"] == "1", worst
    assert float(worst["mismatch kl"]) > 0.1
    scroll_to_table(browser, "rollouts/table")
    save_screenshot(browser, tmp / "mismatch-step-table.png")
