"""What a researcher reads off a real Phoenix (headless Chromium) for the questions of a multi-step
GRPO run: step 40's worst episode (its answer, the tool that failed, its reward and why), why
step 42 was slow (the episode, its slowest stage and span), where the rollout policy drifted
(the step, the token), how a watched prompt evolved, and why each episode was kept.

One run (steps 40-42, 4 groups of 4 samples each) is recorded through ``otr.configure`` with the
stock OTLP/HTTP exporter to the session's Phoenix and
``TailSampler(8, "errors+slowest+top_bottom+degenerate_groups", watch=[WATCHED])``, with planted
cases: a failed tool call in step 40's worst episode, a tool straggler at step 42, drift in one
token at step 41, a watched prompt at every step, a truncated episode, a degenerate group. The
run is shared by the module's tests; each reads its answer off Phoenix's own pages: the span
list filtered by the ``step`` annotation and sorted by the ``reward`` column, the ``stage`` and
``kl`` columns, the trace tree, the generation's worst-tokens table. Every test saves
screenshots in its tmp dir (also in ``$OTEL_ROLLOUTS_SCREENSHOT_DIR`` when set).
"""

from __future__ import annotations

import re
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from browser_support import click_when_ready, save_screenshot, wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from receivers import PhoenixReceiver
from test_phoenix_browser import _tree_node
from test_phoenix_integration import _roots

import otel_rollouts as otr
from otel_rollouts import conventions as c

STEPS = (40, 41, 42)
GROUPS = ("g0", "g1", "g2", "g3")
SAMPLES = 4
CAP = 8
# a share each for a failure, the straggler, the best and the worst, and the rest for whole
# degenerate groups (a group of four fits)
POLICY = otr.Compose(otr.Errors(1), otr.Slowest(1), otr.TopBottom(top=1, bottom=1), otr.DegenerateGroups(1))
MODEL = "policy"

WATCHED = 3  # the dataset index of the watched prompt: group g3's first sample at every step
WATCHED_EPISODE = ("g3", 0)
WATCHED_QUESTION = "Name the capital of Peru."
WATCHED_ANSWERS = {40: "Peru's capital is Cusco.", 41: "It is Arequipa, I think.", 42: "The capital of Peru is Lima."}
WATCHED_REWARDS = {40: 0.2, 41: 0.5, 42: 0.9}

WORST = (40, "g2", 1)  # step 40's worst: its search tool failed, reward 0
FAILED_TOOL = "search"
TOOL_ERROR = "search backend unavailable"
WORST_ANSWER = "I could not look it up, so I guess 12."

DRIFT = (41, "g3", 3)  # step 41's best; the trainer finds one token far less likely than the engine did
DRIFT_WORDS = ["The", " answer", " is", " Lima", "."]
DRIFT_TOKEN, DRIFT_AT, DRIFT_BY = " Lima", 3, -3.5

STRAGGLER = (42, "g1", 3)  # its sandbox tool runs 0.6 s (a workload, the other tools take none)
ENGINE_STRAGGLER = (42, "g3", 3)  # step 42's best: its first generation waited in the engine's queue
ENGINE_QUEUE_S = 0.45  # what the engine reported (rl.server.queue.seconds), as the gateway copies it
SLOW_TOOL = "sandbox"
STRAGGLE_S = 0.6

TRUNCATED = (41, "g3", 2)  # cut at the length limit
DEGENERATE = (41, "g1")  # every member the same reward


@dataclass
class Run:
    """The recorded run: its Phoenix project, and each episode's trace id and reward."""

    project: str
    project_id: str
    traces: dict[tuple[int, str, int], str]
    rewards: dict[tuple[int, str, int], float]


def _reward(key: tuple[int, str, int]) -> float:
    step, group, i = key
    if key == WORST:
        return 0.0
    if (step, group) == DEGENERATE:
        return 0.5
    if (group, i) == WATCHED_EPISODE:
        return WATCHED_REWARDS[step]
    return round(0.15 + 0.2 * i + 0.04 * GROUPS.index(group) + 0.01 * (step - 40), 2)  # distinct in a step


