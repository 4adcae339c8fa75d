"""A dataset row opens its trace: the worst episode of a step, found with DuckDB in the Parquet
the dataset command wrote, opens by its link in a real Phoenix (headless Chromium reads the
page) and by its trace id in Trackio's search."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from browser_support import save_screenshot, wait_for
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from receivers import PhoenixReceiver

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.exporters import OtlpJsonFileExporter, TrackioExporter

duckdb = pytest.importorskip("duckdb")

STEPS, SIZE = 3, 6


def _answer(step: int, k: int) -> str:
    return f"Step {step} sample {k}: the answer is {step * 10 + k}."


def test_the_worst_row_of_a_step_opens_its_trace_in_phoenix_and_trackio(phoenix: PhoenixReceiver,
                                                                         tmp_path: Path, browser) -> None:
    from selenium.webdriver.common.by import By

    project = f"ds-rt-{uuid.uuid4().hex[:8]}"
    file = tmp_path / "kept.jsonl"
    otr.configure(
        service_name="dataset-roundtrip",
        exporters=[OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=10),
                   OtlpJsonFileExporter(str(file)), TrackioExporter(project, run="rt")],
        sampler=otr.TailSampler(SIZE, "first"),
        resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project},
    )
    try:
        for step in range(STEPS):
            for k in range(SIZE):
                with otr.episode(step=step, group_id=f"g{step}", sample_index=k) as ep:
                    ep.prompt([{"role": "user", "content": f"Question of step {step}?"}])
                    with ep.turn() as turn:
                        turn.record_generation(_answer(step, k), model="policy", output_tokens=9)
                    ep.reward((k * 5 + step) % SIZE / SIZE)
            otr.end_step(step)
    finally:
        assert otr.shutdown(timeout=60)

    ui = f"{phoenix.base_url}/redirects/traces/{{trace_id}}"
    result = otr.build_dataset([file], tmp_path / "flat", format="flat", hf=False, trace_ui_url=ui,
                               progress=False)
    assert result.rows == STEPS * SIZE
    ((trace_id, link, answer, reward),) = duckdb.sql(
        f"SELECT trace_id, link, final_answer, reward FROM '{result.parquet}' WHERE step = 1 "
        "ORDER BY reward LIMIT 1").fetchall()
    worst_k = min(range(SIZE), key=lambda k: (k * 5 + 1) % SIZE)
    assert answer == _answer(1, worst_k) and reward == 0.0
    assert link == ui.replace("{trace_id}", trace_id)

    # Trackio's search box (and `trackio list traces --search`) finds the row's episode by its id
    from trackio.sqlite_storage import SQLiteStorage

    found = SQLiteStorage.get_traces(project, "rt", search=trace_id)
    assert [t["metadata"]["trace_id"] for t in found] == [trace_id]
    assert found[0]["messages"][-1]["content"] == answer

    phoenix.wait_for_spans(project, 4, trace_ids=[trace_id])
    browser.get(link)
    wait_for(browser, lambda d: answer in d.find_element(By.TAG_NAME, "body").text,
             f"the worst episode's answer {answer!r} on the page its row's link opens",
             tmp_path / "phoenix-row-link.png")
    assert trace_id in browser.current_url or "/traces/" in browser.current_url
    save_screenshot(browser, tmp_path / "phoenix-row-link.png")
