"""What a researcher sees in Trackio's dashboard (headless Chromium) when they ask of a step
(issue 32): the slowest episode and the stage its time went to, a degenerate group's health, a
watched prompt's answer across steps, and an episode still running, then replaced when it ends.

A child process fills a Trackio project with ``TrackioExporter`` (episodes built with the real
OpenTelemetry SDK by ``test_trackio_questions``), shows a hung episode running, prints ``READY``
and waits; told to go on, it ends the episode and exports it, and prints ``DONE``. The
dashboard (``trackio.show``) serves the project meanwhile, as during a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_support import media_tables, save_screenshot, scroll_to_table, wait_for
from otr_helpers import wait_ready
from suite_paths import TEST_PATHS

PROJECT = "otr-questions-browser"
WATCHED = "capital-of-australia"
ANSWERS = ["Sydney", "Canberra, I think", "Canberra."]
HANG_TOOL = "execute_tool fetch_page"
RED_PILL = "rgba(254, 226, 226, 1)"  # Trackio 0.43's .status-pill.status-error (#fee2e2)

_CHILD = """
import json, sys
from otel_rollouts import conventions as c
from otel_rollouts.exporters import TrackioExporter
from test_trackio_questions import Builder, HANG_TOOL, fill_step, pending_attrs, snapshot, S

exporter = TrackioExporter({project!r}, run="r")
builder = Builder()
ids = {{}}
for name, spans in fill_step(builder, 0).items():
    exporter.export(spans)
    ids[name] = f"{{spans[0].context.trace_id:032x}}"
for step, answer in enumerate({answers!r}):
    spans = builder.episode(step, reward=step / 2, answer=answer, attrs={{c.RL_WATCH_KEY: {watched!r},
                            c.RL_KEEP_REASON: c.REASON_WATCH}})
    exporter.export(spans)
    ids[f"watch{{step}}"] = f"{{spans[0].context.trace_id:032x}}"
exporter.force_flush()
root = builder.start(3, attrs={{c.RL_EPISODE_ID: "ep-hang"}})
builder.child(root, "chat pol", c.KIND_GENERATION, 0.0, 2.0)
tool = builder.child(root, HANG_TOOL, c.KIND_TOOL, 2.0, None)
exporter.show_pending(snapshot([*builder.spans_of(root), root, tool], 30.0, builder.t0,
                               pending_attrs(HANG_TOOL, 28.0, 30.0)), [])
ids["hung"] = f"{{root.get_span_context().trace_id:032x}}"
print("READY " + json.dumps(ids), flush=True)
sys.stdin.readline()
tool.end(end_time=builder.t0 + 95 * S)
root.set_attributes({{c.RL_REWARD: 0.0, c.RL_STATUS: c.STATUS_OK, c.RL_KEEP_REASON: c.REASON_SLOWEST,
                     c.RL_DURATION_SECONDS: 96.0}})