def _question(key: tuple[int, str, int]) -> str:
    step, group, i = key
    return WATCHED_QUESTION if (group, i) == WATCHED_EPISODE else f"step {step} {group} q{i}: what is 6*7?"


def _answer(key: tuple[int, str, int]) -> str:
    step, group, i = key
    if key == WORST:
        return WORST_ANSWER
    if (group, i) == WATCHED_EPISODE:
        return WATCHED_ANSWERS[step]
    return "".join(DRIFT_WORDS) if key == DRIFT else f"answer {step}-{group}-{i}: 42"


def _record_episode(key: tuple[int, str, int], rng: np.random.Generator) -> str:
    step, group, i = key
    words = DRIFT_WORDS if key == DRIFT else ["answer", " ", "42"]
    engine = np.log(rng.uniform(0.3, 1.0, len(words))).astype(np.float32)
    trainer = engine + rng.normal(0, 0.01, len(words)).astype(np.float32)  # the usual small noise
    if key == DRIFT:
        trainer[DRIFT_AT] += DRIFT_BY
    index = WATCHED if (group, i) == WATCHED_EPISODE else 100 * step + 10 * GROUPS.index(group) + i
    reward = _reward(key)
    with otr.episode(step=step, group_id=group, sample_index=i, dataset_index=index) as ep:
        ep.prompt([{"role": "system", "content": "Use the tools."}, {"role": "user", "content": _question(key)}])
        with ep.turn() as turn:
            gen = turn.record_generation("Let me look it up.", model=MODEL, input_tokens=20, output_tokens=5)
            if key == ENGINE_STRAGGLER:
                gen.set_attribute(c.RL_SERVER_QUEUE_SECONDS, ENGINE_QUEUE_S)
            tool = FAILED_TOOL if key == WORST else SLOW_TOOL if key == STRAGGLER else "calculator"
            with turn.tool_call(tool, arguments={"q": _question(key)}) as call:
                if key == WORST:
                    call.error(ConnectionError(TOOL_ERROR))
                else:
                    if key == STRAGGLER:
                        time.sleep(STRAGGLE_S)  # the straggler's work, not a wait for anything
                    call.result(42)
        with ep.turn() as turn:
            turn.record_generation(_answer(key), model=MODEL, logprobs=engine, trainer_logprobs=trainer,
                                   tokens=words, finish_reason="length" if key == TRUNCATED else "stop")
        ep.reward(reward, components={"correct": float(reward >= 0.5), "format": 0.0 if key == WORST else 1.0},
                  advantage=round(reward - 0.5, 2))
        ep.finish(reason="length" if key == TRUNCATED else "stop",
                  status=c.STATUS_TRUNCATED if key == TRUNCATED else None)
    assert ep.trace_id is not None
    return ep.trace_id


def record_run(phoenix: PhoenixReceiver) -> Run:
    """The run through the real API (the OTLP/HTTP exporter posts the annotations too), until
    Phoenix holds every kept root with its annotations."""
    project = f"researcher-{uuid.uuid4().hex[:8]}"
    otr.configure(service_name="phoenix-researcher",
                  exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)],
                  sampler=otr.TailSampler(CAP, POLICY, watch=[WATCHED]), run_id="run-r",
                  resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project})
    rng = np.random.default_rng(52)
    traces, rewards = {}, {}
    try:
        for step in STEPS:
            for group in GROUPS:
                for i in range(SAMPLES):
                    key = (step, group, i)
                    traces[key] = _record_episode(key, rng)
                    rewards[key] = _reward(key)
            otr.end_step(step)
        assert otr.flush(60)
        kept = otr.stats()["totals"].get("delivered.OTLPSpanExporter")
    finally:
        otr.shutdown(60)
    assert kept, "nothing delivered"
    _wait_for_roots(phoenix, project, kept)
    return Run(project, phoenix.project_id(project), traces, rewards)


