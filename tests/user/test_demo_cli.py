"""The main job: `otel-rollouts demo` fills a local Trackio project with episode trees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from otr_helpers import trackio_rows

from otel_rollouts import conventions as c


@pytest.mark.parametrize("render", ["thread", "process"])
def test_demo_command_fills_trackio(tmp_path, monkeypatch, render):
    """In both render modes; with ``render="process"`` Trackio is written by the renderer
    process, and the summary still says where the traces went."""
    trackio_dir = tmp_path / "trackio"
    env = dict(os.environ, TRACKIO_DIR=str(trackio_dir), **{c.ENV_RENDER: render})
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    exe = shutil.which("otel-rollouts")
    cmd = [exe] if exe else [sys.executable, "-m", "otel_rollouts.cli"]
    proc = subprocess.run(
        [*cmd, "demo", "--project", "demo-test", "--steps", "3", "--prompts", "4",
         "--group-size", "4", "--cap", "5", "--policy", "top_bottom", "--watch", "", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "48 seen, 15 kept" in out
    assert "trackio show --project demo-test" in out
    assert str(trackio_dir) in out and "nothing written" not in out
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    rows = trackio_rows("demo-test")
    assert [r["step"] for r in rows].count(0) == 5 and len(rows) == 15
    names = set()
    tool_errors = 0
    statuses = set()
    for row in rows:
        spans = row["spans"]
        names |= {s["name"] for s in spans}
        # a failed tool call inside an episode that did not fail reads "error (episode ok)"
        tool_errors += sum(1 for s in spans if s["kind"] == "tool" and s["status"].startswith("error"))
        statuses.add(row["metadata"]["rl.status"])
        assert row["messages"][0]["role"] == "system" and row["messages"][1]["role"] == "user"
        assert isinstance(row["metadata"]["rl.reward.score"], float)
        assert isinstance(row["metadata"]["rl.advantage"], float)
    assert {"episode", "prompt", "turn", "chat toy-policy-0.5b", "execute_tool calculator", "reward"} <= names
    assert tool_errors > 0
    assert "truncated" in statuses and "ok" in statuses


def test_printed_commands_run_from_a_shell_that_did_not_activate_the_environment(monkeypatch):
    """The demo's closing lines name ``trackio`` and ``otel-rollouts`` as the user can type them:
    by name when the environment's scripts are on PATH, else by their path (``.venv/bin/trackio``
    after the README's set-up command, which activates nothing)."""
    import sysconfig

    from otel_rollouts import cli

    scripts = sysconfig.get_path("scripts")
    monkeypatch.setenv("PATH", os.pathsep.join([scripts, "/usr/bin", "/bin"]))
    assert cli._command("trackio") == "trackio"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    printed = cli._command("trackio")
    assert printed != "trackio" and os.path.samefile(printed, os.path.join(scripts, "trackio"))
    assert os.access(printed, os.X_OK)


def test_the_dataset_line_names_the_extra_when_it_is_missing(monkeypatch):
    import importlib.util

    from otel_rollouts import cli

    assert cli._dataset_extra_missing() is None  # the test environment has [dataset]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    line = cli._dataset_extra_missing()
    assert line is not None and "[dataset]" in line and " -m pip install " in line, line
