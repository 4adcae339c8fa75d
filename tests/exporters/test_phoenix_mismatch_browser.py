"""What a researcher sees of train–inference mismatch in a real Phoenix (headless Chromium): the
episode made to diverge is found by its metadata, and its generation span's attributes show the
statistics and the worst token, with both logprobs.

Episodes go over OTLP/HTTP into Phoenix (a real server process on loopback); Debian's chromium,
driven by selenium, reads Phoenix's own UI. A failing wait leaves a screenshot and names it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
from browser_support import click_when_ready, save_screenshot, wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from receivers import PhoenixReceiver
from test_phoenix_browser import _tree_node

import otel_rollouts as otr
from otel_rollouts import conventions as c

WORST = "Lima"  # the token the trainer finds far less likely than the engine did


def _record(phoenix: PhoenixReceiver, project: str) -> str:
    otr.configure(
        service_name="phoenix-mismatch-browser",
        exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)],
        sampler=otr.TailSampler(2, "mismatch"),
        resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project},
    )
    rng = np.random.default_rng(7)
    words = ["The", " capital", " of", " Peru", " is", " Lima", "."]
    diverging = None
    try:
        for i in range(6):
            engine = np.log(rng.uniform(0.2, 1.0, len(words))).astype(np.float32)
            trainer = engine + rng.normal(0, 0.01, len(words)).astype(np.float32)
            if i == 4:
                trainer[5] -= 3.5
            with otr.episode(step=0, sample_index=i) as ep:
                ep.prompt("Name the capital of Peru.")
                with ep.turn() as turn:
                    turn.record_generation("".join(words), model="policy", logprobs=engine,
                                           trainer_logprobs=trainer, tokens=words)
                ep.reward(1.0)
            if i == 4:
                diverging = ep.trace_id
    finally:
        assert otr.shutdown(timeout=60)
    assert diverging is not None
    return diverging


def test_the_diverging_generation_shows_its_worst_token_in_phoenix(phoenix: PhoenixReceiver, browser,
                                                                   tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    project = f"mismatch-{uuid.uuid4().hex[:8]}"
    trace_id = _record(phoenix, project)
    phoenix.wait_for_spans(project, 5, trace_ids=[trace_id])  # episode, prompt, turn, chat, reward
    browser.get(f"{phoenix.base_url}/redirects/traces/{trace_id}")
    click_when_ready(browser, lambda d: next(iter(d.find_elements(By.XPATH, _tree_node("chat policy"))), None),
                     "the chat span in the trace tree", tmp_path / "phoenix-mismatch-trace.png")
    click_when_ready(browser, lambda d: next(iter(d.find_elements(By.XPATH, "//*[@role='tab' and normalize-space(.)='Attributes']")), None),
                     "the span's Attributes tab", tmp_path / "phoenix-mismatch-tab.png")
    expected = ["mismatch", "worst", "token", WORST, "rollout_logprob", "trainer_logprob", "kl"]
    wait_for(browser, lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in expected),
             f"{expected} in the generation's attributes", tmp_path / "phoenix-mismatch-attributes.png")
    save_screenshot(browser, tmp_path / "phoenix-mismatch-attributes.png")
