"""Static checks of the shared-Collector recipe (docker/docker-compose.tail.yml, tier 1
docker/otel-collector-lb.yaml, tier 2 docker/otel-collector-tail.yaml), and a check that
otel_rollouts emits the decision that tier 2 keys on.

The Collector binary cannot run on the CI machine (no container engine; no binaries are
downloaded), so each configuration is validated against a schema of the components' config
fields, transcribed from their Go structs (``mapstructure`` tags) below. A misspelled field is
a startup error for the Collector ("has invalid keys"); here it is a test failure.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_rollouts import conventions as c

DOCKER = Path(__file__).resolve().parents[2] / "docker"
BASE_COMPOSE = DOCKER / "docker-compose.yml"
TAIL_COMPOSE = DOCKER / "docker-compose.tail.yml"
TIER1 = DOCKER / "otel-collector-lb.yaml"
TIER2 = DOCKER / "otel-collector-tail.yaml"


def _load(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------------------------------------
# Schemas. A schema is a dict of allowed keys -> value schema; a value schema is a type name
# ("str", "int", "bool", "float", "duration", "strs", "ints"), a nested dict, ("list", schema)
# for a list of mappings, ("enum", {...}) for a string from a set, or "any" (not modelled).
#
# Core components: github.com/open-telemetry/opentelemetry-collector at tag v0.155.0 (the
# pinned image's version): receiver/otlpreceiver/config.go, config/confighttp/server.go,
# config/configgrpc/configgrpc.go, config/confignet/confignet.go, config/configtls/configtls.go,
# exporter/otlpexporter/config.go, exporter/exporterhelper/internal/timeout_sender.go,
# exporter/exporterhelper/internal/queuebatch/config.go, config/configretry/backoff.go,
# processor/batchprocessor/config.go, internal/memorylimiter/config.go.
# ---------------------------------------------------------------------------------------------

Schema = dict[str, Any]

NET_ADDR: Schema = {"endpoint": "str", "transport": "str", "dialer": {"timeout": "duration"}}
TLS: Schema = {
    **{k: "str" for k in ("ca_file", "ca_pem", "cert_file", "cert_pem", "key_file", "key_pem",
                          "min_version", "max_version")},
    "include_system_ca_certs_pool": "bool",
    "cipher_suites": "strs",
    "include_insecure_cipher_suites": "bool",
    "reload_interval": "duration",
    "curve_preferences": "strs",
    "tpm": "any",
}
TLS_CLIENT: Schema = {**TLS, "insecure": "bool", "insecure_skip_verify": "bool",
                      "server_name_override": "str"}
TLS_SERVER: Schema = {**TLS, "client_ca_file": "str", "client_ca_file_reload": "bool"}
GRPC_SERVER: Schema = {
    **NET_ADDR,
    "tls": TLS_SERVER,
    "max_recv_msg_size_mib": "int",
    "max_concurrent_streams": "int",
    "read_buffer_size": "int",
    "write_buffer_size": "int",
    "keepalive": "any",
    "auth": "any",
    "include_metadata": "bool",
    "middlewares": "any",
}
HTTP_SERVER: Schema = {
    **NET_ADDR,
    "tls": TLS_SERVER,
    "cors": {"allowed_origins": "strs", "allowed_headers": "strs", "exposed_headers": "strs",
             "max_age": "int"},
    "auth": "any",
    "max_request_body_size": "int",
    "include_metadata": "bool",
    "response_headers": "any",
    "compression_algorithms": "strs",
    "read_timeout": "duration",
    "read_header_timeout": "duration",
    "write_timeout": "duration",
    "idle_timeout": "duration",
    "middlewares": "any",
    "keep_alives_enabled": "bool",
}
OTLP_RECEIVER: Schema = {
    "protocols": {
        "grpc": GRPC_SERVER,
        "http": {**HTTP_SERVER, "traces_url_path": "str", "metrics_url_path": "str",
                 "logs_url_path": "str"},
    }
}
QUEUE_BATCH: Schema = {
    "enabled": "bool",
    "wait_for_result": "bool",
    "sizer": ("enum", {"requests", "items", "bytes"}),
    "queue_size": "int",
    "block_on_overflow": "bool",
    "storage": "str",
    "num_consumers": "int",
    "batch": {"flush_timeout": "duration", "sizer": ("enum", {"requests", "items", "bytes"}),
              "min_size": "int", "max_size": "int", "partition": {"metadata_keys": "strs"}},
}
RETRY: Schema = {
    "enabled": "bool",
    "initial_interval": "duration",
    "randomization_factor": "float",
    "multiplier": "float",
    "max_interval": "duration",
    "max_elapsed_time": "duration",
}
GRPC_CLIENT: Schema = {
    "endpoint": "str",
    "compression": "str",
    "tls": TLS_CLIENT,
    "keepalive": {"time": "duration", "timeout": "duration", "permit_without_stream": "bool"},
    "read_buffer_size": "int",
    "write_buffer_size": "int",
    "wait_for_ready": "bool",
    "headers": "any",
    "user_agent": "str",
    "balancer_name": "str",
    "authority": "str",
    "auth": "any",
    "middlewares": "any",
}
OTLP_GRPC_EXPORTER: Schema = {
    "timeout": "duration",
    "sending_queue": QUEUE_BATCH,
    "retry_on_failure": RETRY,
    **GRPC_CLIENT,
}
BATCH: Schema = {
    "timeout": "duration",
    "send_batch_size": "int",
    "send_batch_max_size": "int",
    "metadata_keys": "strs",
    "metadata_cardinality_limit": "int",
}
MEMORY_LIMITER: Schema = {
    "check_interval": "duration",
    "min_gc_interval_when_soft_limited": "duration",
    "min_gc_interval_when_hard_limited": "duration",
    "limit_mib": "int",
    "spike_limit_mib": "int",
    "limit_percentage": "int",
    "spike_limit_percentage": "int",
}
# health_check (contrib extension): an HTTP server config plus its path; only endpoint is used.
HEALTH_CHECK: Schema = {**HTTP_SERVER, "path": "str", "response_body": "any",
                        "check_collector_pipeline": "any"}

# ---------------------------------------------------------------------------------------------
# Contrib components. The opentelemetry-collector-contrib snapshot is too large to fetch here
# (1.37 GB), and the code index holds no copy at tag v0.155.0, so these come from the closest
# stored versions: processor/tailsamplingprocessor/config.go (policy structs: sharedPolicyCfg,
# PolicyCfg, AndCfg, ... at commit 497862f69939), its README.md at commit 000e83d0bb08 (adds
# decision_cache, sample_on_first_match, drop_pending_traces_on_shutdown, bytes_limiting,
# trace_flags, drop), and CHANGELOG v0.145.0 (decision_wait_after_root_received, #43876);
# exporter/loadbalancingexporter/config.go (Config, Protocol, ResolverSettings, StaticResolver,
# DNSResolver, K8sSvcResolver, AWSCloudMapResolver; routing keys traceIDRoutingStr, ...) as
# the index stores it (resolvers as configoptional, i.e. a 2025-2026 version). Policy type
# `not` is left out: not confirmed for v0.155.0.
# ---------------------------------------------------------------------------------------------

POLICY_TYPES = {
    "always_sample", "latency", "numeric_attribute", "probabilistic", "status_code",
    "string_attribute", "rate_limiting", "bytes_limiting", "span_count", "trace_state",
    "trace_flags", "boolean_attribute", "ottl_condition", "and", "drop", "composite",
}
# the section each policy type reads its settings from (types with settings)
POLICY_SECTIONS: Schema = {
    "latency": {"threshold_ms": "int", "upper_threshold_ms": "int"},
    "numeric_attribute": {"key": "str", "min_value": "int", "max_value": "int",
                          "invert_match": "bool"},
    "probabilistic": {"hash_salt": "str", "sampling_percentage": "float"},
    "status_code": {"status_codes": "strs"},
    "string_attribute": {"key": "str", "values": "strs", "enabled_regex_matching": "bool",
                         "cache_max_size": "int", "invert_match": "bool"},
    "rate_limiting": {"spans_per_second": "int"},
    "bytes_limiting": {"bytes_per_second": "int", "burst_capacity": "int"},
    "span_count": {"min_spans": "int", "max_spans": "int"},
    "trace_state": {"key": "str", "values": "strs"},
    "boolean_attribute": {"key": "str", "value": "bool", "invert_match": "bool"},
    "ottl_condition": {"error_mode": ("enum", {"ignore", "silent", "propagate"}),
                       "span": "strs", "spanevent": "strs"},
}
SUB_POLICY: Schema = {"name": "str", "type": ("enum", POLICY_TYPES - {"composite", "and", "drop"}),
                      **POLICY_SECTIONS}
POLICY: Schema = {
    "name": "str",
    "type": ("enum", POLICY_TYPES),
    **POLICY_SECTIONS,
    "and": {"and_sub_policy": ("list", SUB_POLICY)},
    "drop": {"drop_sub_policy": ("list", SUB_POLICY)},
    "composite": {"max_total_spans_per_second": "int", "policy_order": "strs",
                  "composite_sub_policy": ("list", {**SUB_POLICY,
                                                    "and": {"and_sub_policy": ("list", SUB_POLICY)}}),
                  "rate_allocation": ("list", {"policy": "str", "percent": "int"})},
}
TAIL_SAMPLING: Schema = {
    "decision_wait": "duration",
    "decision_wait_after_root_received": "duration",
    "num_traces": "int",
    "expected_new_traces_per_sec": "int",
    "decision_cache": {"sampled_cache_size": "int", "non_sampled_cache_size": "int"},
    "sample_on_first_match": "bool",
    "drop_pending_traces_on_shutdown": "bool",
    "policies": ("list", POLICY),
}
ROUTING_KEYS = {"traceID", "service", "metric", "resource", "streamID", "attributes"}
LOADBALANCING: Schema = {
    "timeout": "duration",
    "retry_on_failure": RETRY,
    "sending_queue": {**QUEUE_BATCH, "payload_compression": "str"},
    "protocol": {"otlp": OTLP_GRPC_EXPORTER},
    "resolver": {
        "static": {"hostnames": "strs"},
        "dns": {"hostname": "str", "port": "str", "interval": "duration", "timeout": "duration"},
        "k8s": {"service": "str", "ports": "ints", "timeout": "duration",
                "return_hostnames": "bool"},
        "aws_cloud_map": {"namespace": "str", "service_name": "str", "health_status": "str",
                          "interval": "duration", "timeout": "duration", "port": "int"},
    },
    "routing_key": ("enum", ROUTING_KEYS),
    "routing_attributes": "strs",
}

COMPONENTS: dict[str, dict[str, Schema]] = {
    "receivers": {"otlp": OTLP_RECEIVER},
    "processors": {"memory_limiter": MEMORY_LIMITER, "batch": BATCH,
                   "tail_sampling": TAIL_SAMPLING},
    "exporters": {"otlp_grpc": OTLP_GRPC_EXPORTER, "loadbalancing": LOADBALANCING},
    "extensions": {"health_check": HEALTH_CHECK},
}

# Go's time.ParseDuration: "0", or one or more decimal numbers each with a unit.
DURATION = re.compile(r"^(0|([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h))+$|^0$")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(duration: str) -> float:
    """A Collector duration string in seconds."""
    assert isinstance(duration, str) and DURATION.match(duration), f"bad duration {duration!r}"
    return sum(float(n) * UNIT_S[u] for n, u in re.findall(r"([0-9.]+)(ns|us|µs|ms|s|m|h)", duration))


def _check_value(value: Any, schema: Any, path: str, errors: list[str]) -> None:
    if schema == "any":
        return
    if isinstance(schema, dict):
        if value is None:  # `grpc:` with nothing under it: the defaults
            return
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return
        for key, sub in value.items():
            if key not in schema:
                errors.append(f"{path}: unknown key {key!r}")
            else:
                _check_value(sub, schema[key], f"{path}.{key}", errors)
        return
    if isinstance(schema, tuple) and schema[0] == "list":
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {value!r}")
            return
        for i, item in enumerate(value):
            _check_value(item, schema[1], f"{path}[{i}]", errors)
        return
    if isinstance(schema, tuple) and schema[0] == "enum":
        if value not in schema[1]:
            errors.append(f"{path}: {value!r} is not one of {sorted(schema[1])}")
        return
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "duration": isinstance(value, str) and bool(DURATION.match(value)),
        "strs": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "ints": isinstance(value, list) and all(isinstance(v, int) for v in value),
    }[schema]
    if not ok:
        errors.append(f"{path}: {value!r} is not a valid {schema}")


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def validate(config: dict[str, Any]) -> list[str]:
    """Every problem the Collector would refuse to start with, as far as the schemas know."""
    errors: list[str] = []
    for kind, known in COMPONENTS.items():
        for component_id, settings in (config.get(kind) or {}).items():
            schema = known.get(_type(component_id))
            if schema is None:
                errors.append(f"{kind}: unknown component type {component_id!r}")
            else:
                _check_value(settings, schema, f"{kind}.{component_id}", errors)
    service = config.get("service") or {}
    for key in service:
        if key not in ("extensions", "pipelines", "telemetry"):
            errors.append(f"service: unknown key {key!r}")
    for extension in service.get("extensions", []):
        if extension not in (config.get("extensions") or {}):
            errors.append(f"service.extensions: {extension!r} is not defined")
    for name, pipeline in (service.get("pipelines") or {}).items():
        if _type(name) not in ("traces", "metrics", "logs"):
            errors.append(f"pipeline {name!r}: unknown signal")
        for key, ids in pipeline.items():
            if key not in ("receivers", "processors", "exporters"):
                errors.append(f"pipeline {name}: unknown key {key!r}")
                continue
            for component_id in ids:
                if component_id not in (config.get(key) or {}):
                    errors.append(f"pipeline {name} uses undefined {key[:-1]} {component_id!r}")
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            errors.append(f"pipeline {name}: needs receivers and exporters")
    for policy in _policies(config):
        errors.extend(_policy_errors(policy))
    return errors


def _policies(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        policy
        for component_id, settings in (config.get("processors") or {}).items()
        if _type(component_id) == "tail_sampling"
        for policy in (settings or {}).get("policies") or []
        if isinstance(policy, dict)
    ]


def _policy_errors(policy: dict[str, Any]) -> list[str]:
    """A policy's settings sit under the section named by its type, and under no other."""
    errors = []
    kind = policy.get("type")
    if "name" not in policy:
        errors.append(f"policy {policy!r}: needs a name")
    sections = [k for k in policy if k not in ("name", "type")]
    if kind in POLICY_SECTIONS or kind in ("and", "drop", "composite"):
        if sections != [kind]:
            errors.append(f"policy {policy.get('name')}: type {kind} reads section {kind!r}, has {sections}")
    elif sections:
        errors.append(f"policy {policy.get('name')}: type {kind} takes no settings, has {sections}")
    return errors


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tier1() -> dict[str, Any]:
    return _load(TIER1)


