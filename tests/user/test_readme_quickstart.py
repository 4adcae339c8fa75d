"""The docs' Quickstart, extracted from docs/getting-started.md and run verbatim, read back as a
person would (README.md's short Quickstart is run by tests/user/test_docs_snippets.py).

It writes to Trackio (the default exporter) and, through the OpenTelemetry environment
variables the docs name, to a real Phoenix. Each tool call the Quickstart makes must be one
tool call everywhere: one ``execute_tool`` span, one call in the chat span's output, one tool
result in Trackio's conversation; a Phoenix session holds one GRPO group of one step; absent
token usage is absent. Then Chromium opens both viewers on a kept episode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from docs_blocks import first_block
from otr_helpers import trackio_rows
from receivers import PhoenixReceiver

from otel_rollouts import conventions as c


def quickstart_code() -> str:
    """The first ``python`` block under ``## Quickstart`` of docs/getting-started.md."""
    return first_block("getting-started.md", "python", heading="Quickstart")


@pytest.fixture(scope="module")
def quickstart(phoenix: PhoenixReceiver, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("quickstart")
    project = f"quickstart-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "TRACKIO_DIR": str(tmp / "trackio"),
        c.ENV_OTLP_TRACES_ENDPOINT: phoenix.http_endpoint,
        c.ENV_OTLP_TRACES_PROTOCOL: "http/protobuf",
        "OTEL_RESOURCE_ATTRIBUTES": f"{c.OPENINFERENCE_PROJECT_NAME}={project}",
    }
    script = tmp / "quickstart.py"
    script.write_text(quickstart_code())
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    old = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = env["TRACKIO_DIR"]
    try:
        rows = trackio_rows("otel-rollouts")
    finally:
        if old is None:
            os.environ.pop("TRACKIO_DIR")
        else:
            os.environ["TRACKIO_DIR"] = old
    return {"rows": rows, "project": project, "trackio_dir": env["TRACKIO_DIR"],
            "stderr": done.stderr}


def test_quickstart_shows_each_tool_call_once_in_trackio(quickstart) -> None:
    rows = quickstart["rows"]
    assert len(rows) == 24  # 3 steps x 2 prompts x 4 samples, all under the cap of 32
    for row in rows:
        messages = row["messages"]
        tool_results = [m for m in messages if m.get("role") == "tool"]
        calls = [call for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or ()]
        assert len(tool_results) == 1 and len(calls) == 1, messages
        assert calls[0]["id"] == tool_results[0]["tool_call_id"] == "c1"
        tool_spans = [s for s in row["spans"] if str(s.get("name", "")).startswith(c.SPAN_EXECUTE_TOOL)]
        assert len(tool_spans) == 1


def test_quickstart_shows_each_tool_call_once_in_phoenix(phoenix: PhoenixReceiver, quickstart) -> None:
    spans = phoenix.wait_for_spans(quickstart["project"], 24 * 6)
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        by_trace[span["context"]["trace_id"]].append(span)
    assert len(by_trace) == 24
    for trace_spans in by_trace.values():
        names = Counter(s["name"].split(" ")[0] for s in trace_spans)
        assert names[c.SPAN_EXECUTE_TOOL] == 1 and names[c.SPAN_CHAT] == 1, names
        (chat,) = [s for s in trace_spans if s["name"].startswith(c.SPAN_CHAT)]
        assert chat["span_kind"] == c.OI_LLM
        ids = {v for k, v in chat["attributes"].items()
               if k.startswith(c.OI_LLM_OUTPUT_MESSAGES) and k.endswith(c.OI_TOOL_CALL_ID)}
        assert ids == {"c1"}
        (output,) = json.loads(chat["attributes"][c.GEN_AI_OUTPUT_MESSAGES])
        assert "finish_reason" not in output  # deprecated there: the span's finish reasons say it
        assert list(chat["attributes"][c.GEN_AI_RESPONSE_FINISH_REASONS]) == [c.FINISH_TOOL_CALL]
        # the Quickstart's generation gives no usage: no token count, not a count of 0
        assert not [k for k in chat["attributes"] if k.startswith("llm.token_count")]


