"""The ``otel-rollouts`` command line: a user mistake is one line and exit status 2, never a
traceback; ``--version``, ``--help``; replay says what was delivered and what failed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from otlp_sink import OtlpSink, free_port
from otr_scenario import SPANS_PER_EPISODE, record_step

import otel_rollouts as otr
from otel_rollouts import cli
from otel_rollouts.exporters import OtlpJsonFileExporter
from otel_rollouts.sampling.compose import POLICIES

TIMEOUT = 120  # seconds, for every command: none may hang


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment without OTEL_* settings of the caller, Trackio kept under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["TRACKIO_DIR"] = str(tmp_path / "trackio")
    env.update(extra)
    return env


def _cli(tmp_path: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_rollouts.cli", *args],
        env=_env(tmp_path, **extra_env), capture_output=True, text=True, timeout=TIMEOUT,
        cwd=tmp_path,
    )


def _one_line_usage_error(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert done.stdout == ""
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def otlp_json_file(tmp_path: Path, otr_shutdown) -> Path:
    """An OTLP/JSON-lines file of 4 kept episodes (2 steps, 2 kept of 3 each)."""
    path = tmp_path / "rollouts.jsonl"
    otr.configure(exporters=[OtlpJsonFileExporter(path)], sampler=otr.TailSampler(2, "top_bottom"))
    record_step(0, [0.2, 0.8, 0.5])
    record_step(1, [0.7, 0.3, 0.6])
    assert otr.shutdown(60)
    assert len(path.read_text().splitlines()) == 4
    return path


# --- user mistakes: one line, exit 2 ----------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["demo", "--policy", "nonsense"], ["--policy", "'nonsense'", "top_bottom"]),
        (["demo", "--policy", "errors+nonsense"], ["--policy", "'nonsense'"]),
        (["demo", "--policy", "errors+"], ["--policy"]),
        (["demo", "--steps", "-1"], ["--steps", "-1", ">= 1"]),
        (["demo", "--steps", "0"], ["--steps", ">= 1"]),
        (["demo", "--steps", "many"], ["--steps", "'many'"]),
        (["demo", "--prompts", "0"], ["--prompts", ">= 1"]),
        (["demo", "--group-size", "0"], ["--group-size", ">= 1"]),
        (["demo", "--cap", "-1"], ["--cap", ">= 0"]),
        (["demo", "--seed", "x"], ["--seed", "'x'"]),
        (["demo", "--project", ""], ["--project", "empty"]),
        (["demo", "--trace-ui-url", "localhost:16686"], ["--trace-ui-url", "localhost:16686"]),
        (["demo", "--no-such-option"], ["--no-such-option"]),
        (["nonsense"], ["'nonsense'"]),
        ([], ["required"]),
        (["replay", "FILE", "--to", "nowhere"], ["--to", "'nowhere'", "otlp"]),
        (["replay", "FILE"], ["--to"]),
        (["replay", "FILE", "--to", "otlp", "--timeout", "0"], ["--timeout", "'0'"]),
        (["replay", "FILE", "--to", "otlp", "--timeout", "soon"], ["--timeout", "'soon'"]),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    (tmp_path / "FILE").write_text("")
    _one_line_usage_error(_cli(tmp_path, *args), *expected)


def test_replaying_a_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    _one_line_usage_error(_cli(tmp_path, "replay", str(tmp_path), "--to", "console"),
                          str(tmp_path), "directory")


def test_replaying_a_missing_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    _one_line_usage_error(_cli(tmp_path, "replay", str(missing), "--to", "console"),
                          "no such file", str(missing))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads files whatever their mode")
def test_replaying_a_file_without_read_permission_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "secret.jsonl"
    path.write_text("{}\n")
    path.chmod(0)
    _one_line_usage_error(_cli(tmp_path, "replay", str(path), "--to", "console"), str(path))


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_replaying_a_file_that_fails_to_read_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # it exists and access() allows it (even to root), but reading fails (EIO at offset 0)
    _one_line_usage_error(_cli(tmp_path, "replay", "/proc/self/mem", "--to", "console"),
                          "/proc/self/mem", "cannot read")


# --- unexpected errors: one line and exit 1, the traceback only when debugging -----------------
def _boom(*args, **kwargs):
    raise RuntimeError("boom\nsecond line")


def test_an_unexpected_error_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path: Path) -> None:
    from otel_rollouts.delivery import replay

    (tmp_path / "f.jsonl").write_text("")
    monkeypatch.setattr(replay, "make_exporter", _boom)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    assert cli.main(["replay", str(tmp_path / "f.jsonl"), "--to", "console"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"otel-rollouts replay: unexpected error: RuntimeError: boom second line "
        f"(set {cli.DEBUG_ENV}=1 for the traceback)"
    ]
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["replay", str(tmp_path / "f.jsonl"), "--to", "console"])


# --- --version and --help --------------------------------------------------------------------
def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    done = _cli(tmp_path, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"otel-rollouts {version('otel-rollouts')}\n"


def test_help_lists_policies_defaults_and_the_debug_switch(tmp_path: Path) -> None:
    top = _cli(tmp_path, "--help")
    assert top.returncode == 0 and "--version" in top.stdout and cli.DEBUG_ENV in top.stdout
    demo = _cli(tmp_path, "demo", "--help")
    assert demo.returncode == 0, demo.stderr
    text = " ".join(demo.stdout.split())  # help is wrapped
    for name in POLICIES:
        assert name in text
    assert "joined by '+'" in text
    for default in ("(default: errors+slowest+mismatch+top_bottom+degenerate_groups)", "(default: 4)",
                    "(default: 16)", "(default: 20)",
                    "(default: 0)", "(default: 0,3,6)", "(default: otel-rollouts-demo)"):
        assert default in text, default
    assert cli.DEBUG_ENV in text
    replay = _cli(tmp_path, "replay", "--help")
    assert replay.returncode == 0 and "--timeout" in replay.stdout and "default" in replay.stdout


# --- commands that work -------------------------------------------------------------------------
def test_a_tiny_demo_runs(tmp_path: Path) -> None:
    done = _cli(tmp_path, "demo", "--steps", "1", "--prompts", "2", "--group-size", "2",
                "--cap", "3", "--policy", "errors+top_bottom", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # prompt 0 is on the default watchlist: its 2 episodes are kept outside the cap
    assert "episodes: 4 seen, 4 kept (cap 3 per step, policy errors+top_bottom; 2 for watched prompts " \
        "0, 3, 6, outside the cap)" in done.stdout
    assert str(tmp_path / "trackio") in done.stdout
    assert (tmp_path / "trackio").is_dir()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_replay_to_an_otlp_receiver_that_is_down_reports_nothing_delivered(
    tmp_path: Path, otlp_json_file: Path, protocol: str
) -> None:
    port = free_port()  # bound, then closed: nothing listens there
    done = _cli(tmp_path, "replay", str(otlp_json_file), "--to", "otlp", "--timeout", "1",
                OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "replayed" not in done.stderr
    summary = done.stderr.splitlines()[-1]
    assert summary.startswith("otel-rollouts replay: delivery failed: 0 traces (0 spans) delivered, "
                              f"4 traces ({4 * SPANS_PER_EPISODE} spans) failed"), summary
    assert "1 of 1 batches refused by otlp" in summary


def test_replay_to_an_otlp_receiver_that_refuses_reports_nothing_delivered(
    tmp_path: Path, otlp_json_file: Path
) -> None:
    with OtlpSink(tmp_path / "sink") as sink:
        sink.control(status=400)  # a permanent refusal: no retries
        done = _cli(tmp_path, "replay", str(otlp_json_file), "--to", "otlp", "--timeout", "1",
                    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=sink.endpoint,
                    OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        assert sink.state()["refused"] >= 1
    assert done.returncode == 1, done.stderr
    assert "delivery failed: 0 traces (0 spans) delivered, 4 traces" in done.stderr.splitlines()[-1]


def test_replay_to_a_live_otlp_receiver_reports_everything_delivered(
    tmp_path: Path, otlp_json_file: Path
) -> None:
    with OtlpSink(tmp_path / "sink") as sink:
        done = _cli(tmp_path, "replay", str(otlp_json_file), "--to", "otlp", "--timeout", "10",
                    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=sink.endpoint,
                    OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        received = sink.spans()  # the sink writes before it answers: all there once we are done
    assert done.returncode == 0, done.stderr
    assert len(received) == 4 * SPANS_PER_EPISODE
    assert len({s["trace_id"] for s in received}) == 4
    summary = done.stderr.splitlines()[-1]
    assert summary == (f"replayed 4 traces ({4 * SPANS_PER_EPISODE} spans) from {otlp_json_file} "
                       "to otlp: 4 traces delivered, 0 failed")


def test_replay_counts_a_failed_flush_as_failed(
    monkeypatch, capsys, tmp_path: Path, otlp_json_file: Path
) -> None:
    # Trackio persists at flush: an error there means nothing is confirmed delivered
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_rollouts.delivery import replay

    class FlushFails(InMemorySpanExporter):
        def force_flush(self, timeout_millis: int = 30000) -> bool:
            raise OSError("disk full")

    monkeypatch.setattr(replay, "make_exporter", lambda *a: FlushFails())
    assert cli.main(["replay", str(otlp_json_file), "--to", "trackio"]) == 1
    summary = capsys.readouterr().err.splitlines()[-1]
    assert "0 traces (0 spans) delivered, 4 traces" in summary
    assert "flush failed: disk full" in summary
