"""Static checks of docker/ (compose, collector, Prometheus) and of docker/read_jaeger_trace.py.

Neither Docker nor Jaeger can run on the CI machine (no container engine, and no Jaeger package
on PyPI/apt/npm), so the configs are validated structurally with PyYAML, and the trace reader is
tested against OTLP JSON documents built here, in the shape Jaeger v2's API v3 returns
(``{"result": {"resourceSpans": ...}}``), served by a stdlib HTTP server on loopback.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
COLLECTOR = DOCKER / "otel-collector.yaml"
PROMETHEUS = DOCKER / "prometheus.yml"
READER = DOCKER / "read_jaeger_trace.py"

PINNED_TAG = re.compile(r"^v?\d+\.\d+\.\d+$")


def _load(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load(COMPOSE)


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return _load(COLLECTOR)


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return _load(PROMETHEUS)


def _ports(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port, from short-syntax "HOST:CONTAINER" entries."""
    mapping: dict[int, int] = {}
    for entry in service.get("ports", []):
        assert isinstance(entry, str), f"use the quoted short syntax for ports: {entry!r}"
        host, _, container = entry.rpartition(":")
        mapping[int(container.split("/")[0])] = int(host)
    return mapping


def _image(service: dict[str, Any]) -> tuple[str, str]:
    repository, _, tag = service["image"].rpartition(":")
    return repository, tag


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


# ---------------------------------------------------------------------------------------------
# Files


def test_every_yaml_file_in_docker_parses() -> None:
    files = sorted([*DOCKER.glob("**/*.yml"), *DOCKER.glob("**/*.yaml")])
    assert {f.name for f in files} >= {
        "docker-compose.yml",
        "otel-collector.yaml",
        "prometheus.yml",
    }
    for path in files:
        assert isinstance(_load(path), dict), f"{path.name} is not a YAML mapping"


# ---------------------------------------------------------------------------------------------
# docker-compose.yml


def test_compose_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"jaeger", "otel-collector", "prometheus"}
    # Jaeger starts with a plain `up`; the collector stack only with --profile collector.
    assert "profiles" not in services["jaeger"]
    assert services["otel-collector"]["profiles"] == ["collector"]
    assert services["prometheus"]["profiles"] == ["collector"]
    # depends_on never points from a default service into a profile-only one.
    for name, service in services.items():
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"
            if "profiles" not in service:
                assert "profiles" not in services[dep]


def test_compose_images_are_pinned(compose: dict[str, Any]) -> None:
    expected = {
        "jaeger": "jaegertracing/jaeger",
        "otel-collector": "otel/opentelemetry-collector-contrib",
        "prometheus": "prom/prometheus",
    }
    for name, service in compose["services"].items():
        repository, tag = _image(service)
        assert repository == expected[name]
        assert tag != "latest" and PINNED_TAG.match(tag), f"{name}: pin an exact tag, not {tag!r}"
    _, jaeger_tag = _image(compose["services"]["jaeger"])
    assert jaeger_tag.split(".")[0] == "2", "Jaeger v2 (OTLP-native, /api/v3 query API)"


def test_compose_ports(compose: dict[str, Any]) -> None:
    services = compose["services"]
    jaeger = _ports(services["jaeger"])
    assert jaeger == {16686: 16686, 4317: 4317, 4318: 4318}
    collector = _ports(services["otel-collector"])
    assert {4317, 4318, 8889} <= set(collector)
    assert _ports(services["prometheus"]) == {9090: 9090}
    host_ports = [p for s in services.values() for p in _ports(s).values()]
    assert len(host_ports) == len(set(host_ports)), f"host port clash: {sorted(host_ports)}"


def test_compose_mounts_existing_configs(compose: dict[str, Any]) -> None:
    mounts: dict[str, dict[str, str]] = {}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target, *mode = volume.split(":")
            assert source.startswith("./"), f"{name}: mount files relative to docker/: {volume}"
            assert (DOCKER / source).is_file(), f"{name}: {source} does not exist"
            assert mode == ["ro"], f"{name}: mount configs read-only: {volume}"
            mounts.setdefault(name, {})[target] = source
    collector = compose["services"]["otel-collector"]
    config_flags = [a for a in collector["command"] if a.startswith("--config=")]
    assert len(config_flags) == 1
    assert mounts["otel-collector"][config_flags[0].split("=", 1)[1]] == "./otel-collector.yaml"
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"