@pytest.fixture(scope="module")
def tier2() -> dict[str, Any]:
    return _load(TIER2)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The two compose files merged the way `docker compose -f base -f tail` merges services."""
    base, tail = _load(BASE_COMPOSE), _load(TAIL_COMPOSE)
    assert base["name"] == tail["name"], "one compose project"
    assert not set(base["services"]) & set(tail["services"]), "tail adds services only"
    return {"base": base["services"], "tail": tail["services"],
            "services": {**base["services"], **tail["services"]}}


def _mounted_config(service: dict[str, Any]) -> Path:
    flags = [a for a in service["command"] if a.startswith("--config=")]
    assert len(flags) == 1
    target = flags[0].split("=", 1)[1]
    for volume in service["volumes"]:
        source, mounted, *mode = volume.split(":")
        if mounted == target:
            assert mode == ["ro"] and source.startswith("./")
            return DOCKER / source
    raise AssertionError(f"{target} is not mounted")


def _ports(service: dict[str, Any]) -> dict[int, int]:
    out = {}
    for entry in service.get("ports", []):
        host, _, container = entry.rpartition(":")
        out[int(container)] = int(host)
    return out


# ---------------------------------------------------------------------------------------------
# The configurations against the schemas


@pytest.mark.parametrize("path", [TIER1, TIER2], ids=["tier1", "tier2"])
def test_configuration_matches_the_collector_schemas(path: Path) -> None:
    config = _load(path)
    assert validate(config) == []
    # every defined component is used (the Collector ignores the rest: dead configuration)
    used = {kind: {i for p in config["service"]["pipelines"].values() for i in p.get(kind, [])}
            for kind in ("receivers", "processors", "exporters")}
    for kind, ids in used.items():
        assert set(config.get(kind) or {}) == ids, f"{path.name}: defined but unused {kind}"


MUTATIONS: dict[str, tuple[Path, Callable[[dict[str, Any]], None], str]] = {
    "misspelled tail_sampling field": (
        TIER2, lambda cfg: cfg["processors"]["tail_sampling"].update(
            decision_wiat=cfg["processors"]["tail_sampling"].pop("decision_wait")),
        "unknown key 'decision_wiat'"),
    "misspelled decision cache field": (
        TIER2, lambda cfg: cfg["processors"]["tail_sampling"]["decision_cache"].update(
            sampled_cache=1), "unknown key 'sampled_cache'"),
    "misspelled policy setting": (
        TIER2, lambda cfg: cfg["processors"]["tail_sampling"]["policies"][0][
            "boolean_attribute"].update(vaule=True), "unknown key 'vaule'"),
    "unknown policy type": (
        TIER2, lambda cfg: cfg["processors"]["tail_sampling"]["policies"][0].update(
            type="boolean_attributes"), "'boolean_attributes' is not one of"),
    "section under another type's name": (
        TIER2, lambda cfg: cfg["processors"]["tail_sampling"]["policies"][0].update(
            type="string_attribute"), "reads section 'string_attribute'"),
    "bad duration": (
        TIER2, lambda cfg: cfg["processors"]["tail_sampling"].update(decision_wait="600sec"),
        "not a valid duration"),
    "duration as a bare number": (
        TIER2, lambda cfg: cfg["processors"]["memory_limiter"].update(check_interval=1),
        "not a valid duration"),
    "undefined exporter in a pipeline": (
        TIER2, lambda cfg: cfg["service"]["pipelines"]["traces"]["exporters"].append("otlp_grpc/x"),
        "undefined exporter 'otlp_grpc/x'"),
    "misspelled routing key": (
        TIER1, lambda cfg: cfg["exporters"]["loadbalancing"].update(routing_key="traceId"),
        "'traceId' is not one of"),
    "misspelled resolver field": (
        TIER1, lambda cfg: cfg["exporters"]["loadbalancing"]["resolver"]["static"].update(
            hostname=["x"]), "unknown key 'hostname'"),
    "misspelled OTLP exporter field": (
        TIER1, lambda cfg: cfg["exporters"]["loadbalancing"]["protocol"]["otlp"]["tls"].update(
            insecure_skip=True), "unknown key 'insecure_skip'"),
    "unknown component type": (
        TIER1, lambda cfg: cfg["exporters"].update(load_balancing={}),
        "unknown component type 'load_balancing'"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_validator_rejects_a_mutated_copy(name: str) -> None:
    path, mutate, expected = MUTATIONS[name]
    config = copy.deepcopy(_load(path))
    assert validate(config) == []
    mutate(config)
    errors = validate(config)
    assert any(expected in e for e in errors), errors


def test_durations_parse(tier1: dict[str, Any], tier2: dict[str, Any]) -> None:
    assert seconds("600s") == 600 and seconds("1m30s") == 90 and seconds("250ms") == 0.25
    with pytest.raises(AssertionError):
        seconds("10 s")
    found = []

    def walk(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif key in ("timeout", "check_interval", "decision_wait",
                     "decision_wait_after_root_received", "interval"):
            found.append(seconds(node))

    walk(tier1)
    walk(tier2)
    assert len(found) >= 6 and all(s > 0 for s in found)


# ---------------------------------------------------------------------------------------------
# What the recipe decides


def test_tier2_keeps_what_otel_rollouts_kept_and_nothing_of_a_dropped_episode(
    tier2: dict[str, Any],
) -> None:
    policies = {p["name"]: p for p in tier2["processors"]["tail_sampling"]["policies"]}
    kept = [p for p in policies.values() if p["type"] == "boolean_attribute"]
    assert len(kept) == 1
    assert kept[0]["boolean_attribute"] == {"key": c.RL_TRACE_KEPT, "value": True}
    # Nothing that would keep a fragment of a dropped episode: no always_sample, probabilistic,
    # rate limiting or inverted matches. The only other policy keeps traces whose root span (a
    # dropped episode never exports its root) names no episode.
    others = [p for p in policies.values() if p is not kept[0]]
    assert [p["type"] for p in others] == ["ottl_condition"]
    (condition,) = others[0]["ottl_condition"]["span"]
    assert 'parent_span_id.string == ""' in condition
    assert f'attributes["{c.RL_EPISODE_ID}"] == nil' in condition
    assert " or " not in condition
    assert "sample_on_first_match" not in tier2["processors"]["tail_sampling"]


def test_processor_order(tier1: dict[str, Any], tier2: dict[str, Any]) -> None:
    assert tier1["service"]["pipelines"].keys() == {"traces"}
    assert tier2["service"]["pipelines"].keys() == {"traces"}
    assert tier1["service"]["pipelines"]["traces"]["processors"] == ["memory_limiter", "batch"]
    # tail_sampling regroups spans by trace: memory_limiter before it, batch after it
    assert tier2["service"]["pipelines"]["traces"]["processors"] == [
        "memory_limiter", "tail_sampling", "batch"]
    for config in (tier1, tier2):
        limiter = config["processors"]["memory_limiter"]
        assert limiter["limit_mib"] > limiter["spike_limit_mib"] > 0


def test_tier1_routes_by_trace_id_to_the_tier2_services(
    tier1: dict[str, Any], tier2: dict[str, Any], compose: dict[str, Any]
) -> None:
    services = compose["services"]
    exporter = tier1["exporters"]["loadbalancing"]
    assert exporter["routing_key"] == "traceID"
    assert list(exporter["resolver"]) == ["static"], "exactly one resolver"
    tier2_services = sorted(n for n, s in compose["tail"].items() if _mounted_config(s) == TIER2)
    tier1_services = sorted(n for n, s in compose["tail"].items() if _mounted_config(s) == TIER1)
    assert len(tier2_services) >= 2 and len(tier1_services) >= 1
    _, grpc_port = tier2["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)
    hostnames = exporter["resolver"]["static"]["hostnames"]
    assert sorted(h.rsplit(":", 1)[0] for h in hostnames) == tier2_services
    assert {h.rsplit(":", 1)[1] for h in hostnames} == {grpc_port}
    assert exporter["protocol"]["otlp"]["tls"]["insecure"] is True
    # tier 1 depends on tier 2; tier 2 sends to Jaeger, a service of the base file
    for name in tier1_services:
        assert set(services[name]["depends_on"]) == set(tier2_services)
    jaeger = tier2["exporters"]["otlp_grpc/jaeger"]
    host, port = jaeger["endpoint"].rsplit(":", 1)
    assert host in compose["base"] and int(port) in _ports(services[host])
    for name in tier2_services:
        assert set(services[name]["depends_on"]) == {host}
        assert "ports" not in services[name], "tier 2 is reached through tier 1 only"


def test_tail_compose_services(compose: dict[str, Any]) -> None:
    collector_image = compose["base"]["otel-collector"]["image"]
    for name, service in compose["tail"].items():
        assert service["image"] == collector_image, f"{name}: same pinned collector image"
        assert service["profiles"] == ["tail"]
        assert _mounted_config(service).is_file()
        for dep in service.get("depends_on", []):
            assert dep in compose["services"]
    host_ports = [p for s in compose["services"].values() for p in _ports(s).values()]
    assert len(host_ports) == len(set(host_ports)), f"host port clash: {sorted(host_ports)}"
    (tier1,) = [s for s in compose["tail"].values() if _mounted_config(s) == TIER1]
    assert {4317, 4318} <= set(_ports(tier1))


# ---------------------------------------------------------------------------------------------
# The README's arithmetic for a 4,096-episode step, against the configuration

EPISODES_PER_STEP = 4096
STEP_S = 9 * 60
REQUESTS_PER_EPISODE = 4  # generation calls (turns) per episode
IN_MEMORY_FACTOR = 4  # pdata structs over wire bytes (~2x) x Go GC headroom (~2x)
CACHE_ENTRY_BYTES = 100  # a trace id in an LRU list + map
RUNTIME_MIB = 100  # the Collector's own heap with nothing held


def measure_server_request() -> tuple[int, int]:
    """(spans, OTLP bytes) of one chat request to a FastAPI server instrumented by
    opentelemetry-instrumentation-fastapi, with an ``llm_request`` child carrying vLLM's
    ``gen_ai.*`` request attributes and ``gen_ai.latency.*`` timings, encoded together by the
    SDK's OTLP encoder (resource once, as in one export)."""
    import asyncio

    import httpx
    from fastapi import FastAPI
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm-server"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.tracing")
    app = FastAPI()
    timings = {name: 0.1234 for name in c.SERVER_TIMINGS}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        with tracer.start_as_current_span("llm_request") as span:
            span.set_attributes({
                "gen_ai.request.id": "chatcmpl-" + "0123456789abcdef" * 2,
                "gen_ai.response.model": "Qwen/Qwen2.5-7B-Instruct",
                "gen_ai.request.temperature": 1.0, "gen_ai.request.top_p": 1.0,
                "gen_ai.request.max_tokens": 2048, "gen_ai.request.n": 1,
                "gen_ai.usage.prompt_tokens": 812, "gen_ai.usage.completion_tokens": 640,
                "gen_ai.usage.num_sequences": 1,
                "gen_ai.latency.time_in_scheduler": 0.004,
                "gen_ai.latency.time_in_model_forward": 2.9,
                "gen_ai.latency.time_in_model_execute": 3.0,
                **timings,
            })
        return {"choices": []}

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    headers = {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "baggage": "rl.run.id=run-7f3a9c,rl.step=40,rl.episode.id=ep-40-1234,rl.group.id=g-40-77",
    }

    async def call() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm:8000") as client:
            response = await client.post("/v1/chat/completions", json={"model": "m"},
                                         headers=headers)
            assert response.status_code == 200

    asyncio.run(call())
    provider.shutdown()
    spans = exporter.get_finished_spans()
    assert {"llm_request", "POST /v1/chat/completions"} <= {s.name for s in spans}
    return len(spans), len(encode_spans(spans).SerializeToString())