def _wait_for_roots(phoenix: PhoenixReceiver, project: str, count: int, timeout: float = 90.0) -> None:
    """Poll Phoenix until ``count`` episode roots are stored, each with its reward and step
    annotations (Phoenix inserts an annotation that came before its span on a retry, 10 s on)."""
    deadline = time.monotonic() + timeout
    while True:
        roots = _roots(phoenix, project, "parent_id is None") if project in phoenix.projects() else []
        if len(roots) >= count and all({"reward", "step"} <= set(r["annotations"]) for r in roots):
            return
        assert time.monotonic() < deadline, f"{len(roots)} of {count} roots annotated after {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def run(phoenix: PhoenixReceiver) -> Run:
    return record_run(phoenix)


# --- the pages -----------------------------------------------------------------------------------
def _spans_page(phoenix: PhoenixReceiver, run: Run, condition: str) -> str:
    return (f"{phoenix.base_url}/projects/{run.project_id}/spans?"
            + urllib.parse.urlencode({"spanFilterCondition": condition}))
# Phoenix's columns shown by default that none of the questions needs (hidden to keep the answer
# in view; Phoenix keeps a project's column choice in the browser's local storage)
_NOISE = ("error", "userId", "annotations", "startTime", "cumulativeTokenCountTotal", "cumulativeTokenCostTotal")
# the span list as a person reads it: one {column id: text} per row, in the page's order
_TABLE_SCRIPT = """
const ids = [...document.querySelectorAll('thead th')].map((th) => th.getAttribute('data-column-id'));
return [...document.querySelectorAll('tbody tr')].map((tr) => Object.fromEntries(
  [...tr.querySelectorAll('td')].map((td, i) => [ids[i], td.innerText.replace('View annotation details', '').trim()])));
"""


def _column(name: str) -> str:
    """The column id of annotation ``name`` in Phoenix's span list."""
    return f"annotations-score-{name}"


def _table(browser) -> list[dict[str, str]]:
    return browser.execute_script(_TABLE_SCRIPT)


def _score(cell: str) -> float:
    """A score column's number (Phoenix writes ``μ 0.81``: the mean of the span's annotations)."""
    return float(cell.removeprefix("μ").strip())


def _span_list(browser, phoenix: PhoenixReceiver, run: Run, condition: str, columns: tuple[str, ...],
               screenshot: Path) -> None:
    """Phoenix's span list filtered by ``condition`` with the annotation ``columns`` ticked in
    its Columns menu (and the aside panel and unneeded default columns hidden).

    The columns are chosen on the list of no episode first, as a person sets them up once:
    Phoenix keeps them for the project (in the browser's local storage), and the list of every
    episode renders a pill per annotation per row in its default *annotations* column, which on
    a busy machine takes longer than a wait allows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(_spans_page(phoenix, run, "evals['step'].score < 0 and parent_id is None"))
    click_when_ready(browser, lambda d: d.find_element(By.XPATH, "//button[@aria-label='Hide aside panel']"),
                     "the aside panel's hide button", screenshot)
    click_when_ready(browser, lambda d: d.find_element(By.XPATH, "//button[normalize-space(.)='Columns']"),
                     "the Columns menu", screenshot)
    for column in (*(_column(name) for name in columns), *_NOISE):
        click_when_ready(browser, lambda d, col=column: d.find_element(
            By.CSS_SELECTOR, f"li[data-column-id='{col}'] label"), f"the {column} column", screenshot)
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)
    wait_for(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, "li[data-column-id]"), "the menu closed",
             screenshot)
    browser.get(_spans_page(phoenix, run, condition))
    wait_for(browser, lambda d: _table(d) and all(_column(name) in (d.execute_script(
        "return [...document.querySelectorAll('thead th')].map((th) => th.getAttribute('data-column-id'))") or [])
        for name in columns), f"the list with the columns {columns}", screenshot)


def _sort(browser, column_id: str, descending: bool) -> None:
    """Sort the span list by a column: its header's first click sorts descending, the second
    ascending."""
    from selenium.webdriver.common.by import By

    header = f"th[data-column-id='{column_id}'] div.sort"
    for _ in range(1 if descending else 2):
        click_when_ready(browser, lambda d: d.find_element(By.CSS_SELECTOR, header), f"the {column_id} header")


def _body(browser) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.TAG_NAME, "body").text


def _open_span(browser, phoenix: PhoenixReceiver, trace_id: str, name: str, index: int, screenshot: Path) -> None:
    """A trace's page with its ``index``-th span named ``name`` selected in the tree."""
    from selenium.webdriver.common.by import By

    browser.get(f"{phoenix.base_url}/redirects/traces/{trace_id}")
    click_when_ready(browser, lambda d: (len(found := d.find_elements(By.XPATH, _tree_node(name))) > index
                                         and found[index]), f"the span {name!r} in the trace tree", screenshot)