# ---------------------------------------------------------------------------------------------
# otel-collector.yaml

KNOWN_TYPES = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch"},
    "exporters": {"otlp_grpc", "otlp_http", "debug", "file", "prometheus"},
    "extensions": {"health_check"},
}


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def test_collector_components_have_known_types(collector: dict[str, Any]) -> None:
    for kind, known in KNOWN_TYPES.items():
        for component_id in collector.get(kind) or {}:
            assert _type(component_id) in known, f"unknown {kind[:-1]} type {component_id!r}"
    # `otlp` as an exporter is the deprecated alias of `otlp_grpc` (collector >= 0.144).
    assert not any(_type(e) in ("otlp", "otlphttp") for e in collector["exporters"])


def test_collector_pipelines_reference_defined_components(collector: dict[str, Any]) -> None:
    pipelines = collector["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics", "logs"}
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in pipelines.items():
        assert _type(name) in ("traces", "metrics", "logs"), name
        assert pipeline["receivers"] and pipeline["exporters"], name
        for kind in used:
            for component_id in pipeline.get(kind, []):
                assert component_id in (collector.get(kind) or {}), (
                    f"pipeline {name} uses undefined {kind[:-1]} {component_id!r}"
                )
                used[kind].add(component_id)
    for kind, ids in used.items():
        assert set(collector.get(kind) or {}) == ids, f"defined but unused {kind}"
    for extension in collector["service"].get("extensions", []):
        assert extension in collector["extensions"]


