"""Files we write are opened as the spool opens its own: no symbolic link followed, another
user's (or a hard-linked) file refused, mode 0600 (issue 28: OtlpJsonFileExporter leaked)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_rollouts import conventions as c
from otel_rollouts.exporters import OtlpJsonFileExporter

SECRET_PROMPT = "the prompt nobody else may read"


def _spans():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span("episode") as span:
        span.set_attribute(c.GEN_AI_INPUT_MESSAGES, SECRET_PROMPT)
    provider.shutdown()
    return memory.get_finished_spans()


def test_a_planted_symlink_receives_nothing(tmp_path: Path) -> None:
    target = tmp_path / "attacker-readable.txt"
    target.write_text("")
    path = tmp_path / "spans.jsonl"
    path.symlink_to(target)
    exporter = OtlpJsonFileExporter(path)
    assert exporter.export(_spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert SECRET_PROMPT not in target.read_text()


def test_a_dangling_planted_symlink_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "created-by-us.txt"
    path = tmp_path / "spans.jsonl"
    path.symlink_to(target)
    exporter = OtlpJsonFileExporter(path)
    assert exporter.export(_spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert not target.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's file needs root")
def test_another_users_world_writable_file_receives_nothing(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text("")
    os.chown(path, 65534, 65534)
    os.chmod(path, 0o666)
    exporter = OtlpJsonFileExporter(path)
    assert exporter.export(_spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert SECRET_PROMPT not in path.read_text()


def test_a_hard_linked_file_receives_nothing(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.txt"
    other.write_text("")
    path = tmp_path / "spans.jsonl"
    os.link(other, path)
    exporter = OtlpJsonFileExporter(path)
    assert exporter.export(_spans()) is SpanExportResult.FAILURE
    exporter.shutdown()
    assert SECRET_PROMPT not in other.read_text()


def test_our_own_wider_file_is_narrowed_to_0600_and_written(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text("")
    os.chmod(path, 0o666)
    exporter = OtlpJsonFileExporter(path)
    assert exporter.export(_spans()) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SECRET_PROMPT in path.read_text()
