"""The run a new user tries (issue 32's "done when"), in Trackio's dashboard in headless Chromium.

``otel-rollouts demo`` as the README gives it: 50 steps of a multi-turn tool-using loop with a
slow ``search`` tool (a heavy tail), an easy prompt whose groups all score the same, one tool
call that hangs, and a watchlist of 3 prompts. While the tool hangs, the dashboard shows the
episode running and where it is stuck; once the run is over it answers: which rollouts held a
step back and where their time went, which groups were degenerate, why each episode was kept,
and how a watched prompt's answer evolved over the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_support import media_tables, save_screenshot, scroll_to_table, wait_for
from otr_helpers import running_rows

PROJECT = "otr-questions-run"
STEPS = 50
HANG_STEP = STEPS - 4  # recent: the Media & Tables page shows the newest 48 tables
HANG_S = 30  # long enough to look at it while it hangs on a slow machine
WATCH = (0, 3, 6)
DEADLINE_S = 600


@pytest.fixture(scope="module")
def run(tmp_path_factory, trackio_dashboard, chromium_session) -> Iterator[dict]:
    """The demo run (its project in the session's TRACKIO_DIR), the session's dashboard over it,
    and what the session's browser saw while the tool hung."""
    from browser_support import reset_browser

    tmp = tmp_path_factory.mktemp("questions-run")
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    env["TRACKIO_DIR"] = str(trackio_dir)
    exe = shutil.which("otel-rollouts")
    cmd = [exe] if exe else [sys.executable, "-m", "otel_rollouts.cli"]
    cmd += ["demo", "--project", PROJECT, "--steps", str(STEPS), "--hang-s", str(HANG_S),
            "--hang-step", str(HANG_STEP), "--watch", ",".join(map(str, WATCH)), "--no-progress"]
    db = trackio_dir / f"{PROJECT}.db"
    base, browser = trackio_dashboard(trackio_dir), chromium_session
    reset_browser(browser)
    demo = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not running_rows(db):  # the hung episode, stored while it hangs
            assert demo.poll() is None, f"the demo ended and never showed a running episode:\n{demo.stdout.read()}"
            assert time.monotonic() < deadline, "no running episode"
            time.sleep(0.2)
        seen_running = _look_at_running(browser, base, tmp)
        assert demo.poll() is None, "the tool stopped hanging before the page was read: raise HANG_S"
        output, _ = demo.communicate(timeout=DEADLINE_S)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, output
    yield {"base": base, "tmp": tmp, "running": seen_running, "output": output, "db": db}


def _look_at_running(browser, base: str, tmp: Path) -> dict:
    """The Traces page, searched for running episodes, while the tool hangs."""
    from selenium.webdriver.common.by import By

    browser.get(f"{base}/traces?project={PROJECT}")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".search-wrap input"), "the trace list")
    browser.find_element(By.CSS_SELECTOR, ".search-wrap input").send_keys("rollouts/running")
    (row,) = wait_for(browser, lambda d: (r := d.find_elements(By.CSS_SELECTOR, "tr.trace-row")) and len(r) == 1 and r,
                      "the running episode", tmp / "failure-running.png")
    cells = [td.text for td in row.find_elements(By.CSS_SELECTOR, "td")]
    status = row.find_element(By.CSS_SELECTOR, ".status-pill").text
    row.click()  # the tree: the span it is stuck in reads as hung
    tree = wait_for(browser, lambda d: [s.text for s in d.find_elements(By.CSS_SELECTOR, ".span-row")],
                    "the hung episode's tree", tmp / "failure-running-tree.png")
    save_screenshot(browser, tmp / "questions-run-running.png")
    table = media_tables(browser, f"{base}/media?project={PROJECT}", "rollouts/running/table",
                         tmp / "failure-running-table.png")
    return {"status": status, "cells": cells, "tree": tree, "table": table}


