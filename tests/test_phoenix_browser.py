"""What a researcher sees in a real Phoenix: each episode's question and answer in the trace list,
LLM spans rendered as chat (with the tool call), the reward on the evaluator span.

Episodes go over OTLP/HTTP into Phoenix (a real server process on loopback, see receivers.py);
Debian's chromium, driven by selenium, reads Phoenix's own UI. A failing wait leaves a
screenshot in the test's tmp directory and names it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from browser_support import chromium, save_screenshot, wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from receivers import PhoenixReceiver

import otel_rollouts as otr
from otel_rollouts import conventions as c

pytestmark = [pytest.mark.browser, pytest.mark.receiver]

EPISODES = [  # question, answer, reward: each row of the trace list must be told apart
    ("How many legs do 3 spiders have?", "Three spiders have 24 legs.", 1.0),
    ("What is 12 squared?", "12 squared is 140.", 0.0),
    ("Name the capital of Peru.", "The capital of Peru is Lima.", 0.8),
]
SYSTEM = "You are a careful assistant."
TOOL = "calculator"


def _record(phoenix: PhoenixReceiver, project: str) -> list[str]:
    otr.configure(
        service_name="phoenix-browser",
        exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)],
        sampler=otr.TailSampler(10, "first"),
        resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project},
    )
    trace_ids = []
    try:
        for i, (question, answer, reward) in enumerate(EPISODES):
            with otr.episode(step=0, group_id="g0", sample_index=i) as ep:
                ep.prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
                with ep.turn() as turn:  # the input messages are left to the library: the conversation
                    turn.record_generation("Let me work it out.", model="policy", input_tokens=20, output_tokens=5,
                                           tool_calls=[{"id": f"c{i}", "type": "function",
                                                        "function": {"name": TOOL, "arguments": '{"x": 1}'}}])
                    with turn.tool_call(TOOL, arguments={"x": 1}, call_id=f"c{i}") as call:
                        call.result(7 * (i + 1))
                with ep.turn() as turn:
                    turn.record_generation(answer, model="policy", finish_reason="stop")
                ep.reward(reward, components={"correct": reward}, advantage=reward - 0.6)
                ep.finish(reason="stop")
            trace_ids.append(ep.trace_id)
    finally:
        assert otr.shutdown(timeout=60)
    return trace_ids


def _project_id(phoenix: PhoenixReceiver, project: str) -> str:
    (found,) = [p["id"] for p in phoenix._get_json("/v1/projects")["data"] if p["name"] == project]
    return found


def test_phoenix_lists_each_episode_by_question_and_answer_and_renders_chat(
    phoenix: PhoenixReceiver, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    project = f"browser-{uuid.uuid4().hex[:8]}"
    trace_ids = _record(phoenix, project)
    phoenix.wait_for_spans(project, 8 * len(EPISODES), trace_ids=trace_ids)

    with chromium(tmp_path / "profile") as browser:
        # the trace list: one row per episode, its question as input and its answer as output
        browser.get(f"{phoenix.base_url}/projects/{_project_id(phoenix, project)}")
        texts = [t for question, answer, _ in EPISODES for t in (question, answer)]
        wait_for(browser, lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in texts),
                 "each episode's question and answer in Phoenix's list", tmp_path / "phoenix-list.png")
        save_screenshot(browser, tmp_path / "phoenix-list.png")

        # an LLM span in Phoenix's message view: the conversation up to it, and the tool call it made
        question, answer, _ = EPISODES[2]  # reward 0.8
        browser.get(f"{phoenix.base_url}/redirects/traces/{trace_ids[2]}")
        chats = wait_for(browser, lambda d: d.find_elements(By.XPATH, "//*[normalize-space(text())='chat policy']"),
                         "the chat spans in the trace tree", tmp_path / "phoenix-trace.png")
        chats[-1].click()  # the second turn: it saw the prompt, the first answer and the tool's result
        expected = ["Messages", "system", SYSTEM, "user", question, "assistant", "Let me work it out.",
                    "tool", "21", answer]
        wait_for(browser, lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in expected),
                 f"{expected} in the LLM span's message view", tmp_path / "phoenix-llm.png")
        save_screenshot(browser, tmp_path / "phoenix-llm.png")
        chats[0].click()
        wait_for(browser, lambda d: "Tool Call" in d.find_element(By.TAG_NAME, "body").text,
                 "the first turn's tool call in its output", tmp_path / "phoenix-tool-call.png")

        # the reward, where an evaluator's result is shown
        browser.find_element(By.XPATH, "//*[normalize-space(text())='reward']").click()
        wait_for(browser, lambda d: '"reward": 0.8' in d.find_element(By.TAG_NAME, "body").text,
                 "the reward on the evaluator span", tmp_path / "phoenix-reward.png")
        save_screenshot(browser, tmp_path / "phoenix-reward.png")