root.end(end_time=builder.t0 + 96 * S)
exporter.export(builder.spans_of(root))
exporter.force_flush()
assert exporter.pending_failures == 0 and exporter.exported == 8, (exporter.pending_failures, exporter.exported)
print("DONE", flush=True)
"""


@pytest.fixture(scope="module")
def run_going(tmp_path_factory, trackio_dashboard) -> Iterator[tuple[str, dict[str, str], subprocess.Popen, Path]]:
    """(dashboard URL, trace ids by name, the child waiting to end the hung episode, tmp dir):
    the child fills its project in the session's TRACKIO_DIR, served by the session's dashboard."""
    tmp = tmp_path_factory.mktemp("questions")
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(trackio_dir), PYTHONPATH=TEST_PATHS)
    code = _CHILD.format(project=PROJECT, answers=ANSWERS, watched=WATCHED)
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        ids = json.loads(wait_ready(child.stdout).split("READY", 1)[1])
        yield trackio_dashboard(trackio_dir), ids, child, tmp
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)


def _tables(driver, base: str, tmp: Path, key: str, count: int) -> list[tuple[int, list[dict[str, str]]]]:
    """(step, rows as the page shows them) of the ``count`` tables logged under ``key``."""
    return media_tables(driver, f"{base}/media?project={PROJECT}", key,
                        tmp / f"failure-{key.replace('/', '-')}.png", count)


_scroll_to = scroll_to_table


def test_the_slowest_episode_of_a_step_and_where_its_time_went(browser, run_going) -> None:
    base, ids, _, tmp = run_going
    tables = _tables(browser, base, tmp, "rollouts/slowest", 3)  # a step with a timed episode: one each
    assert [step for step, _ in tables] == [2, 1, 0]
    rows = tables[2][1]
    top = rows[0]
    assert (top["trace id"], top["seconds"], top["most time in"], top["tool s"], top["kept because"]) == (
        ids["straggler"], "46", "tool 41 s (89%): execute_tool search 23.0 s", "41", "slowest"), rows
    assert [float(r["seconds"]) for r in rows] == sorted((float(r["seconds"]) for r in rows), reverse=True)
    _scroll_to(browser, "rollouts/slowest", 2)
    save_screenshot(browser, tmp / "questions-slowest.png")


def test_a_degenerate_groups_health_in_the_step_table(browser, run_going) -> None:
    base, ids, _, tmp = run_going
    tables = dict(_tables(browser, base, tmp, "rollouts/table", 3))
    by_id = {r["trace id"]: r for r in tables[0]}
    degenerate, crashed = by_id[ids["degenerate"]], by_id[ids["crashed"]]
    assert (degenerate["group health"], degenerate["kept because"]) == ("all equal \u00d78", "degenerate_group")
    assert (crashed["group health"], crashed["kept because"], crashed["env s"]) == ("lost 2/8", "error", "7.5")
    assert by_id[ids["untimed"]]["seconds"] == "\u2014"
    _scroll_to(browser, "rollouts/table", 2)  # step 0's (newest step first)
    save_screenshot(browser, tmp / "questions-step-table.png")


def test_a_watched_prompts_answers_across_steps(browser, run_going) -> None:
    base, ids, _, tmp = run_going
    tables = _tables(browser, base, tmp, f"rollouts/watch/{WATCHED}", 3)
    assert [step for step, _ in tables] == [2, 1, 0]
    newest = tables[0][1]
    assert [(r["step"], r["answer"], r["trace id"]) for r in newest] == [
        (str(step), answer, ids[f"watch{step}"]) for step, answer in enumerate(ANSWERS)]
    _scroll_to(browser, f"rollouts/watch/{WATCHED}")
    save_screenshot(browser, tmp / "questions-watch.png")


def test_a_running_episode_then_its_replacement(browser, run_going) -> None:
    """Last in the module: it lets the child end the hung episode."""
    from selenium.webdriver.common.by import By

    base, ids, child, tmp = run_going

    def rows_for(query: str, expect: int):
        browser.get(f"{base}/traces?project={PROJECT}")
        wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "tr.trace-row"), "the trace list")
        browser.find_element(By.CSS_SELECTOR, ".search-wrap input").send_keys(query)
        if expect == 0:
            wait_for(browser, lambda d: "No traces match" in d.find_element(By.TAG_NAME, "body").text,
                     f"no trace for {query!r}", tmp / "failure-running-none.png")
            return []
        return wait_for(browser, lambda d: (r := d.find_elements(By.CSS_SELECTOR, "tr.trace-row")) and len(r) == expect
                        and r, f"{expect} rows for {query!r}", tmp / "failure-running.png")

    (row,) = rows_for(ids["hung"], 1)
    pill = row.find_element(By.CSS_SELECTOR, ".status-pill")  # a hang is red (Trackio: "error")
    assert (pill.text.lower(), pill.value_of_css_property("background-color")) == ("error", RED_PILL), pill.text
    running = _tables(browser, base, tmp, "rollouts/running/table", 1)
    assert running == [(3, [{"episode": "ep-hang", "open for": "30.0s", "stuck in": f"{HANG_TOOL} (28.0s)",
                             "trace id": ids["hung"]}])]
    rows_for(ids["hung"], 1)
    save_screenshot(browser, tmp / "questions-running.png")

    child.stdin.write("go\n")
    child.stdin.flush()
    lines = []
    while line := child.stdout.readline():
        lines.append(line)
        if "DONE" in line:
            break
    assert any("DONE" in line for line in lines), "".join(lines)
    (row,) = rows_for(ids["hung"], 1)  # the finished episode, kept: no snapshot left beside it
    assert row.find_element(By.CSS_SELECTOR, ".status-pill").text.lower() == "ok"
    rows_for("rollouts/running", 0)
    # the table of what runs now was replaced in place: one at the step, saying nothing runs
    running = _tables(browser, base, tmp, "rollouts/running/table", 1)
    assert running == [(3, [{"episode": "\u2014", "open for": "\u2014", "stuck in": "nothing running",
                             "trace id": "\u2014"}])], running
    _scroll_to(browser, "rollouts/running/table")
    save_screenshot(browser, tmp / "questions-running-ended.png")
