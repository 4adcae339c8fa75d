"""Secrets never leave the process: content capture off is honoured by every exporter, secrets in
captured content are redacted before any exporter (or the on-disk spool) sees them, OTLP auth
headers travel over TLS and are never logged, Trackio's write token is never printed.

Every output is read back and searched for the secret text: in-memory spans, the console
exporter's stream, Trackio's SQLite file (raw), the OTLP/JSON file, what a real OTLP receiver
process received, and the spool files.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from otr_helpers import self_signed_certificate as _certificate

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.redaction import Redactor
from otel_rollouts.exporters import ConsoleExporter, OtlpJsonFileExporter, TrackioExporter

REPO = Path(__file__).resolve().parent.parent
SECRET = "PURPLE-ELEPHANT-7731"  # stands for a prompt, a completion, an argument, a result


def _record(secret: str = SECRET) -> None:
    @otr.traced(kind="tool")
    def lookup(query: str) -> str:
        return f"found {secret}"

    @otr.traced(kind="generation", model="policy")
    def generate(messages) -> str:
        return f"the answer is {secret}"

    @otr.traced
    def helper(x: str) -> dict:
        return {"echo": x}

    with otr.episode(step=0, group_id="g", sample_index=0) as ep:
        ep.prompt([{"role": "system", "content": f"sys {secret}"}, {"role": "user", "content": f"q {secret}"}])
        with ep.turn() as turn:
            turn.record_generation(f"thinking {secret}", model="policy", messages=[{"role": "user", "content": secret}])
            with turn.tool_call("search", arguments={"q": secret}, call_id="c1") as call:
                call.result({"hit": secret})
            turn.feedback(f"env says {secret}")
            generate([{"role": "user", "content": secret}])
            lookup(secret)
            helper(secret)
        ep.reward(1.0)
    otr.end_step(0)


def _outputs(tmp_path: Path, project: str) -> dict[str, object]:
    return {
        "memory": InMemorySpanExporter(),
        "console": ConsoleExporter(stream=io.StringIO()),
        "trackio": TrackioExporter(project, run="r"),
        "file": OtlpJsonFileExporter(tmp_path / "spans.jsonl"),
    }


def _read_back(outputs: dict, tmp_path: Path, project: str, sink: OtlpSink | None = None) -> dict[str, str]:
    texts: dict[str, str] = {}
    spans = outputs["memory"].get_finished_spans()
    texts["memory"] = json.dumps(
        [
            {"name": s.name, "attrs": dict(s.attributes or {}), "status": s.status.description,
             "events": [dict(e.attributes or {}) for e in s.events]}
            for s in spans
        ],
        default=str,
    )
    texts["console"] = outputs["console"]._stream.getvalue()
    db = sqlite3.connect(Path(os.environ["TRACKIO_DIR"]) / f"{project}.db")
    try:
        rows = db.execute("SELECT * FROM traces").fetchall()
    finally:
        db.close()
    texts["trackio"] = "\n".join(
        (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)) for row in rows for v in row
    )
    texts["file"] = (tmp_path / "spans.jsonl").read_text()
    if sink is not None:
        texts["otlp"] = sink.out.read_text()
    return texts


@pytest.fixture
def sink(tmp_path):
    with OtlpSink(tmp_path / "sink") as s:
        yield s


@pytest.mark.parametrize("how", ["argument", "env"])
def test_capture_off_keeps_content_out_of_every_exporter(tmp_path, sink, monkeypatch, how, otr_shutdown):
    project = f"sec-off-{uuid.uuid4().hex[:6]}"
    outputs = _outputs(tmp_path, project)
    otlp = OTLPSpanExporter(endpoint=sink.endpoint, timeout=5)
    if how == "env":
        monkeypatch.setenv(c.ENV_CAPTURE_CONTENT, "false")
        kwargs = {}
    else:
        monkeypatch.delenv(c.ENV_CAPTURE_CONTENT, raising=False)
        kwargs = {"capture_content": False}
    otr.configure(exporters=[*outputs.values(), otlp], sampler=otr.TailSampler(5, "first"), **kwargs)
    _record()
    assert otr.flush(timeout=30)
    texts = _read_back(outputs, tmp_path, project, sink)
    spans = outputs["memory"].get_finished_spans()
    assert len([s for s in spans if s.name.startswith(c.SPAN_EXECUTE_TOOL)]) == 2  # the episode was exported
    assert len(sink.spans()) == len(spans)
    for name, text in texts.items():
        assert text, f"{name}: nothing exported"
        assert SECRET not in text, f"content leaked into {name}"


def test_capture_on_is_the_control(tmp_path, otr_shutdown, monkeypatch):
    """The same read-back finds the text when capture is on: the test above can fail."""
    monkeypatch.delenv(c.ENV_CAPTURE_CONTENT, raising=False)
    project = f"sec-on-{uuid.uuid4().hex[:6]}"
    outputs = _outputs(tmp_path, project)
    otr.configure(exporters=list(outputs.values()), sampler=otr.TailSampler(5, "first"))
    _record()
    assert otr.flush(timeout=30)
    texts = _read_back(outputs, tmp_path, project)
    del texts["console"]  # the console tree shows names and numbers only, never content
    for name, text in texts.items():
        assert SECRET in text, name


PRIVATE_KEY = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6\n-----END RSA PRIVATE KEY-----"
SECRETS = {
    "openai key": "sk-proj-Zk3v9QmT2xLp8RfW4nYb6HcJ",
    "hf token": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    "bearer": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "password": "hunter2-Correct-Horse",
    "aws": "AKIAIOSFODNN7EXAMPLE",
    "private key body": "MIIEowIBAAKCAQEAu1SU1LfVLPHCozMxH2Mo4lgOEePzNm0tRgeLezV6",
    "custom": "ACME-INTERNAL-88123",
    "callback": "project-bluebird",
}


def _secret_text() -> str:
    return (
        f"use {SECRETS['openai key']} and {SECRETS['hf token']}\n"
        f"Authorization: Bearer {SECRETS['bearer']}\n"
        f'{{"password": "{SECRETS["password"]}", "region": "eu"}}\n'
        f"aws {SECRETS['aws']}\n{PRIVATE_KEY}\n"
        f"ticket {SECRETS['custom']} for {SECRETS['callback']}"
    )


def test_secrets_are_redacted_before_any_exporter_or_the_spool(tmp_path, otr_shutdown, monkeypatch):
    monkeypatch.delenv(c.ENV_CAPTURE_CONTENT, raising=False)
    project = f"sec-red-{uuid.uuid4().hex[:6]}"
    outputs = _outputs(tmp_path, project)
    down = OtlpSink(tmp_path / "down")  # never started: its batches go to the spool on disk
    spool = tmp_path / "spool"
    otr.configure(
        exporters=[*outputs.values(), OTLPSpanExporter(endpoint=down.endpoint, timeout=0.5)],
        sampler=otr.TailSampler(5, "first"),
        redact=lambda text: text.replace("project-bluebird", "[CODENAME]"),
        redact_patterns=[r"ACME-INTERNAL-\d+"],
        spool_dir=spool,
    )
    _record(_secret_text())
    otr.flush(timeout=10)
    texts = _read_back(outputs, tmp_path, project)
    texts["spool"] = b"".join(p.read_bytes() for p in spool.rglob("*.otlp")).decode("utf-8", "replace")
    assert texts["spool"], "nothing was spooled"
    for name, text in texts.items():
        for what, secret in SECRETS.items():
            assert secret not in text, f"{what} leaked into {name}"
        assert "BEGIN RSA PRIVATE KEY" not in text
    assert "[REDACTED]" in texts["memory"] and "[CODENAME]" in texts["memory"]
    # what is not a secret survives: redaction is targeted
    assert '"region": "eu"' in texts["file"] or '\\"region\\": \\"eu\\"' in texts["file"]
    otr.shutdown(timeout=1)  # the down receiver never takes its batches: do not wait at teardown


def test_redactor_fails_closed_when_the_callback_raises():
    def broken(text):
        raise RuntimeError("bug")

    assert Redactor(callback=broken)("anything at all") == "[REDACTED]"


def test_redaction_covers_spans_of_other_instrumentation(tmp_path, configured):
    memory = configured(5, "first", set_global_provider=False)
    rt_tracer = _runtime.installed().tracer
    with otr.episode(step=0) as ep:
        # e.g. an HTTP client instrumentation recording a header it should not have
        with rt_tracer.start_as_current_span("POST /v1/chat", attributes={"http.request.header.authorization": f"Bearer {SECRETS['bearer']}"}):
            pass
        ep.reward(1.0)
    otr.end_step(0)
    otr.flush(timeout=10)
    foreign = [s for s in memory.get_finished_spans() if s.name == "POST /v1/chat"]
    assert len(foreign) == 1
    assert SECRETS["bearer"] not in str(dict(foreign[0].attributes))


TLS_CHILD = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.DEBUG)  # everything any library logs
    import otel_rollouts as otr
    otr.configure(sampler=otr.TailSampler(5, "first"), trackio_project="tls")  # exporters from the env
    for i in range(3):
        with otr.episode(step=0) as ep:
            ep.prompt("q"); ep.reward(1.0)
    otr.end_step(0)
    flushed = otr.flush(timeout=20)
    print(otr.stats()["delivery"], file=sys.stderr, flush=True)
    print("FLUSHED", flushed, flush=True)
    input()  # the parent makes the receiver refuse now: error paths log too
    with otr.episode(step=1) as ep:
        ep.reward(1.0)
    otr.end_step(1)
    otr.flush(timeout=3)
    print(otr.stats()["delivery"], flush=True)
    otr.shutdown(timeout=3)
    """
)


