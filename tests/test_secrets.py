"""No secret leaves the process, wherever a user puts it, and content off means off.

Secrets are planted in every place a user (or a hostile value) can put text: span names
(``@traced(name=...)``, tool and model names), attribute keys (metadata keys, ``set_attribute``),
attribute values, event names, keys and values, exception messages, status descriptions, the
``repr`` of a refused value (which the library's own warning quotes), a foreign span of other
instrumentation, the resource, Trackio's run config, log bodies and logger names. Every real
output is read back: in-memory spans, the console tree, the OTLP/JSON file, a real OTLP/HTTP
receiver process (spans and logs), Phoenix (content on), Trackio's SQLite file (every table), the
spool, and the text the library logged.

Content on: no secret of the default patterns appears anywhere, a name or key keeps a stable
placeholder, content without a secret shape stays (the control). Content off: that content is
gone too, exceptions keep their type only, refused values are named by type.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sqlite3
import stat
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as hst
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_sink import OtlpSink
from profiles import examples

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts._core import redaction
from otel_rollouts._core import runtime as _runtime
from otel_rollouts.exporters import ConsoleExporter, OtlpJsonFileExporter, TrackioExporter

# one secret of each default shape, each planted in its own place(s)
AWS = "AKIAIOSFODNN7EXAMPLE"
OPENAI = "sk-proj-Zk3v9QmT2xLp8RfW4nYb6HcJ"
HF = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"
GITHUB = "ghp_R2d2C3poLukeLeiaHanSoloChewie99"
GOOGLE = "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW"
SLACK = "xoxb-1234567890-abcdefghij"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N"
PASSWORD = "hunter2-Correct-Horse"
URL_PASSWORD = "Tr0ub4dor-and-3"
SECRETS = {"aws": AWS, "openai": OPENAI, "hf": HF, "github": GITHUB, "google": GOOGLE, "slack": SLACK,
           "jwt": JWT, "password": PASSWORD, "url password": URL_PASSWORD}
# content in no secret's shape: redaction keeps it, content-off must not
MARKER = "PURPLE-ELEPHANT-7731"
PLACEHOLDER = re.compile(r"\[REDACTED:[0-9a-f]{8}\]")


class Hostile:
    """A refused reward whose repr carries a secret and content."""

    def __repr__(self) -> str:
        return f"<Hostile {OPENAI} {MARKER}>"

    def __float__(self) -> float:
        raise ValueError("not a number")


def _record() -> None:
    @otr.traced(name=f"lookup {GOOGLE}", kind="tool")
    def lookup(query: str) -> str:
        span = trace.get_current_span()
        span.set_attribute(f"note {AWS}", f"value {MARKER} {HF}")
        span.add_event(f"cache miss {AWS}", {f"why {AWS}": f"{MARKER} api_key={PASSWORD}", "n": 3})
        raise RuntimeError(f"backend said {GITHUB} {MARKER}")

    rt_tracer = _runtime.installed().tracer
    app = logging.getLogger(f"app.{AWS}")
    with otr.episode(step=0, group_id="g", sample_index=0,
                     metadata={f"owner {AWS}": "team-a", "note": f"ticket {SLACK}"}) as ep:
        ep.prompt([{"role": "user", "content": f"q {MARKER} {HF}"}])
        with ep.turn() as turn:
            turn.record_generation(f"use Bearer {JWT} {MARKER}", model=f"policy-{AWS}")
            with turn.tool_call(AWS, arguments={"password": PASSWORD, "q": MARKER}, call_id="c1") as call:
                call.result(f"{MARKER} postgres://admin:{URL_PASSWORD}@db:5432")
            try:
                lookup("x")
            except RuntimeError:
                pass
            # other instrumentation (an HTTP client) inside the episode
            with rt_tracer.start_as_current_span(f"GET /{GITHUB}",
                                                 attributes={f"http.header.{AWS}": f"Bearer {JWT}"}) as span:
                span.record_exception(ValueError(f"{MARKER} {HF}"))
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"failed {MARKER} {OPENAI}"))
            app.warning("calling the API with api_key=%s and %s", PASSWORD, MARKER)
        ep.set_attribute(f"extra {AWS}", f"{MARKER} {OPENAI}")
        ep.reward(Hostile())
    otr.end_step(0)


def _db_text(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        rows = [row for t in tables for row in db.execute(f'SELECT * FROM "{t}"').fetchall()]  # noqa: S608
    finally:
        db.close()
    return "\n".join((v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)) for row in rows for v in row)


def _spans_text(spans) -> str:
    return json.dumps([
        {"name": s.name, "attrs": dict(s.attributes or {}), "status": s.status.description,
         "events": [[e.name, dict(e.attributes or {})] for e in s.events],
         "links": [dict(link.attributes or {}) for link in s.links],
         "resource": dict(s.resource.attributes)}
        for s in spans
    ], default=str, ensure_ascii=False)


@pytest.fixture
def logged():
    """Everything the library (and the libraries under it) logged, as a console handler with
    tracebacks prints it; the application's own lines (logger ``app.*``) are its own business
    and are checked where they leave through ``instrument_logging``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    handler.addFilter(lambda record: not record.name.startswith("app."))
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


