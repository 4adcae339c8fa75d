"""Shared pytest fixtures.

The tests are grouped by the data path's folders (``record/``, ``decode/``, ``sampling/``,
``delivery/``, ``exporters/``, ``correlate/``, ``adapters/``), what a user runs (``user/``:
the README, the docs' snippets, the examples, the CLI) and, at the top, what crosses them
(architecture, public API, instances, containment, hardening). Helpers shared by all live at the
top (``otr_helpers``, ``receivers``, ``frameworks``...); a test module may import another
group's module by name (a Trackio server started the same way), so every group folder is on
``sys.path`` whichever file is run alone.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

from suite_paths import GROUPS, TEST_PATHS

sys.path.extend(str(p) for p in GROUPS if str(p) not in sys.path)

# Trackio reads TRACKIO_DIR when it is first imported: point it at a throwaway directory for the
# whole session before anything imports trackio. Tests use their own project names.
# Under pytest-xdist (.ci/run runs two workers) each worker is a session of its own: it gets its own
# (the controller's, inherited, would be shared by both workers).
if os.environ.get("PYTEST_XDIST_WORKER") or "TRACKIO_DIR" not in os.environ:
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="otr-trackio-")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# Ray reads this when it is first imported (a framework's import may be first): with it, a local
# Ray cluster binds and advertises 127.0.0.1 only (tests/correlate/test_ray.py checks its listeners).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import profiles  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from receivers import PhoenixReceiver, require_phoenix_python  # noqa: E402

# hypothesis: the `ci` profile unless `--hypothesis-profile=deep` is given (tests/profiles.py)
settings.load_profile(profiles.CI)

# ---------------------------------------------------------------------------------------------
# Markers, set here from what a test uses (never written by hand, so they cannot drift):
#   browser    the session's Chromium (`browser`)         receiver  the session's Phoenix (`phoenix`)
#   ray        the session's Ray cluster (`ray_cluster`)  frameworks  an RL framework's own code
#   property   a hypothesis property                       slow      marked by hand: > ~5 s alone
#   quick      none of the above: the development tier, `python -m pytest tests -m quick`
# and `matrix`, by hand: a real-framework test whose behaviour depends on the framework's release
# (the version-matrix environments run only those; tests/version_matrix.py).
# ---------------------------------------------------------------------------------------------
_BY_FIXTURE = {"browser": "browser", "chromium_session": "browser", "trackio_dashboard": "browser",
               "phoenix": "receiver", "ray_cluster": "ray"}
_NOT_QUICK = ("browser", "receiver", "ray", "frameworks", "property", "slow")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import frameworks

    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, mark in _BY_FIXTURE.items():
            if fixture in used:
                item.add_marker(mark)
        module = getattr(item, "module", None)
        if module is not None and vars(module).get("require") is frameworks.require:
            item.add_marker("frameworks")
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker("property")
        if not any(item.get_closest_marker(m) for m in _NOT_QUICK):
            item.add_marker("quick")
        group = _worker_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False):
        # the longest units first (Phoenix's tests, then Ray's, then the files sharing a module
        # fixture), so that neither worker is left with a long one at the end; every worker
        # sorts its collection the same way, as pytest-xdist requires
        rank = {"phoenix": 0, "ray": 1}
        items.sort(key=lambda item: rank.get(_worker_group(item) or "", 2 if _worker_group(item) else 3))


def _worker_group(item: pytest.Item) -> str | None:
    """Under pytest-xdist's ``--dist loadgroup`` a group runs on one worker: the tests of the
    session's Phoenix on one and those of its Ray cluster on one (each starts once), a file whose
    tests share a module fixture (a demo run, a filled dashboard, a tiny training) on one (built
    once). Every other test goes wherever a worker is free: the finer the units, the better two
    workers stay busy (measured: grouping every file made the suite 10-20% slower)."""
    if item.get_closest_marker("receiver"):
        return "phoenix"
    if item.get_closest_marker("ray"):
        return "ray"
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        if any(d.scope == "module" for d in defs):
            return item.nodeid.split("::", 1)[0]
    return None


# ---------------------------------------------------------------------------------------------
# Real OTLP receivers (helpers in tests/receivers.py)
#
# `phoenix`: one Arize Phoenix server for the whole session (start-up costs 10-15 s).
# Send to `phoenix.http_endpoint` / `phoenix.grpc_endpoint` (insecure=True); give each test its
# own project (resource attribute `openinference.project.name`) and read back with
# `phoenix.wait_for_spans(project, count, trace_ids=...)`. Skips when Phoenix is not installed,
# fails instead when CI is set.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def phoenix() -> Iterator[PhoenixReceiver]:
    python = require_phoenix_python()
    with PhoenixReceiver(python) as receiver:
        SHARED_ORIGINS.add(receiver.base_url)
        yield receiver


# ---------------------------------------------------------------------------------------------
# The SDK configured with a real in-memory exporter (helpers in tests/otr_helpers.py)
#
# `configured`: the function otr_helpers.configure_memory, with otr.shutdown() after the test.
#   spans = configured(10, "top_bottom", handle_signals=False)
# configures the SDK with a new InMemorySpanExporter (then the exporters given as `also=`),
# sampler TailSampler(cap, policy, **sampler_options) and any other configure() argument, and
# returns the in-memory exporter. Call it again to reconfigure; the last run is shut down.
# `memory`: configured() with its defaults, TailSampler(1000, "first"), for one test.
# `otr_shutdown`: only the otr.shutdown() after the test, for a test that builds its own
# configure() call (other exporters, the returned Rollouts, install=False...).
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# A real local Ray cluster (tests/test_ray*.py): one for the session, on loopback only (the
# environment variable above), its auth token passed in (Ray writes one under the home directory
# otherwise), workers importing tests/ray_workloads.py, stopped with ray.shutdown().
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    import secrets

    import ray
    from ray._private import ray_constants

    assert ray_constants.ENABLE_RAY_CLUSTER is False, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 came too late"
    saved = os.environ.get("RAY_AUTH_TOKEN")
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    context = ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        runtime_env={"env_vars": {"PYTHONPATH": TEST_PATHS}},
    )
    try:
        yield context
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN", None)
        else:
            os.environ["RAY_AUTH_TOKEN"] = saved


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which names each item's group
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup`` every item's id must carry its group (``...@group``), else the
    groups silently do nothing (pytest 9.2 with pytest-xdist 3.8): Phoenix and Ray would start on
    both workers and module fixtures run twice. Stop with the reason instead."""
    grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
    if getattr(session.config.option, "loadgroup", False) and grouped and "@" not in grouped[0].nodeid:
        raise pytest.UsageError("pytest-xdist's --dist loadgroup had no effect on the test ids with "
                                f"pytest {pytest.__version__}: see the pytest pin in pyproject.toml")


