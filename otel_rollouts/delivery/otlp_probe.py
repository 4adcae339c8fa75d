"""What a stock OTLP exporter's collector actually answered, which ``export()`` does not say.

The OpenTelemetry OTLP span exporters return ``SUCCESS`` or ``FAILURE`` only: a 200/OK whose
``partial_success`` rejects every span is a ``SUCCESS``, and a request the collector refuses for
good (HTTP 400/413, gRPC ``INVALID_ARGUMENT``) is a ``FAILURE`` like a collector that is down.
Delivery must tell these apart: a rejected span is not stored (the ledger must not count it
delivered), and a refused request must be split or dropped, never retried as it is (the same
request refused twice in a row once stopped all later delivery to that exporter).

``OtlpProbe.attach(exporter)`` wraps the exporter's transport (HTTP) or stub (gRPC) so that the
last response of the calling thread is kept: its status, and the spans it rejected. A 2xx body
that is not an ``ExportTraceServiceResponse`` (junk appended to one, a proxy's HTML page, a cut
message) confirms nothing: what the collector stored is unknown, so the answer says
``unreadable`` and no episode of that request counts as delivered. It touches
two private attributes of the SDK's exporters, in this module only; for an exporter it does not
recognise it returns None and delivery falls back to ``SUCCESS``/``FAILURE``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "OtlpProbe"]

# HTTP status codes that refuse this request for good (the SDK does not retry them either):
# bad request, payload too large. Other 4xx (401/403/404: a configuration problem that may be
# fixed while the run goes on) stay transient: the batch waits in the spool.
_REFUSED_HTTP = frozenset({400, 413})
_REFUSED_GRPC = frozenset({"INVALID_ARGUMENT"})


@dataclass(frozen=True)
class Answer:
    """The collector's answer to the last request: ``refused`` (for good: split or drop),
    ``rejected_spans`` of an accepted request (``partial_success``), and its message;
    ``unreadable``: an accepted request whose body is no OTLP response, so nothing of it is
    confirmed stored."""

    refused: bool = False
    rejected_spans: int = 0
    message: str = ""
    code: str = ""
    unreadable: bool = False


def _partial(body: bytes, content_type: str = "") -> tuple[int, str] | None:
    """(rejected spans, message) of an ``ExportTraceServiceResponse`` body ((0, "") when the body
    is empty: a collector may answer nothing); None when the body is not that message, in
    protobuf or, when ``content_type`` says JSON, in OTLP/JSON: junk, HTML, a cut message."""
    if not body:
        return 0, ""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    try:
        if "json" in content_type.lower():
            from google.protobuf import json_format

            response = json_format.Parse(body, ExportTraceServiceResponse(), ignore_unknown_fields=True)
        else:
            response = ExportTraceServiceResponse.FromString(body)
    except Exception:  # noqa: BLE001 - not the response: what was stored is unknown
        return None
    return _from_response(response)


def _from_response(response: Any) -> tuple[int, str]:
    try:
        if not response.HasField("partial_success"):
            return 0, ""
        partial = response.partial_success
        return int(partial.rejected_spans), str(partial.error_message)
    except Exception:  # noqa: BLE001 - not the message we know: nothing to read
        return 0, ""


class OtlpProbe:
    """Keeps, per thread, the collector's answer to the last request of one OTLP exporter."""

    def __init__(self) -> None:
        self._local = threading.local()

    @classmethod
    def attach(cls, exporter: Any) -> OtlpProbe | None:
        """Wrap ``exporter``'s transport (HTTP) or stub (gRPC); None if it is neither."""
        module = type(exporter).__module__ or ""
        if not module.startswith("opentelemetry.exporter.otlp"):
            return None
        probe = cls()
        try:
            client = getattr(exporter, "_client", None)
            transport = getattr(client, "_transport", None)
            if client is not None and transport is not None and callable(getattr(transport, "request", None)):
                client._transport = _HttpTransport(transport, probe)  # noqa: SLF001
                return probe
            stub = getattr(exporter, "_stub", None)
            if stub is not None and callable(stub):
                exporter._stub = _StubFactory(stub, probe)  # noqa: SLF001 - rebuilt on reconnect
                if client is not None:
                    exporter._client = _Stub(client, probe)  # noqa: SLF001
                return probe
        except Exception:  # noqa: BLE001 - an SDK we do not know: fall back to SUCCESS/FAILURE
            return None
        return None

    def begin(self) -> None:
        """Forget the last answer (called before each export)."""
        self._local.answer = None

    def answer(self) -> Answer | None:
        """The answer to the last request since ``begin`` (None: no request reached a server)."""
        return getattr(self._local, "answer", None)

    def _set(self, answer: Answer) -> None:
        self._local.answer = answer


class _HttpTransport:
    """The HTTP exporter's transport, with each response's status and body seen."""

    def __init__(self, inner: Any, probe: OtlpProbe) -> None:
        self._inner = inner
        self._probe = probe

    def request(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner.request(*args, **kwargs)
        try:
            status = getattr(result, "status_code", None)
            if isinstance(status, int):
                if 200 <= status < 300:
                    self._probe._set(_accepted(result, status))
                else:
                    self._probe._set(Answer(refused=status in _REFUSED_HTTP,
                                            message=str(getattr(result, "reason", "") or ""),
                                            code=str(status)))
        except Exception:  # noqa: BLE001 - reading the answer never fails the request
            pass
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _accepted(result: Any, status: int) -> Answer:
    """The answer of a 2xx ``result``: what its body says was rejected, or ``unreadable``."""
    body = result.content()
    try:
        content_type = str(result.headers().get("content-type") or "")
    except Exception:  # noqa: BLE001 - a transport without headers: read the body as protobuf
        content_type = ""
    partial = _partial(body, content_type)
    if partial is None:
        shown = bytes(body[:40]).decode("ascii", "backslashreplace")
        return Answer(unreadable=True, code=str(status),
                      message=f"a {len(body)}-byte body that is no OTLP response ({shown!r}...)")
    rejected, message = partial
    return Answer(rejected_spans=rejected, message=message, code=str(status))


class _StubFactory:
    def __init__(self, inner: Any, probe: OtlpProbe) -> None:
        self._inner = inner
        self._probe = probe

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub(self._inner(*args, **kwargs), self._probe)


class _Stub:
    """The gRPC exporter's stub, with each ``Export`` response (or error code) seen."""

    def __init__(self, inner: Any, probe: OtlpProbe) -> None:
        self._inner = inner
        self._probe = probe

    def Export(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the stub's own name
        try:
            response = self._inner.Export(*args, **kwargs)
        except Exception as exc:
            code = getattr(exc, "code", None)
            try:
                name = code().name if callable(code) else ""
            except Exception:  # noqa: BLE001
                name = ""
            self._probe._set(Answer(refused=name in _REFUSED_GRPC, code=name))
            raise
        rejected, message = _from_response(response)
        self._probe._set(Answer(rejected_spans=rejected, message=message, code="OK"))
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
