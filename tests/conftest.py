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
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="otr-trackio-"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# Ray reads this when it is first imported (a framework's import may be first): with it, a local
# Ray cluster binds and advertises 127.0.0.1 only (tests/correlate/test_ray.py checks its listeners).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
from receivers import PhoenixReceiver, require_phoenix_python  # noqa: E402

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
