"""Debian's chromium driven by selenium, for the tests that look at a viewer as a person does.

Only the system browser is used (``/usr/bin/chromium`` + ``/usr/bin/chromedriver``): nothing
downloads a browser. Without them a test skips, except under ``CI`` where it fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from receivers import free_ports, in_ci

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TIMEOUT = 60  # seconds for a page to show what we wait for (the machine is shared and slow)
WINDOW = (1600, 1100)


def unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"{reason} (CI must install chromium and chromium-driver: see .ci/run)")
    pytest.skip(reason)


@contextmanager
def chromium(profile: Path) -> Iterator:
    """A headless chromium session (quit on exit)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        unavailable(f"{CHROMIUM} / {CHROMEDRIVER} not installed (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--no-first-run", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                f"--user-data-dir={profile}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def trackio_dashboard(trackio_dir: Path, log_path: Path) -> Iterator[str]:
    """Trackio's dashboard for ``trackio_dir`` on a free loopback port, in its own process
    (stopped by its pid); yields its base URL. Tests share one per data folder for the session
    (conftest's ``trackio_dashboard`` fixture); a test that must stop or break one starts its own."""
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_"))}
    env.update(TRACKIO_DIR=str(trackio_dir), BROWSER="true")
    code = ("import trackio; trackio.show(open_browser=False, block_thread=True, "
            f"host='127.0.0.1', server_port={port})")
    log = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:  # a server starting up, not a page: polled by HTTP
            assert proc.poll() is None, log_path.read_text()[-2000:]
            try:
                with urllib.request.urlopen(base + "/", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "Trackio dashboard did not answer"
            time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        log.close()


def reset_browser(driver, origins: Iterable[str] = ()) -> None:
    """Give a shared browser a clean slate for the next test: one tab on about:blank, no cookies,
    the default window size, and the storage cleared of the page it shows and of ``origins``
    (the session's servers: Trackio and Phoenix keep view settings in local storage). A test may
    leave the browser anywhere."""
    handles = driver.window_handles
    for handle in handles[1:]:
        driver.switch_to.window(handle)
        driver.close()
    driver.switch_to.window(handles[0])
    for origin in {*origins, _origin(driver.current_url)}:
        if origin:
            driver.execute_cdp_cmd("Storage.clearDataForOrigin", {"origin": origin, "storageTypes": "all"})
    driver.get("about:blank")
    driver.delete_all_cookies()
    driver.set_window_size(*WINDOW)


def _origin(url: str) -> str | None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme in ("http", "https") else None


def wait_for(driver, condition, what: str, screenshot: Path | None = None):
    """Wait until ``condition(driver)`` is truthy; on timeout fail with the page's text (and a
    screenshot at ``screenshot``, named in the message). An element the page re-rendered
    meanwhile (stale) counts as not there yet."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, TIMEOUT, poll_frequency=0.2,
                             ignored_exceptions=[StaleElementReferenceException]).until(condition)
    except TimeoutException:
        saved = ""
        if screenshot is not None and driver.save_screenshot(str(screenshot)):
            saved = f" (screenshot: {screenshot})"
        raise AssertionError(f"timed out after {TIMEOUT} s waiting for {what}{saved}; at {driver.current_url}:\n"
                             f"{driver.find_element('tag name', 'body').text[:2000]}") from None


def save_screenshot(driver, path: Path) -> Path:
    """A PNG of the page (checked to be one), also copied to $OTEL_ROLLOUTS_SCREENSHOT_DIR if set."""
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    keep = os.environ.get("OTEL_ROLLOUTS_SCREENSHOT_DIR")  # optional: collect them for a look
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


def click_when_ready(driver, find, what: str, screenshot: Path | None = None):
    """Click the element ``find(driver)`` returns, once the page lets a click reach it: right
    after a navigation Phoenix is still laying the page out, and another element (a panel
    sliding in, a spinner) takes the click. Retried until it lands or ``wait_for`` times out;
    returns the element."""
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        ElementNotInteractableException,
    )

    def clicked(d):
        element = find(d)
        if not element:
            return False
        try:
            element.click()
        except (ElementClickInterceptedException, ElementNotInteractableException):
            return False
        return element

    return wait_for(driver, clicked, what, screenshot)


def media_tables(driver, url: str, key: str, screenshot: Path | None = None,
                 count: int | None = None) -> list[tuple[int, list[dict[str, str]]]]:
    """(step, rows as the page shows them, by lowercase column) of the tables logged under
    ``key`` on Trackio's Media & Tables page at ``url``, newest step first (the page's order);
    waits until ``count`` of them show (None: at least one)."""

    def sections(d):
        # one script per poll, not a WebDriver round trip per element: a run's page holds
        # hundreds of tables
        found = d.execute_script(_TABLES_SCRIPT, key)
        return (len(found) == count if count is not None else bool(found)) and found

    driver.get(url)
    out = []
    for header, columns, cells in wait_for(driver, sections, f"{count or 'the'} tables {key}", screenshot):
        columns = [c.strip().lower() for c in columns]
        rows = [dict(zip(columns, (t.strip() for t in row), strict=True)) for row in cells]
        out.append((int(header.rsplit("Step:", 1)[1].split()[0]), rows))
    return out


# the tables of one key on the Media & Tables page as the page shows them (rendered text):
# [header, [column names], [[cell texts] per row]] per table, in the page's order
_TABLES_SCRIPT = """
const text = (e) => (e ? e.innerText : '');
return [...document.querySelectorAll('.table-section')]
  .filter((s) => text(s.querySelector('.media-label')).trim() === arguments[0])
  .map((s) => [text(s.querySelector('.table-header')),
               [...s.querySelectorAll('thead th')].map(text),
               [...s.querySelectorAll('tbody tr')].map((tr) => [...tr.querySelectorAll('td')].map(text))]);
"""


def scroll_to_table(driver, key: str, index: int = 0) -> None:
    """Bring the ``index``-th table of ``key`` on the Media & Tables page into view."""
    from selenium.webdriver.common.by import By

    sections = [s for s in driver.find_elements(By.CSS_SELECTOR, ".table-section")
                if s.find_element(By.CSS_SELECTOR, ".media-label").text.strip() == key]
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", sections[index])
