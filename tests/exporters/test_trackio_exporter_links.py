"""Trackio traces carry their OpenTelemetry trace id and a link to the same trace in a trace UI.

Read back from Trackio's own SQLite file, written by TrackioExporter in a fresh interpreter
(``TRACKIO_DIR`` is read when trackio is imported).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
from otr_scenario import SPANS_PER_EPISODE, run_python, trackio_traces
from receivers import PhoenixReceiver

_RECORD = """
import json
import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter
from otr_scenario import record_step
exporters = [TrackioExporter({project!r}, run="links"{ui})]
{extra}
otr.configure(exporters=exporters, sampler=otr.TailSampler(2, "top_bottom"),
              resource_attributes={{"openinference.project.name": {project!r}}})
recorded = record_step(0, [0.2, 0.9, 0.5])
assert otr.shutdown(60)
print(json.dumps({{"recorded": [r.__dict__ for r in recorded]}}))
"""


def _record(tmp_path: Path, project: str, ui: str = "", extra: str = "", **env: str):
    out = run_python(_RECORD.format(project=project, ui=ui, extra=extra), tmp_path / "trackio", **env)
    recorded = json.loads(out.strip().splitlines()[-1])["recorded"]
    traces = trackio_traces(tmp_path / "trackio", project)
    return recorded, traces


def _kept_ids(recorded) -> set[str]:
    best = max(recorded, key=lambda r: r["reward"])
    worst = min(recorded, key=lambda r: r["reward"])
    return {best["trace_id"], worst["trace_id"]}


_CASES = """
import json, os
import otel_rollouts as otr
from otel_rollouts.exporters import TrackioExporter
from otr_scenario import record_step
out = {}
for project, ui, env in [
    ("links-jaeger", "http://localhost:16686/", None),
    ("links-env", None, "http://127.0.0.1:6006/redirects/traces/{trace_id}"),
    ("links-none", None, None),
]:
    os.environ.pop("OTEL_ROLLOUTS_TRACE_UI_URL", None)
    if env:
        os.environ["OTEL_ROLLOUTS_TRACE_UI_URL"] = env
    otr.configure(exporters=[TrackioExporter(project, run="links", trace_ui_url=ui)],
                  sampler=otr.TailSampler(2, "top_bottom"))
    out[project] = [r.__dict__ for r in record_step(0, [0.2, 0.9, 0.5])]
    assert otr.shutdown(60)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[list, list]]:
    """Three configurations in one interpreter (trackio's import is the slow part)."""
    trackio_dir = tmp_path_factory.mktemp("links") / "trackio"
    out = json.loads(run_python(_CASES, trackio_dir).strip().splitlines()[-1])
    return {project: (recorded, trackio_traces(trackio_dir, project))
            for project, recorded in out.items()}


def test_metadata_carries_the_trace_id_and_a_jaeger_link(cases) -> None:
    recorded, traces = cases["links-jaeger"]
    assert len(traces) == 2
    assert {t["metadata"]["trace_id"] for t in traces} == _kept_ids(recorded)
    for trace in traces:
        trace_id = trace["metadata"]["trace_id"]
        assert len(trace_id) == 32 and int(trace_id, 16)
        assert trace["metadata"]["trace_url"] == f"http://localhost:16686/trace/{trace_id}"
        # the metadata belongs to the trace it names: its root span has the same episode data
        root = next(s for s in trace["spans"] if "parent_id" not in s)
        assert root["name"] == "episode"
        assert root["metadata"]["rl.reward.score"] == trace["metadata"]["rl.reward.score"]


def test_trace_ui_url_from_the_environment_as_a_template(cases) -> None:
    recorded, traces = cases["links-env"]
    assert {t["metadata"]["trace_id"] for t in traces} == _kept_ids(recorded)
    for trace in traces:
        trace_id = trace["metadata"]["trace_id"]
        assert trace["metadata"]["trace_url"] == f"http://127.0.0.1:6006/redirects/traces/{trace_id}"


def test_no_link_without_a_trace_ui(cases) -> None:
    recorded, traces = cases["links-none"]
    assert {t["metadata"]["trace_id"] for t in traces} == _kept_ids(recorded)
    assert all("trace_url" not in t["metadata"] for t in traces)


_OTLP = """
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
exporters.append(OTLPSpanExporter(endpoint={endpoint!r}, timeout=10))
"""


def test_phoenix_link_names_a_trace_phoenix_holds(phoenix: PhoenixReceiver, tmp_path: Path) -> None:
    """Trackio + OTLP to Phoenix in one run: each Trackio trace links to its Phoenix trace."""
    project = f"links-phoenix-{uuid.uuid4().hex[:8]}"
    template = phoenix.base_url + "/redirects/traces/{trace_id}"
    recorded, traces = _record(
        tmp_path, project, ui=f", trace_ui_url={template!r}",
        extra=_OTLP.format(endpoint=phoenix.http_endpoint),
    )
    kept = _kept_ids(recorded)
    phoenix.wait_for_spans(project, 2 * SPANS_PER_EPISODE, trace_ids=sorted(kept))
    prefix = phoenix.base_url + "/redirects/traces/"
    for trace in traces:
        url = trace["metadata"]["trace_url"]
        assert url.startswith(prefix)
        trace_id = url[len(prefix):]
        assert trace_id == trace["metadata"]["trace_id"] and trace_id in kept
        spans = phoenix.spans(project, trace_id=trace_id)
        assert len(spans) == SPANS_PER_EPISODE
        # the same span ids on both sides
        assert {s["context"]["span_id"] for s in spans} == {s["id"] for s in trace["spans"]}
        # the route is Phoenix's UI (a client-side redirect, followed in test_trackio_browser)
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert "text/html" in response.headers.get("content-type", "")
