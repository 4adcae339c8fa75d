"""What a researcher sees in a real Phoenix: each episode's question and answer in the trace list,
LLM spans rendered as chat (with the tool call), the reward on the evaluator span; a step's
episodes sorted by their reward annotation (worst first), filtered by reward and by status, and
one session per group of a step (group ids that repeat every step).

Episodes go over OTLP/HTTP into Phoenix (a real server process on loopback, see receivers.py);
Debian's chromium, driven by selenium, reads Phoenix's own UI. A failing wait leaves a
screenshot in the test's tmp directory and names it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from browser_support import click_when_ready, save_screenshot, wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from receivers import PhoenixReceiver
from test_phoenix_integration import (
    GROUPS,
    TRUNCATED,
    _record_groups,
    _reward,
    wait_for_annotations,
)

import otel_rollouts as otr
from otel_rollouts import conventions as c

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


def _tree_node(name: str) -> str:
    """XPath of the span named ``name`` in Phoenix's trace tree (not a pill or a title elsewhere)."""
    return f"//div[contains(@class,'span-node__heading')]/span[normalize-space(text())='{name}']"


def test_phoenix_lists_each_episode_by_question_and_answer_and_renders_chat(
    phoenix: PhoenixReceiver, browser, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    project = f"browser-{uuid.uuid4().hex[:8]}"
    trace_ids = _record(phoenix, project)
    phoenix.wait_for_spans(project, 8 * len(EPISODES), trace_ids=trace_ids)

    # the trace list: one row per episode, its question as input and its answer as output
    browser.get(f"{phoenix.base_url}/projects/{phoenix.project_id(project)}")
    texts = [t for question, answer, _ in EPISODES for t in (question, answer)]
    wait_for(browser, lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in texts),
             "each episode's question and answer in Phoenix's list", tmp_path / "phoenix-list.png")
    save_screenshot(browser, tmp_path / "phoenix-list.png")

    # an LLM span in Phoenix's message view: the conversation up to it, and the tool call it made
    question, answer, _ = EPISODES[2]  # reward 0.8
    browser.get(f"{phoenix.base_url}/redirects/traces/{trace_ids[2]}")
    def chat(index: int):
        return lambda d: len(e := d.find_elements(By.XPATH, _tree_node("chat policy"))) == 2 and e[index]

    # the second turn: it saw the prompt, the first answer and the tool's result
    click_when_ready(browser, chat(-1), "the second chat span in the trace tree", tmp_path / "phoenix-trace.png")
    expected = ["Messages", "system", SYSTEM, "user", question, "assistant", "Let me work it out.",
                "tool", "21", answer]
    wait_for(browser, lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in expected),
             f"{expected} in the LLM span's message view", tmp_path / "phoenix-llm.png")
    save_screenshot(browser, tmp_path / "phoenix-llm.png")
    click_when_ready(browser, chat(0), "the first chat span", tmp_path / "phoenix-trace.png")
    wait_for(browser, lambda d: "Tool Call" in d.find_element(By.TAG_NAME, "body").text,
             "the first turn's tool call in its output", tmp_path / "phoenix-tool-call.png")

    # the reward, where an evaluator's result is shown
    # the tree's node (an annotation pill named reward may be on the page too)
    click_when_ready(browser, lambda d: next(iter(d.find_elements(By.XPATH, _tree_node("reward"))), None),
                     "the reward span in the tree")
    wait_for(browser, lambda d: '"reward": 0.8' in d.find_element(By.TAG_NAME, "body").text,
             "the reward on the evaluator span", tmp_path / "phoenix-reward.png")
    save_screenshot(browser, tmp_path / "phoenix-reward.png")


# --- step 40's worst episode, as a researcher finds it -------------------------------------------
def _rows(browser) -> list[str]:
    from selenium.webdriver.common.by import By

    return [row.text for row in browser.find_elements(By.CSS_SELECTOR, "tbody tr")]


def _question(key: tuple[int, str, int]) -> str:
    step, group, i = key
    return f"step {step} group {group} sample {i}"  # what _record_groups asks


def _spans_page(phoenix: PhoenixReceiver, project_id: str, condition: str) -> str:
    import urllib.parse

    return (f"{phoenix.base_url}/projects/{project_id}/spans?"
            + urllib.parse.urlencode({"spanFilterCondition": condition}))


