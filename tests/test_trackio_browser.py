"""What a user sees: Debian's chromium, driven by selenium, on the Trackio dashboard and Phoenix's UI.

The Trackio dashboard is served on loopback (``trackio.show`` in a subprocess) for a project
filled by otel_rollouts; the test opens the Traces page, expands a trace and reads the execution
tree. A second test follows a Trackio trace's ``trace_url`` into Phoenix's UI. Only the system
browser is used (``/usr/bin/chromium`` + ``/usr/bin/chromedriver``): nothing downloads a
browser. Without them the tests skip, except under ``CI`` where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from otr_scenario import MODEL, TOOL_ERROR, TOOL_FAILS, TOOL_OK, run_python, trackio_traces
from receivers import PhoenixReceiver, free_ports, in_ci

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TIMEOUT = 60  # seconds for a page to show what we wait for (the machine is shared and slow)

EXPECTED_TREE = [  # (depth, name) in the order the dashboard lists them
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


def _unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"{reason} (CI must install chromium and chromium-driver: see .ci/run)")
    pytest.skip(reason)


@pytest.fixture
def browser(tmp_path: Path):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        _unavailable(f"{CHROMIUM} / {CHROMEDRIVER} not installed (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--no-first-run", "--window-size=1400,1000",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, TIMEOUT, poll_frequency=0.2).until(condition)
    except TimeoutException:
        raise AssertionError(f"timed out after {TIMEOUT} s waiting for {what}; at {driver.current_url}:\n"
                             f"{driver.find_element('tag name', 'body').text[:2000]}") from None


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
def dashboard(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Trackio's dashboard on a free loopback port, in its own process (stopped by pid)."""
    trackio_dir = tmp_path / "trackio"
    trackio_dir.mkdir()
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(trackio_dir), BROWSER="true")
    code = ("import trackio; trackio.show(open_browser=False, block_thread=True, "
            f"host='127.0.0.1', server_port={port})")
    log = open(tmp_path / "dashboard.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(base + "/", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "Trackio dashboard did not answer"
            time.sleep(0.2)
        yield base, trackio_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        log.close()


def _depth(row) -> int:
    style = row.get_attribute("style") or ""
    for part in style.split(";"):
        key, _, value = part.partition(":")
        if key.strip() == "--span-depth":
            return int(value.strip())
    raise AssertionError(f"span row without --span-depth: {style!r}")


def _screenshot(driver, path: Path) -> Path:
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    keep = os.environ.get("OTEL_ROLLOUTS_SCREENSHOT_DIR")  # optional: collect them for a look
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


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
    best = max(recorded, key=lambda r: r["reward"])
    # rows show the first user message; the best episode is sample 1
    row = next(r for r in rows if f"(sample {best['sample_index']})" in r.text)
    row.click()
    expanded = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "tr.expanded-row"),
                     "the expanded trace")[0]
    _wait(browser, lambda d: len(expanded.find_elements(
        By.CSS_SELECTOR, ".execution-tree .span-row .span-name")) == len(EXPECTED_TREE),
        "the execution tree")

    span_rows = expanded.find_elements(By.CSS_SELECTOR, ".execution-tree .span-row")
    tree = [(_depth(r), r.find_element(By.CSS_SELECTOR, ".span-name").text) for r in span_rows]
    assert tree == EXPECTED_TREE
    errors = [name for (_, name), r in zip(tree, span_rows, strict=True)
              if r.find_elements(By.CSS_SELECTOR, ".span-error-dot")]
    assert errors == [f"execute_tool {TOOL_FAILS}"]  # only the failed tool call is marked

    # the metadata names this trace and links it to Jaeger
    meta = expanded.find_element(By.CSS_SELECTOR, ".detail-meta").text
    assert f"trace_id: {best['trace_id']}" in meta
    assert f"trace_url: http://localhost:16686/trace/{best['trace_id']}" in meta

    # the failed tool call's panel shows the error
    failed = span_rows[[n for _, n in tree].index(f"execute_tool {TOOL_FAILS}")]
    failed.find_element(By.CSS_SELECTOR, ".span-select").click()
    panel = _wait(browser, lambda d: [p for p in d.find_elements(By.CSS_SELECTOR, ".operation-panel")
                                      if TOOL_FAILS in p.text], "the tool's panel")[0]
    _wait(browser, lambda d: TOOL_ERROR in panel.text, "the tool error in its panel")
    assert "TOOL" in panel.text and "Error" in panel.text

    _screenshot(browser, tmp_path / "trackio-trace.png")


_OTLP = """
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
exporters.append(OTLPSpanExporter(endpoint={endpoint!r}, timeout=10))
"""


@pytest.mark.receiver
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
    _screenshot(browser, tmp_path / "phoenix-trace.png")
