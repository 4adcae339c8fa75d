#!/usr/bin/env python3
"""Print one trace from Jaeger v2 as an indented span tree.

    python docker/read_jaeger_trace.py TRACE_ID [--url http://localhost:16686] [--all-attributes]

Reads Jaeger's query API v3, ``GET {url}/api/v3/traces/{trace_id}``, which answers OTLP JSON
wrapped as ``{"result": {"resourceSpans": [...]}}`` (a bare ``{"resourceSpans": [...]}`` is
accepted too). Each line shows the span name, span id, duration, and the ``rl.*`` attributes plus
a few GenAI keys; ``--all-attributes`` shows every attribute. Standard library only.

Exit codes: 0 printed, 1 trace not found, 2 Jaeger unreachable or answered something else.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

DEFAULT_URL = "http://localhost:16686"
# Shown next to the rl.* attributes; message/argument content is left out (too long for a tree).
KEY_ATTRIBUTES = (
    "gen_ai.operation.name",
    "gen_ai.request.model",
    "gen_ai.tool.name",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
)
STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}
_HEX = re.compile(r"^[0-9a-fA-F]+$")


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    service: str | None = None
    status: str = "UNSET"
    status_message: str = ""
    children: list[Span] = field(default_factory=list, repr=False)

    @property
    def duration_ms(self) -> float:
        return max(self.end_ns - self.start_ns, 0) / 1e6


class TraceNotFound(Exception):
    pass


def normalize_id(value: Any, nbytes: int) -> str | None:
    """OTLP JSON ids as lowercase hex; accepts hex (OTLP/JSON spec) or base64 (protobuf JSON)."""
    if not value:
        return None
    text = str(value)
    if len(text) == 2 * nbytes and _HEX.match(text):
        hex_id = text.lower()
    else:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            return text.lower()
        hex_id = raw.hex() if len(raw) == nbytes else text.lower()
    return None if set(hex_id) == {"0"} else hex_id


def any_value(value: dict[str, Any] | None) -> Any:
    """Decode an OTLP JSON AnyValue into a Python value."""
    if not value:
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:  # int64 is a JSON string in the proto3 mapping
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])  # also "NaN", "Infinity"
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes_dict(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes_dict(key_values: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: any_value(kv.get("value")) for kv in key_values or []}


def _status(status: dict[str, Any] | None) -> tuple[str, str]:
    status = status or {}
    code = status.get("code", 0)
    if isinstance(code, str):  # enum by name: STATUS_CODE_ERROR
        name = code.removeprefix("STATUS_CODE_")
    else:
        name = STATUS_NAMES.get(int(code), str(code))
    return name, status.get("message", "")


def parse_otlp_json(document: dict[str, Any]) -> list[Span]:
    """Flatten an OTLP JSON traces document (optionally wrapped in ``result``) into spans."""
    data = document.get("result", document)
    spans: list[Span] = []
    for resource_spans in data.get("resourceSpans", []) or []:
        resource = attributes_dict((resource_spans.get("resource") or {}).get("attributes"))
        service = resource.get("service.name")
        for scope_spans in resource_spans.get("scopeSpans", []) or []:
            for raw in scope_spans.get("spans", []) or []:
                status, message = _status(raw.get("status"))
                spans.append(
                    Span(
                        trace_id=normalize_id(raw.get("traceId"), 16) or "",
                        span_id=normalize_id(raw.get("spanId"), 8) or "",
                        parent_span_id=normalize_id(raw.get("parentSpanId"), 8),
                        name=raw.get("name", ""),
                        start_ns=int(raw.get("startTimeUnixNano", 0) or 0),
                        end_ns=int(raw.get("endTimeUnixNano", 0) or 0),
                        attributes=attributes_dict(raw.get("attributes")),
                        service=service,
                        status=status,
                        status_message=message,
                    )
                )
    return spans


def build_tree(spans: list[Span]) -> list[Span]:
    """Link children to parents; return roots (spans whose parent is absent), by start time."""
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        span.children = []
    roots: list[Span] = []
    for span in spans:
        parent = by_id.get(span.parent_span_id) if span.parent_span_id else None
        if parent is None or parent is span:
            roots.append(span)
        else:
            parent.children.append(span)
    for span in spans:
        span.children.sort(key=lambda s: (s.start_ns, s.name))
    roots.sort(key=lambda s: (s.start_ns, s.name))
    return roots


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value if len(value) <= 60 else value[:57] + "..."
    return json.dumps(value, separators=(",", ":"), default=str)


def span_label(span: Span, all_attributes: bool = False) -> str:
    keys = (
        sorted(span.attributes)
        if all_attributes
        else [k for k in sorted(span.attributes) if k.startswith("rl.")]
        + [k for k in KEY_ATTRIBUTES if k in span.attributes]
    )
    parts = [f"{span.name}  [{span.span_id}]  {span.duration_ms:.1f} ms"]
    if span.status == "ERROR":
        parts.append(f"ERROR{': ' + span.status_message if span.status_message else ''}")
    parts.extend(f"{k}={_format_value(span.attributes[k])}" for k in keys)
    return "  ".join(parts)


def format_tree(spans: list[Span], all_attributes: bool = False) -> str:
    """The whole trace as text: a header line, then one indented line per span."""
    if not spans:
        return "(no spans)"
    roots = build_tree(spans)
    trace_ids = sorted({s.trace_id for s in spans})
    services = sorted({s.service for s in spans if s.service})
    lines = [
        f"trace {', '.join(trace_ids)}: {len(spans)} spans"
        + (f", services: {', '.join(services)}" if services else "")
    ]
    seen: set[int] = set()

    def walk(span: Span, prefix: str, connector: str, child_prefix: str, service: str) -> None:
        if id(span) in seen:  # cycle guard for malformed input
            return
        seen.add(id(span))
        extra = ""
        if span.service and span.service != service:  # e.g. an inference server's span
            extra += f"  service={span.service}"
        if connector == "" and span.parent_span_id:
            extra += f"  (parent {span.parent_span_id} not in trace)"
        lines.append(prefix + connector + span_label(span, all_attributes) + extra)
        for i, child in enumerate(span.children):
            last = i == len(span.children) - 1
            walk(
                child,
                prefix + child_prefix,
                "`- " if last else "|- ",
                "   " if last else "|  ",
                span.service or service,
            )

    main_service = roots[0].service or ""
    for root in roots:
        walk(root, "", "", "", main_service)
    return "\n".join(lines)


def fetch_trace(trace_id: str, url: str = DEFAULT_URL, timeout: float = 10.0) -> dict[str, Any]:
    """GET the trace from Jaeger's API v3; raises TraceNotFound on 404."""
    endpoint = f"{url.rstrip('/')}/api/v3/traces/{urllib.parse.quote(trace_id, safe='')}"
    request = urllib.request.Request(endpoint, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise TraceNotFound(trace_id) from exc
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_id", help="trace id, 32 hex characters")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"Jaeger query URL ({DEFAULT_URL})")
    parser.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    parser.add_argument("--all-attributes", action="store_true", help="show every attribute")
    args = parser.parse_args(argv)

    trace_id = args.trace_id.strip().lower()
    if not (_HEX.match(trace_id) and len(trace_id) <= 32):
        parser.error(f"not a hex trace id: {args.trace_id!r}")
    trace_id = trace_id.zfill(32)
    try:
        document = fetch_trace(trace_id, args.url, args.timeout)
    except TraceNotFound:
        print(f"trace {trace_id} not found at {args.url}", file=sys.stderr)
        return 1
    except urllib.error.HTTPError as exc:
        print(f"Jaeger answered HTTP {exc.code} for trace {trace_id}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError) as exc:
        print(f"cannot reach Jaeger at {args.url}: {exc}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"Jaeger did not answer JSON: {exc}", file=sys.stderr)
        return 2
    spans = parse_otlp_json(document)
    if not spans:
        print(f"trace {trace_id} not found at {args.url} (no spans)", file=sys.stderr)
        return 1
    print(format_tree(spans, args.all_attributes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