def test_phoenix_finds_step_40s_worst_episode_by_reward_status_and_session(
    phoenix: PhoenixReceiver, browser, tmp_path: Path
) -> None:
    """Sorted by the reward annotation (worst first), filtered by reward and by status, the
    session holding one group of one step, the truncated episode shown as truncated, and each
    evaluation event naming its score."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    project = f"browser-groups-{uuid.uuid4().hex[:8]}"
    # configure() makes a stock OTLP exporter aimed at a Phoenix post the annotations
    exporter = OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)
    traces, _ = _record_groups(exporter, project, "run-b")
    wait_for_annotations(phoenix, project, len(GROUPS), 4)
    project_id = phoenix.project_id(project)
    step40 = sorted((k for k in GROUPS if k[0] == 40), key=lambda k: _reward(*k))
    worst = step40[0]
    assert worst == TRUNCATED

    body = lambda d: d.find_element(By.TAG_NAME, "body").text  # noqa: E731
    # 1. step 40's episodes, with the reward and status annotations as columns
    browser.get(_spans_page(phoenix, project_id, "metadata['step'] == 40 and parent_id is None"))
    wait_for(browser, lambda d: len(_rows(d)) == len(step40) and all(_question(k) in body(d) for k in step40),
             "step 40's six episodes", tmp_path / "phoenix-step40.png")
    browser.find_element(By.XPATH, "//button[normalize-space(.)='Columns']").click()
    for column in ("annotations-score-reward", "annotations-score-status", "metadata", "error", "userId",
                   "annotations", "startTime", "latencyMs", "cumulativeTokenCountTotal",
                   "cumulativeTokenCostTotal"):  # shown: reward, status, metadata; hidden: the rest
        click_when_ready(browser, lambda d, col=column: d.find_element(
            By.CSS_SELECTOR, f"li[data-column-id='{col}'] label"), f"the {column} column")
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)
    browser.find_element(By.XPATH, "//button[@aria-label='Hide aside panel']").click()
    # 2. sorted by the reward column: the first click sorts descending, the second ascending
    header = "th[data-column-id='annotations-score-reward'] div.sort"
    expected = [_question(k) for k in step40]
    click_when_ready(browser, lambda d: d.find_element(By.CSS_SELECTOR, header), "the reward column")
    wait_for(browser, lambda d: order_any(d, step40) == expected[::-1], "best first", tmp_path / "phoenix-sorted.png")
    browser.find_element(By.CSS_SELECTOR, header).click()
    wait_for(browser, lambda d: order_any(d, step40) == expected, f"worst first: {expected}", tmp_path / "phoenix-sorted.png")
    first = _rows(browser)[0]
    assert f"{_reward(*worst):.2f}" in first and "truncated" in first  # its reward, and truncated
    assert [row.split("\n").count("truncated") for row in _rows(browser)] == [1, 0, 0, 0, 0, 0]
    save_screenshot(browser, tmp_path / "phoenix-step40-worst-first.png")

    # 3. filtered by the reward annotation, then by the status annotation
    low = [k for k in GROUPS if _reward(*k) < 0.55]
    assert len(low) == 6
    browser.get(_spans_page(phoenix, project_id, "evals['reward'].score < 0.55 and parent_id is None"))
    wait_for(browser, lambda d: sorted(order_any(d, low)) == sorted(_question(k) for k in low),
             f"the {len(low)} episodes with reward < 0.55", tmp_path / "phoenix-low-reward.png")
    save_screenshot(browser, tmp_path / "phoenix-low-reward.png")
    browser.get(_spans_page(phoenix, project_id, "evals['status'].label == 'truncated'"))
    wait_for(browser, lambda d: order_any(d, GROUPS) == [_question(TRUNCATED)],
             "only the truncated episode", tmp_path / "phoenix-truncated.png")
    save_screenshot(browser, tmp_path / "phoenix-truncated.png")

    # 4. its session: the three episodes of its group at step 40, nothing of steps 38 and 39
    browser.get(f"{phoenix.base_url}/redirects/traces/{traces[worst]}")
    click_when_ready(browser, lambda d: d.find_element(By.XPATH, "//a[normalize-space(.)='View Session']"),
                     "the trace's View Session button", tmp_path / "phoenix-trace.png")
    group = [k for k in GROUPS if k[:2] == worst[:2]]
    others = [k for k in GROUPS if k[:2] != worst[:2]]
    def session(d) -> str:  # the session drawer (the sessions list stays behind it)
        return "\n".join(e.text for e in d.find_elements(By.CSS_SELECTOR, "section[role=dialog]"))

    wait_for(browser, lambda d: "Session\nrun-b/train/40/p1" in session(d)
             and all(_question(k) in session(d) for k in group),
             "the session of step 40's group p1", tmp_path / "phoenix-session.png")
    text = session(browser)
    assert not [k for k in others if _question(k) in text]
    assert "Turns\n3" in text and "truncated" in text
    save_screenshot(browser, tmp_path / "phoenix-session.png")

    # 5. the root's evaluation events (on the span evaluated): each names its score and value
    browser.get(f"{phoenix.base_url}/redirects/traces/{traces[worst]}")
    click_when_ready(browser, lambda d: d.find_element(By.XPATH, _tree_node("episode")),
                     "the episode span in the trace tree", tmp_path / "phoenix-trace.png")
    click_when_ready(browser, lambda d: d.find_element(
        By.XPATH, "//*[@role='tab' and starts-with(normalize-space(.),'Events')]"), "the Events tab")
    click_when_ready(browser, lambda d: d.find_element(
        By.XPATH, "//*[normalize-space(text())='gen_ai.evaluation.result']"), "an evaluation event")
    wait_for(browser, lambda d: f"reward = {_reward(*worst)}" in body(d),
             "the expanded event saying which score it is", tmp_path / "phoenix-events.png")
    save_screenshot(browser, tmp_path / "phoenix-events.png")


def order_any(browser, keys) -> list[str]:
    """The questions of ``keys`` in the rows shown, in order (rows of other episodes as they read)."""
    questions = [_question(k) for k in keys]
    return [next((q for q in questions if q in row), row) for row in _rows(browser)]