def test_collector_processor_order(collector: dict[str, Any]) -> None:
    for name, pipeline in collector["service"]["pipelines"].items():
        processors = pipeline["processors"]
        assert processors[0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert processors[-1] == "batch", f"{name}: batch after the other processors"
    limiter = collector["processors"]["memory_limiter"]
    assert re.fullmatch(r"\d+(ms|s)", limiter["check_interval"])
    assert limiter["limit_mib"] > limiter.get("spike_limit_mib", 0) > 0


def test_collector_wiring(collector: dict[str, Any], compose: dict[str, Any]) -> None:
    services = compose["services"]
    # Receivers listen on all interfaces (the default is localhost, unreachable from the host),
    # on the container ports that compose publishes.
    protocols = collector["receivers"]["otlp"]["protocols"]
    published = _ports(services["otel-collector"])
    for protocol, port in (("grpc", 4317), ("http", 4318)):
        host, bound = _host_port(protocols[protocol]["endpoint"])
        assert (host, bound) == ("0.0.0.0", port)
        assert port in published
    # Traces go to Jaeger's OTLP gRPC port, over plaintext inside the compose network.
    pipelines = collector["service"]["pipelines"]
    to_jaeger = [e for e in pipelines["traces"]["exporters"] if _type(e) == "otlp_grpc"]
    assert len(to_jaeger) == 1
    exporter = collector["exporters"][to_jaeger[0]]
    host, port = _host_port(exporter["endpoint"])
    assert host == "jaeger" and port in _ports(services["jaeger"])
    assert exporter["tls"]["insecure"] is True
    # ...and to a second backend.
    assert len(pipelines["traces"]["exporters"]) >= 2
    # Metrics go to the prometheus exporter, on a published port.
    assert "prometheus" in pipelines["metrics"]["exporters"]
    host, port = _host_port(collector["exporters"]["prometheus"]["endpoint"])
    assert host == "0.0.0.0" and port in published


# ---------------------------------------------------------------------------------------------
# prometheus.yml


def test_prometheus_scrapes_the_collector_exporter(
    prometheus: dict[str, Any], collector: dict[str, Any], compose: dict[str, Any]
) -> None:
    _, exporter_port = _host_port(collector["exporters"]["prometheus"]["endpoint"])
    targets = [
        target
        for job in prometheus["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    ]
    assert f"otel-collector:{exporter_port}" in targets
    for target in targets:
        host, _ = _host_port(target)
        assert host in compose["services"], f"scrape target {target} is not a compose service"
    jobs = [job["job_name"] for job in prometheus["scrape_configs"]]
    assert len(jobs) == len(set(jobs))


# ---------------------------------------------------------------------------------------------
# read_jaeger_trace.py


def _reader():
    spec = importlib.util.spec_from_file_location("read_jaeger_trace", READER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ROOT, TURN, CHAT, TOOL, REWARD, SERVER = (
    "00f067aa0ba902b7",
    "1111111111111111",
    "2222222222222222",
    "3333333333333333",
    "4444444444444444",
    "5555555555555555",
)
T0 = 1_763_700_000_000_000_000  # ns


def _kv(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}  # int64 as string, per proto3 JSON
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    if isinstance(value, list):
        return {
            "key": key,
            "value": {"arrayValue": {"values": [_kv("", v)["value"] for v in value]}},
        }
    return {"key": key, "value": {"stringValue": value}}


def _span(span_id, parent, name, start_ms, end_ms, status=None, **attributes):
    span = {
        "traceId": TRACE_ID,
        "spanId": span_id,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(T0 + start_ms * 1_000_000),
        "endTimeUnixNano": str(T0 + end_ms * 1_000_000),
        "attributes": [_kv(k.replace("__", "."), v) for k, v in attributes.items()],
        "status": status or {},
    }
    if parent:
        span["parentSpanId"] = parent
    return span


def jaeger_document() -> dict[str, Any]:
    """What Jaeger v2 answers for GET /api/v3/traces/{id}: an episode from the trainer and a
    span from an inference server (another service) that joined the trace via traceparent."""
    trainer = [
        _span(
            ROOT,
            None,
            "episode",
            0,
            1500,
            rl__step=3,
            rl__reward__score=0.75,
            rl__split="train",
            rl__status="ok",
            gen_ai__operation__name="invoke_agent",
        ),
        _span(TURN, ROOT, "turn", 10, 1200, rl__turn__index=0),
        _span(
            CHAT,
            TURN,
            "chat tiny-policy",
            20,
            800,
            gen_ai__operation__name="chat",
            gen_ai__request__model="tiny-policy",
            gen_ai__usage__output_tokens=42,
            gen_ai__output__messages="x" * 500,
        ),
        _span(
            TOOL,
            TURN,
            "execute_tool calculator",
            810,
            1190,
            {"code": 2, "message": "boom"},
            gen_ai__tool__name="calculator",
            gen_ai__tool__call__arguments='{"a": 1}',
        ),
        # The reward span may end after the episode root.
        _span(
            REWARD,
            ROOT,
            "reward",
            1400,
            1600,
            rl__reward__score=0.75,
            rl__reward__format=1.0,
            rl__truncated=False,
            rl__tags=["a", "b"],
        ),
    ]
    server = [_span(SERVER, CHAT, "POST /v1/chat/completions", 25, 790, http__status_code=200)]
    return {
        "result": {
            "resourceSpans": [
                {
                    "resource": {"attributes": [_kv("service.name", "trainer")]},
                    "scopeSpans": [{"scope": {"name": "otel_rollouts"}, "spans": trainer}],
                },
                {
                    "resource": {"attributes": [_kv("service.name", "vllm")]},
                    "scopeSpans": [{"scope": {"name": "vllm"}, "spans": server}],
                },
            ]
        }
    }


EXPECTED_TREE_NAMES = [
    "episode",
    "turn",
    "chat tiny-policy",
    "POST /v1/chat/completions",
    "execute_tool calculator",
    "reward",
]


def _names_with_depth(text: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines()[1:]:
        stripped = line.lstrip(" |`-")
        depth = (len(line) - len(stripped)) // 3
        out.append((depth, stripped.split("  [")[0]))
    return out


def test_reader_parses_otlp_json() -> None:
    reader = _reader()
    spans = {s.name: s for s in reader.parse_otlp_json(jaeger_document())}
    assert len(spans) == 6
    root = spans["episode"]
    assert (root.trace_id, root.span_id, root.parent_span_id) == (TRACE_ID, ROOT, None)
    assert root.attributes["rl.step"] == 3 and isinstance(root.attributes["rl.step"], int)
    assert root.attributes["rl.reward.score"] == 0.75
    assert root.duration_ms == pytest.approx(1500.0)
    assert root.service == "trainer"
    assert spans["POST /v1/chat/completions"].service == "vllm"
    assert spans["POST /v1/chat/completions"].parent_span_id == CHAT
    assert spans["execute_tool calculator"].status == "ERROR"
    assert spans["execute_tool calculator"].status_message == "boom"
    assert spans["reward"].attributes["rl.truncated"] is False
    assert spans["reward"].attributes["rl.tags"] == ["a", "b"]


def test_reader_accepts_bare_and_base64_documents() -> None:
    """A bare TracesData document with protobuf-JSON (base64) ids parses to the same hex ids."""
    import base64

    reader = _reader()
    document = jaeger_document()["result"]
    for resource_spans in document["resourceSpans"]:
        for span in resource_spans["scopeSpans"][0]["spans"]:
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in span:
                    span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    spans = {s.name: s for s in reader.parse_otlp_json(document)}
    assert spans["turn"].trace_id == TRACE_ID
    assert (spans["turn"].span_id, spans["turn"].parent_span_id) == (TURN, ROOT)
    assert reader.normalize_id("AAAAAAAAAAA=", 8) is None  # all-zero id: no parent


def test_reader_formats_an_indented_tree() -> None:
    reader = _reader()
    text = reader.format_tree(reader.parse_otlp_json(jaeger_document()))
    lines = text.splitlines()
    assert lines[0] == f"trace {TRACE_ID}: 6 spans, services: trainer, vllm"
    assert _names_with_depth(text) == [
        (0, "episode"),
        (1, "turn"),
        (2, "chat tiny-policy"),
        (3, "POST /v1/chat/completions"),
        (2, "execute_tool calculator"),
        (1, "reward"),
    ]
    episode = lines[1]
    assert f"[{ROOT}]" in episode and "1500.0 ms" in episode
    assert "rl.step=3" in episode and "rl.reward.score=0.75" in episode and "rl.split=train" in episode
    chat = next(line for line in lines if "chat tiny-policy" in line)
    assert "gen_ai.request.model=tiny-policy" in chat and "gen_ai.usage.output_tokens=42" in chat
    assert "gen_ai.output.messages" not in chat  # content stays out of the tree
    server = next(line for line in lines if "POST /v1/chat" in line)
    assert "service=vllm" in server and "service=" not in chat
    tool = next(line for line in lines if "execute_tool" in line)
    assert "ERROR: boom" in tool
    everything = reader.format_tree(reader.parse_otlp_json(jaeger_document()), all_attributes=True)
    assert "gen_ai.output.messages=xxx" in everything


def test_reader_keeps_orphans_as_roots() -> None:
    reader = _reader()
    document = jaeger_document()
    del document["result"]["resourceSpans"][0]  # the trainer's spans never arrived
    text = reader.format_tree(reader.parse_otlp_json(document))
    assert f"(parent {CHAT} not in trace)" in text.splitlines()[1]


class _FakeJaeger(BaseHTTPRequestHandler):
    """Serves documents at Jaeger's v3 path; 404 with Jaeger's error body otherwise."""

    documents: dict[str, dict[str, Any]] = {}
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        self.requests.append(self.path)
        prefix = "/api/v3/traces/"
        trace_id = self.path[len(prefix) :] if self.path.startswith(prefix) else None
        if trace_id in self.documents:
            status, body = 200, self.documents[trace_id]
        else:
            status, body = 404, {"error": {"httpCode": 404, "message": "trace not found"}}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_jaeger() -> Iterator[str]:
    _FakeJaeger.documents = {TRACE_ID: jaeger_document()}
    _FakeJaeger.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeJaeger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _run_reader(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(READER), *args], capture_output=True, text=True, timeout=60
    )


def test_reader_end_to_end_over_http(fake_jaeger: str) -> None:
    result = _run_reader(TRACE_ID.upper(), "--url", fake_jaeger + "/")
    assert result.returncode == 0, result.stderr
    assert _FakeJaeger.requests == [f"/api/v3/traces/{TRACE_ID}"]
    assert [name for _, name in _names_with_depth(result.stdout)] == EXPECTED_TREE_NAMES
    assert "rl.reward.score=0.75" in result.stdout


def test_reader_reports_missing_trace_and_unreachable_jaeger(fake_jaeger: str) -> None:
    missing = "0" * 31 + "1"
    result = _run_reader(missing, "--url", fake_jaeger)
    assert result.returncode == 1
    assert f"trace {missing} not found" in result.stderr

    result = _run_reader("not-a-trace-id", "--url", fake_jaeger)
    assert result.returncode == 2 and "not a hex trace id" in result.stderr  # argparse error

    # Nothing listens on the port once the server is gone: pick one and close it.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = _run_reader(TRACE_ID, "--url", dead, "--timeout", "5")
    assert result.returncode == 2 and "cannot reach Jaeger" in result.stderr