# ---------------------------------------------------------------------------------------------
# Debian's Chromium (helpers in tests/browser_support.py): one browser for the session, launched
# at the first test that asks for it. `browser` hands it to a test with a clean slate: one tab on
# about:blank, no cookies, no local or session storage of the pages it visited, the default
# window size, and `driver.otr_failure_dir` = the test's tmp_path (failures save screenshots there).
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def chromium_session(tmp_path_factory):
    from browser_support import chromium

    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


SHARED_ORIGINS: set[str] = set()  # the session's servers a page may have stored settings for


# `trackio_dashboard(trackio_dir)`: the base URL of Trackio's dashboard over that data folder,
# started at its first use and shared by the session (one per folder). Tests that fill a project
# of their own name in the session's TRACKIO_DIR share one dashboard.
@pytest.fixture(scope="session")
def trackio_dashboard(tmp_path_factory):
    from contextlib import ExitStack
    from pathlib import Path

    from browser_support import trackio_dashboard as serve

    logs = tmp_path_factory.mktemp("dashboards")
    bases: dict[Path, str] = {}

    def dashboard(trackio_dir: str | os.PathLike[str]) -> str:
        folder = Path(trackio_dir).resolve()
        if folder not in bases:
            bases[folder] = stack.enter_context(serve(folder, logs / f"dashboard-{len(bases)}.log"))
            SHARED_ORIGINS.add(bases[folder])
        return bases[folder]

    with ExitStack() as stack:
        yield dashboard


@pytest.fixture
def browser(chromium_session, tmp_path):
    from browser_support import reset_browser

    reset_browser(chromium_session, SHARED_ORIGINS)
    chromium_session.otr_failure_dir = tmp_path
    yield chromium_session
    reset_browser(chromium_session, SHARED_ORIGINS)


@pytest.fixture
def otr_shutdown() -> Iterator[None]:
    import otel_rollouts as otr

    yield
    otr.shutdown(timeout=10)


@pytest.fixture
def configured(otr_shutdown):
    """``otr_helpers.configure_memory``: configure with a new in-memory exporter and return it; the
    SDK is shut down after the test (``otr_shutdown``). Saves each test its exporter, sampler and
    shutdown lines."""
    from otr_helpers import configure_memory

    return configure_memory


@pytest.fixture
def memory(configured):
    """The SDK configured with a new InMemorySpanExporter and TailSampler(1000, "first")."""
    return configured()


def pytest_sessionfinish(session, exitstatus) -> None:
    """If the interpreter has not exited two minutes after the last test (a thread or a child
    process that never lets go), print every thread's stack and exit non-zero: CI fails with a
    diagnosis instead of hanging until its time limit."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