def test_decision_wait_and_memory_arithmetic(tier2: dict[str, Any]) -> None:
    tail = tier2["processors"]["tail_sampling"]
    wait = seconds(tail["decision_wait"])
    # a server span may arrive a whole step before its episode root is exported
    assert wait >= STEP_S + 60
    assert seconds(tail["decision_wait_after_root_received"]) < 60
    steps_in_window = math.ceil(wait / STEP_S)
    assert tail["num_traces"] >= EPISODES_PER_STEP * steps_in_window * 2
    assert tail["expected_new_traces_per_sec"] >= EPISODES_PER_STEP / STEP_S
    cache = tail["decision_cache"]
    # decisions outlive the trace data: late spans follow them instead of starting over
    assert cache["sampled_cache_size"] >= tail["num_traces"]
    assert cache["non_sampled_cache_size"] >= 10 * tail["num_traces"]

    spans, wire = measure_server_request()
    held = tail["num_traces"] * REQUESTS_PER_EPISODE * wire * IN_MEMORY_FACTOR
    caches = (cache["sampled_cache_size"] + cache["non_sampled_cache_size"]) * CACHE_ENTRY_BYTES
    needed_mib = (held + caches) / 2**20 + RUNTIME_MIB
    limiter = tier2["processors"]["memory_limiter"]
    soft_mib = limiter["limit_mib"] - limiter["spike_limit_mib"]
    print(f"server request: {spans} spans, {wire} B; held {held / 2**20:.0f} MiB, caches "
          f"{caches / 2**20:.0f} MiB, needed {needed_mib:.0f} MiB, soft limit {soft_mib} MiB")
    assert 1000 < wire < 10_000, "a realistic request is a few KB on the wire"
    # the soft limit holds the working set with room to spare (x1.5), and is not wildly above it
    assert 1.5 * needed_mib <= soft_mib <= 4 * needed_mib


# ---------------------------------------------------------------------------------------------
# otel_rollouts emits the decision tier 2 keys on


def test_otel_rollouts_marks_kept_episode_roots(configured) -> None:

    import otel_rollouts as otr

    exporter = configured(2, "top_bottom")
    trace_ids = {}
    for i, reward in enumerate([0.1, 0.9, 0.5, 0.4]):
        with otr.episode(step=0, episode_id=f"e{i}") as ep:
            with ep.turn():
                pass
            ep.reward(reward)
        assert ep.trace_id is not None
        trace_ids[reward] = int(ep.trace_id, 16)
    otr.end_step(0)
    assert otr.flush(timeout=30)

    spans = exporter.get_finished_spans()
    exported = {s.context.trace_id for s in spans}
    assert exported == {trace_ids[0.9], trace_ids[0.1]}  # top and bottom
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 2
    for root in roots:
        assert (root.attributes or {}).get(c.RL_TRACE_KEPT) is True
    # only the root carries it (the decision is per trace); other spans stay as they were
    assert all(c.RL_TRACE_KEPT not in (s.attributes or {}) for s in spans if s.parent)
    assert not exported & {trace_ids[0.5], trace_ids[0.4]}
