"""What a user sees: Debian's chromium, driven by selenium, on the Trackio dashboard and Phoenix's UI.

The Trackio dashboard is served on loopback (``trackio.show`` in a subprocess) for a project
filled by otel_rollouts; the tests open the Traces page, expand traces, read the execution tree,
the span inspector, the search box, and the per-step table on the Media & Tables page: what a
person sees. Another test follows a Trackio trace's ``trace_url`` into Phoenix's UI. The browser
comes from ``browser_support`` (the system chromium; without it the tests skip, except under
``CI`` where they fail). A failing check saves a screenshot into the test's tmp dir and names it
in the assertion message.

An episode's row is found the way a person finds it: its OpenTelemetry trace id (from the step
table, Phoenix or Jaeger) typed into the search box, which matches the metadata's ``trace_id``.
The TRACE ID column shows Trackio's own random log id.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from browser_support import TIMEOUT, media_tables, save_screenshot, wait_for
from otr_scenario import MODEL, TOOL_ERROR, TOOL_FAILS, TOOL_OK, run_python, trackio_traces
from receivers import PhoenixReceiver
from test_trackio_exporter import BAD_EXPRESSION, FINAL_ANSWER, QUESTION, SINGLE_ANSWER, TRACE_UI
from test_trackio_exporter import MODEL as MODEL_OUTCOMES
from test_trackio_exporter import TOOL_ERROR as CALCULATOR_ERROR

EXPECTED_TREE = [  # (depth, name) of one episode's spans in start order, as recorded (Phoenix shows these)
    (0, "episode"),
    (1, "prompt"),
    (1, "turn"),
    (2, f"chat {MODEL}"),
    (2, f"execute_tool {TOOL_OK}"),
    (1, "turn"),
    (2, f"chat {MODEL}"),
    (2, f"execute_tool {TOOL_FAILS}"),
    (1, "reward"),
]
# a failure inside an episode that did not fail is marked "⚠" after its span's name (and in the
# list's status): Trackio's red dot would turn the whole row "error"
FAILED = "\u26a0"
TRACKIO_TREE = [(depth, f"{name} {FAILED}" if name == f"execute_tool {TOOL_FAILS}" else name)
                for depth, name in EXPECTED_TREE]


def _failure_png(driver) -> Path:
    directory = Path(getattr(driver, "otr_failure_dir", "."))
    return directory / f"failure-{len(list(directory.glob('failure-*.png')))}.png"


def _fail(driver, message: str):
    """Fail with a screenshot of what the browser shows (saved in the test's tmp dir)."""
    path = _failure_png(driver)
    saved = driver.save_screenshot(str(path))
    raise AssertionError(f"{message}\nat {driver.current_url}; screenshot: "
                         f"{path if saved else '(could not be saved)'}")


def _expect(driver, ok: Any, message: str) -> None:
    if not ok:
        _fail(driver, message)


def _wait(driver, condition, what: str):
    """``wait_for`` with a screenshot on timeout."""
    return wait_for(driver, condition, what, screenshot=_failure_png(driver))


_FILL = """
import json
import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter
from otr_scenario import record_step
exporters = [TrackioExporter({project!r}, run="browser", trace_ui_url={ui!r})]
{extra}
otr.configure(exporters=exporters, sampler=otr.TailSampler(2, "top_bottom"),
              resource_attributes={{"openinference.project.name": {project!r}}})
recorded = record_step(0, [0.2, 0.9, 0.5])
assert otr.shutdown(60)
print(json.dumps([r.__dict__ for r in recorded]))
"""


def _fill(trackio_dir: Path, project: str, ui: str | None, extra: str = "") -> list[dict]:
    out = run_python(_FILL.format(project=project, ui=ui, extra=extra), trackio_dir)
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def dashboard(trackio_dashboard) -> tuple[str, Path]:
    """The session's Trackio dashboard and its data folder (the session's TRACKIO_DIR): a test
    fills a project of its own name there."""
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    return trackio_dashboard(trackio_dir), trackio_dir


def _depth(row) -> int:
    style = row.get_attribute("style") or ""
    for part in style.split(";"):
        key, _, value = part.partition(":")
        if key.strip() == "--span-depth":
            return int(value.strip())
    raise AssertionError(f"span row without --span-depth: {style!r}")


def test_dashboard_shows_the_episode_tree_with_the_tool_error(browser, dashboard, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    base, trackio_dir = dashboard
    project = "browser-tree"
    recorded = _fill(trackio_dir, project, "http://localhost:16686")
    stored = trackio_traces(trackio_dir, project)
    assert len(stored) == 2

    browser.get(f"{base}/traces?project={project}")
    rows = _wait(browser, lambda d: (r := d.find_elements(By.CSS_SELECTOR, "tr.trace-row"))
                 and len(r) == 2 and r, "two trace rows")
    # the episodes are ok (the failed search did not fail them): the list says so, and that a span failed
    statuses = [_cell(r, STATUS_COLUMN).lower() for r in rows]
    _expect(browser, statuses == [f"ok {FAILED} 1 failed"] * 2, f"list statuses {statuses}, expected rl.status ok")
    best = max(recorded, key=lambda r: r["reward"])
    # rows show the first user message; the best episode is sample 1
    row = next(r for r in rows if f"(sample {best['sample_index']})" in r.text)
    expanded = _expand(browser, row)
    _wait(browser, lambda d: len(expanded.find_elements(
        By.CSS_SELECTOR, ".execution-tree .span-row .span-name")) == len(TRACKIO_TREE),
        "the execution tree")

    span_rows = expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row")
    tree = [(_depth(r), r.find_element(By.CSS_SELECTOR, ".span-name").text) for r in span_rows]
    _expect(browser, tree == TRACKIO_TREE, f"tree {tree}")
    # Trackio's red dot would also turn the episode "Error": the failed call is marked by its name
    dots = expanded.find_elements(By.CSS_SELECTOR, ".span-error-dot")
    _expect(browser, not dots, f"{len(dots)} error dot(s) in an ok episode")

    # the metadata names this trace, links it to Jaeger and lists the failed span
    meta = expanded.find_element(By.CSS_SELECTOR, ".detail-meta").text
    _expect(browser, f"trace_id: {best['trace_id']}" in meta, f"no trace_id in {meta!r}")
    _expect(browser, f"trace_url: http://localhost:16686/trace/{best['trace_id']}" in meta, meta)
    _expect(browser, f"execute_tool {TOOL_FAILS}: ConnectionError: {TOOL_ERROR}" in meta, meta)

    # the failed tool call's panel shows the error
    panel = _select_span(browser, expanded, f"execute_tool {TOOL_FAILS} {FAILED}")
    _wait(browser, lambda d: TOOL_ERROR in _io(panel)["output"], "the tool error in its panel")
    badges = panel.find_element(By.CSS_SELECTOR, ".operation-badges").text.lower()
    _expect(browser, "TOOL" in panel.text and "error (episode ok)" in badges, f"badges {badges!r}")

    save_screenshot(browser, tmp_path / "trackio-trace.png")


# --- one step whose episodes' statuses disagree the way real ones do (see test_trackio_exporter) ---
PROJECT = "browser-rl"
STATUS_COLUMN = 4  # TRACE ID | REQUEST | RUN | STEP | STATUS | ...

_FILL_OUTCOMES = """
import json
import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter
from test_trackio_exporter import TRACE_UI, record_outcomes
otr.configure(exporters=[TrackioExporter({project!r}, run="browser", trace_ui_url=TRACE_UI)],
              sampler=otr.TailSampler(10, "first"))
recorded = record_outcomes()
assert otr.shutdown(60)
print(json.dumps(recorded))
"""


@pytest.fixture(scope="module")
def outcomes(trackio_dashboard) -> tuple[str, dict[str, dict]]:
    """The session's dashboard over a project with ``record_outcomes()``: (base URL, recorded
    episodes, each with ``trackio_id``: the id Trackio shows for it, ``<log id>:<index>``, read
    from its storage by the metadata's ``trace_id``)."""
    trackio_dir = Path(os.environ["TRACKIO_DIR"])
    out = run_python(_FILL_OUTCOMES.format(project=PROJECT), trackio_dir)
    recorded = json.loads(out.strip().splitlines()[-1])
    stored = {t["metadata"]["trace_id"]: t["id"] for t in trackio_traces(trackio_dir, PROJECT)}
    for episode in recorded.values():
        _, log_id, *_, index = stored[episode["trace_id"]].split(":")  # <run id>:<log id>:<key>:<index>
        episode["trackio_id"] = f"{log_id}:{index}"
    return trackio_dashboard(trackio_dir), recorded


def _cell(row, index: int) -> str:
    from selenium.webdriver.common.by import By

    return row.find_elements(By.CSS_SELECTOR, "td")[index].text.strip()


def _open_traces(driver, base: str, count: int):
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/traces?project={PROJECT}")
    return _wait(driver, lambda d: (r := d.find_elements(By.CSS_SELECTOR, "tr.trace-row"))
                 and len(r) == count and r, f"{count} trace rows")


def _row(driver, base: str, recorded: dict[str, dict], name: str):
    """The list row of an episode, found as a person finds it: its OpenTelemetry trace id typed
    into the search box of a freshly opened Traces page, until exactly one row is listed.

    That row must be the episode's (the id Trackio shows for it, in the TRACE ID chip's title):
    a row still listed for an earlier query is never taken for it."""
    from selenium.webdriver.common.by import By

    episode = recorded[name]
    _open_traces(driver, base, len(recorded))
    driver.find_element(By.CSS_SELECTOR, ".search-wrap input").send_keys(episode["trace_id"])

    def found(d):
        rows = d.find_elements(By.CSS_SELECTOR, "tr.trace-row")
        return (len(rows) == 1 and rows[0].find_element(By.CSS_SELECTOR, ".trace-id-chip")
                .get_attribute("title") == episode["trackio_id"] and rows)

    rows = _wait(driver, found, f"exactly one row, {name}'s (Trackio id {episode['trackio_id']}), "
                                f"for its trace id {episode['trace_id']}")
    return rows[0]


def _expand(driver, row):
    """Click a list row; the expanded trace below it, once its execution tree is there."""
    from selenium.webdriver.common.by import By

    row.click()
    below = "following-sibling::tr[1][contains(concat(' ', @class, ' '), ' expanded-row ')]"
    return _wait(driver, lambda d: [e for e in row.find_elements(By.XPATH, below)
                                    if e.find_elements(By.CSS_SELECTOR, ".span-row")],
                 "the expanded trace")[0]


def _select_span(driver, expanded, name: str, index: int = 0):
    """Click the ``index``-th span called ``name`` in the tree; its panel in the inspector."""
    from selenium.webdriver.common.by import By

    rows = [r for r in expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row")
            if r.find_element(By.CSS_SELECTOR, ".span-name").text == name]
    _expect(driver, len(rows) > index, f"no span #{index} named {name!r}")
    rows[index].find_element(By.CSS_SELECTOR, ".span-select").click()
    _wait(driver, lambda d: "span-selected" in rows[index].get_attribute("class"), f"{name} selected")
    return _wait(driver, lambda d: [p for p in expanded.find_elements(By.CSS_SELECTOR, ".operation-panel")
                                    if p.find_element(By.CSS_SELECTOR, "h3").text == name],
                 f"the panel of {name}")[0]


def _io(panel) -> dict[str, str]:
    """The INPUT / OUTPUT (or ERROR) boxes of a span's panel, as shown."""
    from selenium.webdriver.common.by import By

    out = {}
    for section in panel.find_elements(By.CSS_SELECTOR, ".io-grid section"):
        title = section.find_element(By.CSS_SELECTOR, "h4").text.strip().lower()
        out["input" if title == "input" else "output"] = section.find_element(By.CSS_SELECTOR, "pre").text
    return out


def test_list_status_is_the_episodes_rl_status(browser, outcomes, tmp_path: Path) -> None:
    """ok with a failed-then-retried tool, error, truncated: the list says what rl.status says
    (then the marks Trackio has no colour for: a failed span, a truncated episode)."""
    from selenium.webdriver.common.by import By

    base, recorded = outcomes
    marks = {"retried": f" {FAILED} 1 failed", "truncated": f" \u2702 {FAILED} 2 failed"}
    for name, episode in recorded.items():
        shown = _cell(_row(browser, base, recorded, name), STATUS_COLUMN).lower()
        _expect(browser, shown == episode["status"] + marks.get(name, ""),
                f"{name}: the list says {shown!r}, rl.status is {episode['status']!r}")

    # the tool error inside the ok episode stays visible, on its span
    expanded = _expand(browser, _row(browser, base, recorded, "retried"))
    summary = expanded.find_element(By.CSS_SELECTOR, ".trace-summary .status-pill").text.lower()
    _expect(browser, summary == f"ok {FAILED} 1 failed", f"the expanded summary says {summary!r}")
    panel = _select_span(browser, expanded, f"execute_tool calculator {FAILED}")
    badges = panel.find_element(By.CSS_SELECTOR, ".operation-badges").text.lower()
    _expect(browser, "error (episode ok)" in badges, f"the failed call's badges say {badges!r}")
    output = _io(panel)["output"]
    _expect(browser, output == f"error: ValueError: {CALCULATOR_ERROR}", f"its output says {output!r}")
    save_screenshot(browser, tmp_path / "trackio-status-ok.png")

    # the error episode: red, and the failed span is marked in the tree
    expanded = _expand(browser, _row(browser, base, recorded, "crashed"))
    marked = [r.find_element(By.CSS_SELECTOR, ".span-name").text
              for r in expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row")
              if r.find_elements(By.CSS_SELECTOR, ".span-error-dot")]
    _expect(browser, marked == ["episode"], f"spans marked failed in the error episode: {marked}")


def test_chat_span_shows_the_conversation_it_was_given(browser, outcomes) -> None:
    base, recorded = outcomes
    expanded = _expand(browser, _row(browser, base, recorded, "retried"))
    panel = _select_span(browser, expanded, f"chat {MODEL_OUTCOMES}", 2)  # the final answer's
    shown = _io(panel)
    _expect(browser, shown["input"] not in ("", "—"), f"a chat span's Input is {shown['input']!r}")
    for text in (QUESTION, f"I'll compute {BAD_EXPRESSION}.", '"content": "604800.0"'):
        _expect(browser, text in shown["input"], f"{text!r} not in the chat's Input:\n{shown['input']}")
    _expect(browser, FINAL_ANSWER in shown["output"], f"the chat's Output is {shown['output']!r}")


def test_question_answer_and_numbers_read_the_same(browser, outcomes, tmp_path: Path) -> None:
    """REQUEST is the question; the single-turn episode's preview is its answer; a multi-turn
    episode's question and final answer are on its episode span, shown when the row opens; a
    tool result reads the same on its span and in the conversation."""
    from selenium.webdriver.common.by import By

    base, recorded = outcomes
    for name, episode in recorded.items():
        row = _row(browser, base, recorded, name)
        request = row.find_element(By.CSS_SELECTOR, ".request").text
        _expect(browser, request == episode["question"], f"{name}: REQUEST shows {request!r}")
    preview = _row(browser, base, recorded, "single").find_element(By.CSS_SELECTOR, ".preview").text
    _expect(browser, preview == SINGLE_ANSWER, f"the single-turn preview is {preview!r}")

    expanded = _expand(browser, _row(browser, base, recorded, "retried"))
    root = _wait(browser, lambda d: [p for p in expanded.find_elements(By.CSS_SELECTOR, ".operation-panel")
                                     if p.find_element(By.CSS_SELECTOR, "h3").text == "episode"],
                 "the episode span, selected when the row opens")[0]
    shown = _io(root)
    _expect(browser, (shown["input"], shown["output"]) == (QUESTION, FINAL_ANSWER),
            f"the episode span shows {shown}")
    save_screenshot(browser, tmp_path / "trackio-episode.png")

    tool = _io(_select_span(browser, expanded, "execute_tool calculator"))["output"]  # the retry
    expanded.find_element(By.CSS_SELECTOR, ".conversation-section summary").click()
    messages = _wait(browser, lambda d: [m.text for m in expanded.find_elements(
        By.CSS_SELECTOR, '.conversation .message[data-role="tool"]') if m.is_displayed()],
        "the tool messages of the conversation")
    _expect(browser, tool == "604800.0", f"the tool span's output reads {tool!r}")
    _expect(browser, any(m.splitlines()[-1] == tool for m in messages),
            f"no tool message reads {tool!r}: {messages}")


def test_search_by_the_opentelemetry_trace_id_finds_the_episode(browser, outcomes) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    base, recorded = outcomes
    _open_traces(browser, base, len(recorded))
    # the Step select narrows the list to one step
    Select(browser.find_element(By.CSS_SELECTOR, ".filter-wrap select")).select_by_value("1")
    _wait(browser, lambda d: [_cell(r, 3) for r in d.find_elements(By.CSS_SELECTOR, "tr.trace-row")] == ["1"],
          "only step 1's row")

    # the OpenTelemetry trace id (from the step table, Phoenix or Jaeger) finds the episode; the
    # TRACE ID chip shows Trackio's own log id, the metadata our trace id
    episode = recorded["truncated"]
    row = _row(browser, base, recorded, "truncated")
    log_id, index = episode["trackio_id"].split(":")
    chip = row.find_element(By.CSS_SELECTOR, ".trace-id-chip").text
    _expect(browser, chip == f"{log_id[:7]}:{index}", f"the TRACE ID chip shows {chip!r}")
    meta = _expand(browser, row).find_element(By.CSS_SELECTOR, ".detail-meta").text
    _expect(browser, f"Trace ID: {episode['trackio_id']}" in meta
            and f"trace_id: {episode['trace_id']}" in meta, meta)


def test_step_table_lists_the_kept_episodes_worst_first(browser, outcomes, tmp_path: Path) -> None:
    """Media & Tables: one ``rollouts/table`` per step. Trackio 0.43 cannot sort a table in the
    browser (its headers are plain text), so the rows come sorted: lowest reward first."""

    base, recorded = outcomes
    tables = media_tables(browser, f"{base}/media?project={PROJECT}", "rollouts/table",
                          tmp_path / "failure-table.png", count=2)
    for step, rows in tables:
        kept = sorted((e for e in recorded.values() if e["step"] == step), key=lambda e: e["reward"])
        shown = [(r["trace id"], float(r["reward"]), r["status"]) for r in rows]
        _expect(browser, shown == [(e["trace_id"], e["reward"], e["status"]) for e in kept],
                f"step {step}'s table shows {shown}")
        _expect(browser, all(r["link"] == f"{TRACE_UI}/trace/{r['trace id']}" for r in rows), rows)
        _expect(browser, list(rows[0])[:10] == ["reward", "reward parts", "advantage", "status", "failed tools",
                                                "question", "answer", "turns", "input tokens", "output tokens"],
                f"columns {list(rows[0])}")
    save_screenshot(browser, tmp_path / "trackio-table.png")


_OTLP = """
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
exporters.append(OTLPSpanExporter(endpoint={endpoint!r}, timeout=10))
"""


def test_trackio_trace_url_opens_the_trace_in_phoenix(
    browser, phoenix: PhoenixReceiver, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    project = f"browser-phoenix-{uuid.uuid4().hex[:8]}"
    trackio_dir = tmp_path / "trackio"
    recorded = _fill(trackio_dir, project, phoenix.base_url + "/redirects/traces/{trace_id}",
                     _OTLP.format(endpoint=phoenix.http_endpoint))
    worst = min(recorded, key=lambda r: r["reward"])
    phoenix.wait_for_spans(project, len(EXPECTED_TREE), trace_ids=[worst["trace_id"]])
    (stored,) = [t for t in trackio_traces(trackio_dir, project)
                 if t["metadata"]["trace_id"] == worst["trace_id"]]

    browser.get(stored["metadata"]["trace_url"])
    # Phoenix resolves the OpenTelemetry trace id to its project's trace page
    _wait(browser, lambda d: d.current_url.split("?")[0].endswith(f"/traces/{worst['trace_id']}"),
          "Phoenix's trace page")
    # every span name, and the root's OpenInference kind (the "agent" badge of the selected
    # root span), rendered by Phoenix; the page fills in over several requests
    expected = {name for _, name in EXPECTED_TREE} | {project, "agent"}
    _wait(browser, lambda d: all(x in d.find_element(By.TAG_NAME, "body").text for x in expected),
          f"{sorted(expected)} in Phoenix's trace page")
    save_screenshot(browser, tmp_path / "phoenix-trace.png")


def _worst_of_step_40(browser, base: str, project: str):
    """The worst of step 40's two kept episodes (its prompt names cell 0), expanded on the
    Traces page of ``project``."""
    from selenium.webdriver.common.by import By

    browser.get(f"{base}/traces?project={project}")
    rows = _wait(browser, lambda d: (r := d.find_elements(By.CSS_SELECTOR, "tr.trace-row"))
                 and len(r) == 2 and r, "two trace rows (the best and the worst of step 40)")
    return _expand(browser, next(r for r in rows if "cell 0" in r.text))


def test_a_ray_job_shows_the_actors_steps_in_the_episode_tree(browser, trackio_dashboard, ray_cluster,
                                                              tmp_path: Path) -> None:
    """Env steps in a Ray actor and a tool in a Ray task, decorated with ``@otr.traced`` and
    declared with ``@otr.ray_remote``: a researcher opening step 40's worst episode in Trackio
    sees them inside its turn, with their own children."""
    import ray
    import ray_workloads as w
    from selenium.webdriver.common.by import By

    import otel_rollouts as otr
    from otel_rollouts.exporters import TrackioExporter

    project = "browser-ray"
    otr.configure(exporters=[TrackioExporter(project, run="ray")], sampler=otr.TailSampler(2, "top_bottom"),
                  handle_signals=False)
    env = w.ThreadedEnv.remote()
    try:
        for i, reward in enumerate([0.1, 0.8, 0.5]):
            with otr.episode(step=40, sample_index=i) as ep:
                ep.prompt([{"role": "user", "content": f"Move the box to cell {i}."}])
                with ep.turn() as turn:
                    turn.record_generation(f"move {i}", model=MODEL)
                    ray.get(env.step.remote(f"move {i}"))
                    ray.get(w.score.remote(f"cell {i}"))
                ep.reward(reward)
        otr.end_step(40)
    finally:
        assert otr.shutdown(60)
        ray.kill(env.ray_handle)
    expected = [(0, "episode"), (1, "prompt"), (1, "turn"), (2, f"chat {MODEL}"), (2, "execute_tool step"),
                (3, "measure"), (3, "measure"), (2, "execute_tool score"), (3, "measure"), (1, "reward")]
    expanded = _worst_of_step_40(browser, trackio_dashboard(os.environ["TRACKIO_DIR"]), project)
    _wait(browser, lambda d: len(expanded.find_elements(
        By.CSS_SELECTOR, ".execution-tree .span-row .span-name")) == len(expected), "the execution tree")
    span_rows = expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row")
    tree = [(_depth(r), r.find_element(By.CSS_SELECTOR, ".span-name").text) for r in span_rows]
    save_screenshot(browser, tmp_path / "ray-episode.png")
    _expect(browser, tree == expected, f"tree {tree}")
    panel = _select_span(browser, expanded, "execute_tool step")
    _wait(browser, lambda d: "move 0" in _io(panel)["input"], "the env step's action in its panel")
    _wait(browser, lambda d: "move 0:6:12" in _io(panel)["output"], "the env step's observation")
    save_screenshot(browser, Path(os.environ.get("OTR_SCREENSHOTS", tmp_path)) / "ray-step-panel.png")


def test_a_server_behind_the_gateway_shows_in_the_episode(browser, trackio_dashboard, tmp_path: Path) -> None:
    """An OpenTelemetry-instrumented inference server exports to the span gateway: the kept
    episode's tree in Trackio holds the server's request span under the chat span, and the chat
    span's panel shows the engine's queue / prefill / decode timings."""
    import httpx
    from instrumented_server import ENGINE_SPAN, serve, timings
    from selenium.webdriver.common.by import By

    import otel_rollouts as otr
    from otel_rollouts import conventions as c
    from otel_rollouts.exporters import TrackioExporter

    project = "browser-gateway"
    otr.configure(exporters=[TrackioExporter(project, run="gateway")], sampler=otr.TailSampler(2, "top_bottom"),
                  gateway=otr.GatewayOptions(http_port=0, grpc_port=None), handle_signals=False)
    gateway = otr.gateway()
    assert gateway is not None and gateway.http_endpoint
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": gateway.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_BLRP_SCHEDULE_DELAY": "50"}
    try:
        with serve(env) as server:
            client = httpx.Client(base_url=server.url, event_hooks=otr.httpx_event_hooks())
            for i, reward in enumerate([0.1, 0.8, 0.5]):
                with otr.episode(step=40, sample_index=i) as ep:
                    ep.prompt([{"role": "user", "content": f"Move the box to cell {i}."}])
                    with ep.turn() as turn, turn.generation(MODEL) as gen:
                        body = {"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": "go"}]}
                        gen.output(client.post("/v1/chat/completions", json=body).json()["choices"][0]
                                   ["message"]["content"])
                    ep.reward(reward)
            deadline = time.monotonic() + TIMEOUT
            while otr.stats()["totals"].get("gateway.spans", 0) < 3 * 2:  # the server's spans are in
                assert time.monotonic() < deadline, otr.stats()["totals"]
                time.sleep(0.02)
        otr.end_step(40)
    finally:
        assert otr.shutdown(60)
    queue = timings(400)[c.GEN_AI_LATENCY_TIME_IN_QUEUE]
    expanded = _worst_of_step_40(browser, trackio_dashboard(os.environ["TRACKIO_DIR"]), project)
    span_rows = _wait(browser, lambda d: expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row"),
                      "the execution tree")
    tree = [(_depth(r), r.find_element(By.CSS_SELECTOR, ".span-name").text) for r in span_rows]
    chat = next(depth for depth, name in tree if name == f"chat {MODEL}")
    engine = [depth for depth, name in tree if name == ENGINE_SPAN]
    _expect(browser, len(engine) == 1 and engine[0] > chat, f"the engine span under the chat span: {tree}")
    panel = _select_span(browser, expanded, f"chat {MODEL}")
    for summary in panel.find_elements(By.CSS_SELECTOR, "summary"):
        if "Metadata" in summary.text:
            summary.click()  # the span's attributes: folded by default
    _wait(browser, lambda d: c.RL_SERVER_QUEUE_SECONDS in panel.text and str(queue) in panel.text,
          "the server's queue time in the chat span's panel")
    save_screenshot(browser, Path(os.environ.get("OTR_SCREENSHOTS", tmp_path)) / "gateway-episode.png")