def _run(tmp_path: Path, capture: bool, logged: io.StringIO, phoenix=None) -> tuple[dict[str, str], list]:
    project = f"secrets-{'on' if capture else 'off'}-{uuid.uuid4().hex[:6]}"
    memory = InMemorySpanExporter()
    console = ConsoleExporter(stream=io.StringIO())
    trackio_exporter = TrackioExporter(project, run="r", config={"api_key": PASSWORD, f"aws {AWS}": 1, "lr": 1e-6})
    file = tmp_path / "spans.jsonl"
    spool = tmp_path / "spool"
    down = OtlpSink(tmp_path / "down")  # never started: its batches wait in the spool
    exporters = [memory, console, trackio_exporter, OtlpJsonFileExporter(file),
                 OTLPSpanExporter(endpoint=down.endpoint, timeout=0.5)]
    with OtlpSink(tmp_path / "sink") as sink:
        exporters.append(OTLPSpanExporter(endpoint=sink.endpoint, timeout=5))
        if phoenix is not None:
            exporters.append(OTLPSpanExporter(endpoint=phoenix.http_endpoint, timeout=10))
        otr.configure(
            exporters=exporters, sampler=otr.TailSampler(5, "first"), capture_content=capture, spool_dir=spool,
            resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project, "deploy.url": f"https://ci:{URL_PASSWORD}@host/"},
        )
        integration = otr.instrument_logging(exporter=OTLPLogExporter(endpoint=sink.logs_endpoint, timeout=5))
        try:
            _record()
            otr.flush(timeout=10)
            assert integration.flush()
        finally:
            otr.uninstrument_logging()
        texts = {
            "memory": _spans_text(memory.get_finished_spans()),
            "console": console._stream.getvalue(),
            "file": file.read_text(),
            "otlp receiver": sink.out.read_text(),
            "otlp logs": json.dumps(sink.logs()),
            "trackio": _db_text(Path(os.environ["TRACKIO_DIR"]) / f"{project}.db"),
            "spool": b"".join(p.read_bytes() for p in spool.rglob("*.otlp")).decode("utf-8", "replace"),
        }
        if phoenix is not None:
            received = phoenix.wait_for_spans(project, len(memory.get_finished_spans()))
            texts["phoenix"] = json.dumps(received, default=str)
    otr.shutdown(timeout=1)  # the down receiver never takes its batches: do not wait for it
    texts["logged"] = logged.getvalue()
    for name, text in texts.items():
        assert text, f"{name}: nothing came out"
    _assert_modes(file, spool, Path(os.environ["TRACKIO_DIR"]) / f"{project}.db")
    return texts, memory.get_finished_spans()


def _assert_modes(file: Path, spool: Path, trackio_db: Path) -> None:
    """The modes the README's threat model states: ours private, Trackio's from the umask."""
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    spooled = [spool, *spool.rglob("*")]
    assert len(spooled) > 2
    for path in spooled:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    umask = int(re.search(r"Umask:\s*([0-7]+)", Path("/proc/self/status").read_text()).group(1), 8)
    assert stat.S_IMODE(trackio_db.stat().st_mode) == 0o666 & ~umask  # Trackio's choice, not ours