def test_otlp_over_tls_with_auth_headers_never_logs_them(tmp_path):
    cert, key = _certificate(tmp_path)
    token = "s3cr3t-" + uuid.uuid4().hex
    write_token = "wt-" + uuid.uuid4().hex
    with OtlpSink(tmp_path / "sink", certfile=cert, keyfile=key) as sink:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            TRACKIO_DIR=str(tmp_path / "trackio"),
            TRACKIO_WRITE_TOKEN=write_token,
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=sink.endpoint,
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_CERTIFICATE=cert,
            OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE=cert,
            OTEL_EXPORTER_OTLP_HEADERS=f"Authorization=Bearer%20{token},x-api-key={token}",
        )
        # requests lets REQUESTS_CA_BUNDLE override the exporter's own CA file (requests#3829)
        env.pop("REQUESTS_CA_BUNDLE", None)
        env.pop("CURL_CA_BUNDLE", None)
        script = tmp_path / "child.py"
        script.write_text(TLS_CHILD)
        proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )
        first = ""
        while True:  # Trackio prints a few lines of its own first
            line = proc.stdout.readline()
            first += line
            if not line or line.startswith("FLUSHED"):
                break
        if line.strip() != "FLUSHED True":
            proc.kill()
            pytest.fail(first + proc.communicate()[1])
        sink.control(status=401)
        stdout, stderr = proc.communicate("\n", timeout=60)
        assert proc.returncode == 0, stderr
        state = sink.state()
    assert len(sink.roots()) == 3  # delivered, over TLS
    assert state["authorization"] and all(a == f"Bearer {token}" for a in state["authorization"])
    assert state["refused"] >= 1  # the error path ran (and logged)
    output = first + stdout + stderr
    assert "401" in output or "Failed to export" in output or "FAILURE" in output
    assert token not in output
    assert write_token not in output


@pytest.mark.parametrize("index", range(len(__import__("otel_rollouts._core.redaction")._core.redaction.DEFAULT_PATTERNS)))
def test_every_default_pattern_needs_one_of_the_trigger_literals(index):
    """The fast path skips text without a trigger literal: that must never skip a secret."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hst
    from profiles import examples

    from otel_rollouts._core import redaction

    pattern = redaction.DEFAULT_PATTERNS[index]

    @settings(max_examples=examples(200), deadline=None, suppress_health_check=list(HealthCheck))
    @given(hst.from_regex(pattern))
    def check(text):
        assert redaction.might_hold_secret(text), (pattern, text)

    check()