def test_quickstart_sessions_hold_one_group_of_one_step(phoenix: PhoenixReceiver, quickstart) -> None:
    spans = phoenix.wait_for_spans(quickstart["project"], 24 * 6)
    roots = [s for s in spans if s["parent_id"] is None]
    sessions: dict[str, set] = defaultdict(set)
    for root in roots:
        attributes = root["attributes"]
        sessions[attributes[c.OI_SESSION_ID]].add((attributes[c.RL_STEP], attributes[c.RL_GROUP_ID]))
    # group ids p0 and p1 repeat every step: 3 steps x 2 groups = 6 sessions of 4 episodes
    assert len(sessions) == 6
    assert all(len(groups) == 1 for groups in sessions.values())


def test_quickstart_in_phoenix_and_trackio_as_a_person_sees_it(phoenix: PhoenixReceiver, quickstart, browser,
                                                                trackio_dashboard, tmp_path: Path) -> None:
    """Phoenix's chat span says "1 tool call" and shows one; Trackio's conversation holds one tool
    result, its tree one execute_tool span."""
    from browser_support import click_when_ready, save_screenshot, wait_for
    from selenium.webdriver.common.by import By
    from test_phoenix_browser import _tree_node
    from test_trackio_browser import _expand

    spans = phoenix.wait_for_spans(quickstart["project"], 24 * 6)
    trace_id = spans[0]["context"]["trace_id"]

    def body(driver) -> str:
        return driver.find_element(By.TAG_NAME, "body").text

    browser.get(f"{phoenix.base_url}/redirects/traces/{trace_id}")
    chats = wait_for(browser, lambda d: d.find_elements(By.XPATH, _tree_node("chat qwen-0.5b")),
                     "the chat span in the trace tree", tmp_path / "phoenix-trace.png")
    wait_for(browser, lambda d: d.find_elements(By.XPATH, _tree_node("reward")), "the whole trace tree")
    tools = browser.find_elements(By.XPATH, _tree_node("execute_tool calculator"))
    assert len(chats) == 1 and len(tools) == 1
    click_when_ready(browser, lambda d: next(iter(d.find_elements(By.XPATH, _tree_node("chat qwen-0.5b"))), None),
                     "the chat span", tmp_path / "phoenix-chat.png")
    wait_for(browser, lambda d: "Tool Call: c1" in body(d), "the tool call in the chat span's output",
             tmp_path / "phoenix-chat.png")
    text = body(browser)
    assert "1 tool call" in text and "2 tool calls" not in text and text.count("Tool Call:") == 1
    save_screenshot(browser, tmp_path / "quickstart-phoenix-chat.png")

    base = trackio_dashboard(quickstart["trackio_dir"])  # its own folder: the default project name
    browser.get(f"{base}/traces?project=otel-rollouts")
    rows = wait_for(browser, lambda d: (r := d.find_elements(By.CSS_SELECTOR, "tr.trace-row")) and r,
                    "the Quickstart's traces in Trackio", tmp_path / "trackio-list.png")
    expanded = _expand(browser, rows[0])
    names = [e.text for e in expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-name")]
    assert names.count("execute_tool calculator") == 1, names
    expanded.find_element(By.CSS_SELECTOR, ".conversation-section summary").click()
    tool_messages = wait_for(browser, lambda d: [
        m for m in expanded.find_elements(By.CSS_SELECTOR, '.conversation .message[data-role="tool"]')
        if m.is_displayed()], "the tool result in the conversation", tmp_path / "trackio-conv.png")
    assert len(tool_messages) == 1
    save_screenshot(browser, tmp_path / "quickstart-trackio.png")