# --- Q1: step 40's worst episode: what it said, which tool failed, its reward and why -------------
def test_q1_step_40s_worst_episode_sorted_by_reward_then_its_failed_tool(
        phoenix: PhoenixReceiver, run: Run, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    step40 = sorted((k for k in run.traces if k[0] == 40 and k in _kept(phoenix, run)), key=run.rewards.__getitem__)
    assert step40[0] == WORST
    shot = tmp_path / "q1-step40-worst-first.png"
    _span_list(browser, phoenix, run, "evals['step'].score == 40 and parent_id is None", ("reward", "stage", "kept"),
               shot)
    _sort(browser, _column("reward"), descending=False)
    wait_for(browser, lambda d: [r.get("input_value") for r in _table(d)] == [_question(k) for k in step40],
             f"step 40's {len(step40)} kept episodes, worst reward first", shot)
    first = _table(browser)[0]
    assert first["output_value"].startswith(WORST_ANSWER[:20])  # what it said (the cell cuts it)
    assert _score(first[_column("reward")]) == 0.0
    assert first[_column("kept")] in {c.REASON_BOTTOM, c.REASON_SLOWEST}  # why it is there at all
    save_screenshot(browser, shot)

    # its trace: the failed tool call is marked in the tree; its error says why
    shot = tmp_path / "q1-failed-tool.png"
    _open_span(browser, phoenix, run.traces[WORST], f"execute_tool {FAILED_TOOL}", 0, shot)
    wait_for(browser, lambda d: f"ConnectionError: {TOOL_ERROR}" in _body(d) and "Error" in _body(d),
             "the failed tool call's error", shot)
    save_screenshot(browser, shot)

    # the root: the answer, and every score that made the reward (its annotations, expanded)
    shot = tmp_path / "q1-reward-why.png"
    click_when_ready(browser, lambda d: d.find_element(By.XPATH, _tree_node("episode")), "the episode span", shot)
    click_when_ready(browser, lambda d: d.find_element(By.XPATH, "//*[normalize-space(text())='Annotations']"),
                     "the root's Annotations card", shot)
    click_when_ready(browser, lambda d: d.find_element(
        By.XPATH, "//*[normalize-space(text())='Annotations']/following::button[normalize-space(.)='Table'][1]"),
        "the Annotations card's table view", shot)
    expected = ["reward", "correct", "format", "advantage", "tool", WORST_ANSWER]
    wait_for(browser, lambda d: all(t in _body(d) for t in expected), f"{expected} on the episode", shot)
    save_screenshot(browser, shot)


def _kept(phoenix: PhoenixReceiver, run: Run) -> set[tuple[int, str, int]]:
    """The episodes Phoenix holds (the sampler's choice)."""
    by_trace = {trace: key for key, trace in run.traces.items()}
    return {by_trace[r["trace_id"]] for r in _roots(phoenix, run.project, "parent_id is None")}


# --- Q2: why step 42 was slow: which episode, which stage, which span ---------------------------
def test_q2_step_42s_straggler_by_latency_its_stage_column_and_its_slow_span(
        phoenix: PhoenixReceiver, run: Run, browser, tmp_path: Path) -> None:
    shot = tmp_path / "q2-step42-slowest-first.png"
    _span_list(browser, phoenix, run, "evals['step'].score == 42 and parent_id is None", ("stage", "kept", "queue"),
               shot)
    _sort(browser, "latencyMs", descending=True)
    wait_for(browser, lambda d: (rows := _table(d)) and rows[0].get("input_value") == _question(STRAGGLER),
             "the straggler first, slowest first", shot)
    first = _table(browser)[0]
    assert first[_column("stage")] == c.STAGE_TOOL  # where its time went
    assert first[_column("kept")] == c.REASON_SLOWEST
    save_screenshot(browser, shot)

    # the engine's straggler: the queue column, sorted (the engine's own timing of its generations)
    shot = tmp_path / "q2-engine-queue.png"
    _sort(browser, _column("queue"), descending=True)
    wait_for(browser, lambda d: (rows := _table(d)) and rows[0].get("input_value") == _question(ENGINE_STRAGGLER),
             "the engine straggler first by queue time", shot)
    assert _score(_table(browser)[0][_column("queue")]) == ENGINE_QUEUE_S
    save_screenshot(browser, shot)

    # the stage filter a person types: the tool-bound episodes of the step, the straggler among them
    shot = tmp_path / "q2-tool-bound.png"
    browser.get(_spans_page(phoenix, run, "evals['step'].score == 42 and evals['stage'].label == 'tool'"))
    wait_for(browser, lambda d: _question(STRAGGLER) in [r.get("input_value") for r in _table(d)],
             "the straggler among step 42's tool-bound episodes", shot)
    save_screenshot(browser, shot)

    # its trace: the slow span, with its duration
    shot = tmp_path / "q2-slow-span.png"
    _open_span(browser, phoenix, run.traces[STRAGGLER], f"execute_tool {SLOW_TOOL}", 0, shot)
    wait_for(browser, lambda d: _latency_ms(d, f"execute_tool {SLOW_TOOL}") >= 1000 * STRAGGLE_S
             and f"Tool: {SLOW_TOOL}" in _body(d), f"execute_tool {SLOW_TOOL} taking at least {STRAGGLE_S} s", shot)
    save_screenshot(browser, shot)


def _latency_ms(browser, name: str) -> float:
    """The latency Phoenix's trace tree shows under the span ``name`` (``600ms``, ``1.20s``)."""
    from selenium.webdriver.common.by import By

    nodes = browser.find_elements(By.XPATH, _tree_node(name) + "/../..")
    if not nodes:
        return -1.0
    for line in nodes[0].text.splitlines():
        line = line.strip()
        if line.endswith("ms") and line[:-2].replace(".", "").isdigit():
            return float(line[:-2])
        if line.endswith("s") and line[:-1].replace(".", "").isdigit():
            return 1000 * float(line[:-1])
    return -1.0


# --- Q4: is the rollout policy drifting from the trained one: which step, which tokens ------------
def test_q4_drift_by_the_kl_column_then_the_generations_worst_tokens(
        phoenix: PhoenixReceiver, run: Run, browser, tmp_path: Path) -> None:
    shot = tmp_path / "q4-kl-sorted.png"
    _span_list(browser, phoenix, run, "parent_id is None", ("step", "kl", "reward"), shot)
    _sort(browser, _column("kl"), descending=True)
    wait_for(browser, lambda d: (rows := _table(d)) and rows[0].get("input_value") == _question(DRIFT),
             "the drifting episode first by KL", shot)
    rows = _table(browser)
    assert _score(rows[0][_column("step")]) == DRIFT[0]  # which step
    assert _score(rows[0][_column("kl")]) > 1.0 > 100 * _score(rows[1][_column("kl")])  # far above the rest
    save_screenshot(browser, shot)

    # the generation: its worst tokens as a table on its Info tab (Phoenix shows metadata there)
    shot = tmp_path / "q4-worst-tokens.png"
    _open_span(browser, phoenix, run.traces[DRIFT], f"chat {MODEL}", 1, shot)
    worst = re.compile(rf"'{DRIFT_TOKEN}' at {DRIFT_AT}: Δ (-\d+\.\d+) \(rollout -?\d+\.\d+, trainer -?\d+\.\d+\)")
    found = wait_for(browser, lambda d: "mismatch.worst" in (body := _body(d)) and worst.search(body),
                     f"{worst.pattern!r} in the generation's worst-tokens table", shot)
    assert abs(float(found.group(1)) - DRIFT_BY) < 0.1  # the planted Δ (± the noise of every token)
    assert _body(browser).index(f"'{DRIFT_TOKEN}' at") < _body(browser).index("' at ", found.end())  # worst first
    _scroll_to_text(browser, "mismatch.worst")
    save_screenshot(browser, shot)


def _scroll_to_text(browser, text: str) -> None:
    from selenium.webdriver.common.by import By

    found = browser.find_elements(By.XPATH, f"//*[contains(text(), '{text}')]")
    if found:
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", found[0])


# --- Q3: which groups of step 41 were degenerate -----------------------------------------------
def test_q3_step_41s_degenerate_groups_by_the_group_column(
        phoenix: PhoenixReceiver, run: Run, browser, tmp_path: Path) -> None:
    """The ``group`` column: the members of degenerate groups, by why (``all_equal``, ...), the
    health explained; the all-equal group planted at step 41 and only degenerate ones."""
    shot = tmp_path / "q3-degenerate-groups.png"
    condition = "evals['step'].score == 41 and evals['group'].label != 'none' and parent_id is None"
    _span_list(browser, phoenix, run, condition, ("group", "kept"), shot)
    members = {key for key in _kept(phoenix, run) if key[:2] == DEGENERATE}
    assert members, "the degenerate group was kept (degenerate_groups in the policy)"
    wait_for(browser, lambda d: {r.get("input_value") for r in _table(d)} >= {_question(k) for k in members},
             "the degenerate group's members", shot)
    rows = _table(browser)
    assert {r[_column("group")] for r in rows if r.get("input_value") in {_question(k) for k in members}} == {
        c.DEGENERATE_ALL_EQUAL}
    assert all(r[_column("group")] in (c.DEGENERATE_ALL_EQUAL, c.DEGENERATE_LOST, c.DEGENERATE_ALL_EQUAL_LOST)
               for r in rows)
    save_screenshot(browser, shot)


# --- Q5: how the watched prompt's answer and reward evolved ---------------------------------------
def test_q5_the_watched_prompt_across_steps_by_the_step_column(
        phoenix: PhoenixReceiver, run: Run, browser, tmp_path: Path) -> None:
    shot = tmp_path / "q5-watched.png"
    watch_key = c.RL_WATCH_KEY.removeprefix(c.RL_PREFIX)
    _span_list(browser, phoenix, run, f"metadata['{watch_key}'] == '{WATCHED}' and parent_id is None",
               ("step", "reward", "kept"), shot)
    _sort(browser, _column("step"), descending=False)
    wait_for(browser, lambda d: [r.get("output_value", "")[:12] for r in _table(d)]
             == [WATCHED_ANSWERS[s][:12] for s in STEPS], "the watched prompt's answers, step by step", shot)
    rows = _table(browser)
    assert [_score(r[_column("step")]) for r in rows] == list(STEPS)
    assert [_score(r[_column("reward")]) for r in rows] == [WATCHED_REWARDS[s] for s in STEPS]
    assert {r["input_value"][:12] for r in rows} == {WATCHED_QUESTION[:12]}
    assert {r[_column("kept")] for r in rows} == {c.REASON_WATCH}
    save_screenshot(browser, shot)


# --- Q7: why each episode was kept ---------------------------------------------------------------
def test_q7_why_each_episode_was_kept_by_the_kept_column(
        phoenix: PhoenixReceiver, run: Run, browser, tmp_path: Path) -> None:
    kept = _kept(phoenix, run)
    browser.set_window_size(1600, 2000)  # every row rendered (Phoenix renders the rows in view)
    shot = tmp_path / "q7-kept.png"
    _span_list(browser, phoenix, run, "parent_id is None", ("step", "kept", "status"), shot)
    wait_for(browser, lambda d: len(_table(d)) == len(kept), f"the {len(kept)} kept episodes", shot)
    reasons = {r[_column("kept")] for r in _table(browser)}
    assert {c.REASON_SLOWEST, c.REASON_TOP, c.REASON_WATCH, c.REASON_TRUNCATED} <= reasons
    assert "" not in reasons  # every row says why
    save_screenshot(browser, shot)

    shot = tmp_path / "q7-truncated.png"
    browser.get(_spans_page(phoenix, run, f"evals['kept'].label == '{c.REASON_TRUNCATED}'"))
    wait_for(browser, lambda d: [r.get("input_value") for r in _table(d)] == [_question(TRUNCATED)],
             "the truncated episode, kept as truncated", shot)
    save_screenshot(browser, shot)