def _assert_no_secret(texts: dict[str, str]) -> None:
    for name, text in texts.items():
        for what, secret in SECRETS.items():
            assert secret not in text, f"the {what} secret leaked into {name}"
        # content is redacted in several passes (each text, then the JSON around it): once shows
        assert "[REDACTED]]" not in text, f"{name}: a placeholder was redacted again"


def test_with_content_on_every_output_is_redacted_and_names_keep_a_stable_placeholder(
        tmp_path, otr_shutdown, logged, phoenix):
    texts, spans = _run(tmp_path, True, logged, phoenix)
    _assert_no_secret(texts)
    # the control: content in no secret's shape is exported (so the content-off test can fail)
    for name in ("memory", "file", "otlp receiver", "trackio", "phoenix"):
        assert MARKER in texts[name], name
    by_kind = {s.attributes.get(c.RL_SPAN_KIND): s for s in spans if s.attributes.get(c.RL_SPAN_KIND)}
    tool = next(s for s in spans if s.attributes.get(c.GEN_AI_TOOL_CALL_ID) == "c1")
    # the tree still reads: the tool's name is one placeholder, the same in its span name and attribute
    placeholder = tool.attributes[c.GEN_AI_TOOL_NAME]
    assert PLACEHOLDER.fullmatch(placeholder)
    assert tool.name == c.tool_span_name(placeholder)
    # the same secret gives the same placeholder everywhere in the run (here: the model's name)
    assert by_kind[c.KIND_GENERATION].name == c.chat_span_name(f"policy-{placeholder}")
    root = by_kind[c.KIND_EPISODE]
    assert root.attributes[f"{c.RL_METADATA_PREFIX}owner {placeholder}"] == "team-a"
    assert root.attributes[f"extra {placeholder}"] == f"{MARKER} [REDACTED]"
    # what is not a secret survives redaction (targeted, not wholesale)
    assert "postgres://admin:[REDACTED]@db:5432" in texts["memory"]
    assert "lr" in texts["trackio"]


def test_with_content_off_content_is_absent_and_exceptions_keep_their_type(tmp_path, otr_shutdown, logged):
    texts, spans = _run(tmp_path, False, logged)
    _assert_no_secret(texts)
    for name, text in texts.items():
        if name == "logged":
            continue  # the application's own log line quotes it: logs are not span content
        assert MARKER not in text, f"content leaked into {name} with content capture off"
    failed = next(s for s in spans if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_TOOL and s.events)
    assert failed.attributes[c.ERROR_TYPE] == "RuntimeError"
    assert failed.status.description == "RuntimeError"
    exception = next(e for e in failed.events if e.name == c.EVENT_EXCEPTION)
    assert dict(exception.attributes) == {c.EXCEPTION_TYPE: "RuntimeError"}
    # a value given to set_attribute is content: left out, its (redacted) key named
    assert any(PLACEHOLDER.fullmatch(k.removeprefix("note ")) for k in failed.attributes.get(c.RL_OMITTED_FIELDS, ()))
    # a refused value is named by its type
    reward = next(s for s in spans if s.attributes.get(c.RL_SPAN_KIND) == c.KIND_REWARD)
    assert list(reward.attributes[c.RL_INVALID_FIELDS]) == ["reward: not a number: Hostile"]
    assert "reward: not a number: Hostile" in texts["logged"]
    foreign = next(s for s in spans if s.name.startswith("GET "))
    assert [dict(e.attributes) for e in foreign.events] == [{c.EXCEPTION_TYPE: "ValueError"}]
    assert foreign.status.description == "ValueError"


def test_the_library_log_filter_redacts_messages_and_tracebacks(otr_shutdown):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    own = logging.getLogger(c.SCOPE_NAME)
    own.addHandler(handler)
    try:
        otr.configure(exporters=[InMemorySpanExporter()])
        try:
            raise RuntimeError(f"failed with {OPENAI}")
        except RuntimeError as exc:
            own.warning("contained: %s", exc, exc_info=exc)
    finally:
        own.removeHandler(handler)
    text = stream.getvalue()
    assert "contained: failed with [REDACTED]" in text and "Traceback" in text
    assert OPENAI not in text