def _tables(browser, base: str, tmp: Path, key: str) -> list[tuple[int, list[dict[str, str]]]]:
    """(step, rows as shown) of the tables logged under ``key``, newest step first."""
    return media_tables(browser, f"{base}/media?project={PROJECT}", key, tmp / f"failure-{key.replace('/', '-')}.png")


_scroll_to = scroll_to_table


def test_the_hung_episode_is_visible_while_it_hangs(run, browser) -> None:
    running = run["running"]
    assert running["status"].lower() == "error", running  # red: a hang, not work going on
    assert any("execute_tool fetch_page" in name for name in running["tree"]), running
    assert str(HANG_STEP) in running["cells"], running  # at its step
    # and once it ended (timed out), nothing reads as running any more
    assert running_rows(run["db"]) == []
    # while it hung, the table of what runs now named the span; once over, the same table (replaced
    # in place, not one per refresh) says nothing runs
    assert any(r["stuck in"].startswith("execute_tool fetch_page") for _, rs in running["table"] for r in rs), running
    tables = _tables(browser, run["base"], run["tmp"], "rollouts/running/table")
    assert tables == [(HANG_STEP, [{"episode": "\u2014", "open for": "\u2014", "stuck in": "nothing running",
                                    "trace id": "\u2014"}])], tables


def test_the_slowest_episode_of_a_step_and_where_its_time_went(run, browser) -> None:
    tables = _tables(browser, run["base"], run["tmp"], "rollouts/slowest")
    by_step = dict(tables)
    # the hang's step: its slowest episode is the one whose tool hung, its time in the tool
    top = by_step[HANG_STEP][0]
    assert float(top["seconds"]) >= HANG_S - 1, top
    assert top["most time in"].startswith("tool"), top
    assert float(top["tool s"]) >= HANG_S - 1, top
    assert top["kept because"] in ("slowest", "error", "truncated"), top
    # every step's table is slowest first, and the slow search tool shows as tool time
    for _, rows in tables:
        seconds = [float(r["seconds"]) for r in rows]
        assert seconds == sorted(seconds, reverse=True)
    assert any(rows[0]["most time in"].startswith("tool") for s, rows in tables if s != HANG_STEP)
    _scroll_to(browser, "rollouts/slowest")
    save_screenshot(browser, run["tmp"] / "questions-run-slowest.png")


def test_degenerate_groups_and_why_each_episode_was_kept(run, browser) -> None:
    tables = _tables(browser, run["base"], run["tmp"], "rollouts/table")
    rows = [r for _, rs in tables for r in rs]
    reasons = {r["kept because"] for r in rows}
    assert {"top", "bottom", "slowest", "watch"} <= reasons, reasons
    assert all(r["kept because"] not in ("", "\u2014") for r in rows)
    # the easy prompt's groups: every member the same reward, zero advantage
    assert any(r["group health"] == "all equal \u00d74" for r in rows), {r["group health"] for r in rows}
    assert any(r["kept because"] == "degenerate_group" for r in rows)
    # the impossible prompt (every sample truncated): cut short, not lost (each was scored)
    assert any(r["group health"].endswith("truncated 4/4") for r in rows), {r["group health"] for r in rows}
    _scroll_to(browser, "rollouts/table")
    save_screenshot(browser, run["tmp"] / "questions-run-table.png")


def test_a_watched_prompts_answers_across_the_run(run, browser) -> None:
    for index in WATCH:
        tables = _tables(browser, run["base"], run["tmp"], f"rollouts/watch/{index}")
        newest_step, history = tables[0]
        assert newest_step == STEPS - 1
        steps = [int(r["step"]) for r in history]
        assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == STEPS - 1
        assert len(set(steps)) == STEPS  # every step the prompt appeared in: all of them
        assert all(r["answer"] and r["trace id"] for r in history)
    _scroll_to(browser, f"rollouts/watch/{WATCH[0]}")
    save_screenshot(browser, run["tmp"] / "questions-run-watch.png")