# --- every default pattern, at every position -----------------------------------------------------
_PRINTABLE = hst.characters(codec="utf-8", exclude_categories=("Cc", "Cs"))


def _strings(spans, logs):
    """Every text of the spans and log records as it left, with where it was."""
    def attributes(where, attrs):
        for key, value in (attrs or {}).items():
            yield f"{where} key", key
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, str):
                    yield f"{where} {key}", item

    for span in spans:
        yield "span name", span.name
        yield "status", span.status.description or ""
        yield from attributes("attribute", span.attributes)
        for event in span.events:
            yield "event name", event.name
            yield from attributes("event attribute", event.attributes)
    for log in logs:
        yield "log body", str(log.log_record.body)
        yield "log scope", log.instrumentation_scope.name
        yield from attributes("log attribute", log.log_record.attributes)


def _secret_of(pattern: str, text: str) -> str:
    match = re.fullmatch(pattern, text)
    assert match is not None
    group = match.group("secret") if "secret" in match.re.groupindex else None
    return group if group is not None else match.group(0)


@pytest.mark.parametrize("index", range(len(redaction.DEFAULT_PATTERNS)))
def test_a_secret_of_every_default_pattern_is_found_at_every_position(index, configured, tmp_path):
    pattern = redaction.DEFAULT_PATTERNS[index]
    logs = InMemoryLogRecordExporter()
    memory = configured(1000, "first")
    integration = otr.instrument_logging(logging.getLogger("secrets.app"), exporter=logs)
    app = logging.getLogger("secrets.app")
    app.propagate = False
    rt_tracer = _runtime.installed().tracer
    try:
        @settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
        @given(hst.from_regex(pattern, fullmatch=True, alphabet=_PRINTABLE))
        def check(text: str) -> None:
            secret = _secret_of(pattern, text)
            assume(len(secret) >= 8 and text.count(secret) == 1)  # the secret, not a look-alike beside it
            memory.clear()
            logs.clear()

            @otr.traced(name=f"fn {text} .")
            def fn() -> None:
                span = trace.get_current_span()
                span.set_attribute(f"key {text} .", f"value {text} .")
                span.add_event(f"event {text} .", {f"k {text} .": f"v {text} ."})
                raise ValueError(f"message {text} .")

            with otr.episode(metadata={f"m {text} .": f"v {text} ."}) as ep:
                with ep.turn() as turn:
                    turn.record_generation(f"out {text} .", model=f"model {text} .")
                    with turn.tool_call(f"tool {text} .", arguments={"a": f"{text} ."}) as call:
                        call.result(f"result {text} .")
                    try:
                        fn()
                    except ValueError:
                        pass
                    with rt_tracer.start_as_current_span(f"foreign {text} .", attributes={f"f {text} .": f"{text} ."}):
                        pass
                    app.getChild(text).warning("log %s .", text)
                ep.reward(1.0)
            otr.end_step()
            assert otr.flush(timeout=10)
            assert integration.flush()
            spans = memory.get_finished_spans()
            assert len(spans) >= 6
            assert len([r for r in logs.get_finished_logs() if r.log_record.event_name is None]) == 1
            for where, value in _strings(spans, logs.get_finished_logs()):
                assert secret not in value, (where, text, secret)

        check()
    finally:
        otr.uninstrument_logging()
        app.propagate = True


@pytest.mark.parametrize("index", range(len(redaction.DEFAULT_PATTERNS)))
def test_redacting_twice_reads_as_redacting_once(index):
    """Content is redacted as each text and again as the JSON around it: the second pass must
    not eat into the first's placeholder (``password=[REDACTED]]``)."""
    pattern = redaction.DEFAULT_PATTERNS[index]
    redactor = redaction.Redactor()

    @settings(max_examples=examples(200), deadline=None, suppress_health_check=list(HealthCheck))
    @given(hst.from_regex(pattern, fullmatch=True, alphabet=_PRINTABLE), hst.sampled_from(["", " x", '"}']))
    def check(text: str, after: str) -> None:
        once = redactor(text + after)
        assert redactor(once) == once
        wrapped = json.dumps({"v": once}, ensure_ascii=False)  # as content is rendered
        assert redactor(wrapped) == wrapped
        named = redactor.name(text + after)
        assert redactor.name(named) == named

    check()
