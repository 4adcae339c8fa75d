"""Phoenix annotations: each episode's evaluations, posted where Phoenix can sort and filter by them.

Every episode root span carries its evaluations as OpenInference's flattened attributes
(``evaluations.<i>.evaluation.*``: reward, each reward component, advantage, status; see
``_core.messages.episode_evaluations``). Arize Phoenix's OTLP ingest does not turn these into
annotations (checked in Phoenix 20.26.1: ``trace/otel.py`` and ``db/insertion/span.py`` store
them as plain attributes); only annotations can be a column of its span list, be sorted by
(``evals['reward'].score``) and filtered with ``evals['status'].label == 'truncated'``. Phoenix
takes annotations through its REST API only: ``POST <base>/v1/span_annotations``.

``PhoenixAnnotations.attach(exporter)`` is that one job, as a delivery layer: after an export of
the stock OTLP/HTTP exporter returned ``SUCCESS``, the evaluations of every episode root span of
the batch are posted to ``<base>/v1/span_annotations`` (``<base>``: the traces endpoint without
``/v1/traces``). It wraps the exporter's ``export`` on the instance, the way ``OtlpProbe``
wraps its transport, so that the exporter stays itself for every other layer (its name in
``otr.stats()``, the request-size limit, the collector's answer). Without ``?sync=true`` Phoenix
queues the annotations and postpones one whose span is not inserted yet (every 10 s, 60 times),
so posting right after the spans is safe.

The rules:

* Phoenix or not: asked once per exporter, on the sender thread, at its first successful export:
  ``GET <base>/arize_phoenix_version`` answering 200 with a version number. Not a Phoenix: nothing
  more is ever sent. ``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS`` (``auto``, the default; ``on``: post
  without asking; ``off``; or Phoenix's base URL, e.g. ``http://127.0.0.1:6006``) decides. A gRPC
  exporter's endpoint is not Phoenix's HTTP port: there, annotations are posted only to a URL
  given in that variable.
* Annotations are a view: what happens to them never changes the export's result, so never the
  delivery ledger (an episode is delivered when its spans are stored), and never raises.
* Bounded: one batch at a time, on the sender thread, nothing queued. Each request has a short
  timeout; after a failure, posting pauses (5 s, doubling up to 5 min) and the annotations of
  batches exported meanwhile are counted lost, so that a slow Phoenix does not slow delivery.
* Counted in ``otr.stats()`` totals, per exporter: ``annotations.posted.<exporter>``
  (annotations Phoenix took), ``annotations.failures.<exporter>`` (requests that failed),
  ``annotations.lost.<exporter>`` (annotations not posted); a failure's kind is logged once.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import exception_text, reraise_interrupt
from otel_rollouts._core.guard import first_time
from otel_rollouts._core.messages import read_evaluations
from otel_rollouts._core.settings import PHOENIX_AUTO as AUTO
from otel_rollouts._core.settings import PHOENIX_OFF as OFF
from otel_rollouts._core.settings import PHOENIX_ON as ON
from otel_rollouts._core.settings import phoenix_annotations
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.layers import warn

__all__ = [
    "AUTO",
    "OFF",
    "ON",
    "PhoenixAnnotations",
    "annotations_of",
    "base_url",
    "mode_from_env",
    "parse_mode",
]


TRACES_PATH = "/v1/traces"  # the OTLP/HTTP traces path, under Phoenix's base URL
VERSION_PATH = "/arize_phoenix_version"  # Phoenix answers its version as plain text
ANNOTATIONS_PATH = "/v1/span_annotations"
DETECT_TIMEOUT_S = 2.0
POST_TIMEOUT_S = 3.0
MAX_ANNOTATIONS_PER_REQUEST = 500
FIRST_PAUSE_S = 5.0
MAX_PAUSE_S = 300.0
MAX_DETECT_TRIES = 3  # unanswered version requests before giving up on an exporter
_VERSION = re.compile(rb"\s*\d+\.\d+")
_KINDS = frozenset({"HUMAN", "LLM", c.OI_ANNOTATOR_CODE})
_NOT_FORWARDED = frozenset({"content-type", "content-encoding", "content-length", "user-agent"})
_CERTIFICATE_ENV = ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE")


# --- the option ------------------------------------------------------------------------------
def parse_mode(text: str) -> str:
    """``auto`` | ``on`` | ``off`` (booleans too) | an http(s) base URL; ValueError otherwise
    (the parser of ``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS`` in the settings' table)."""
    return phoenix_annotations(text)


def mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS`` (validated by ``settings.check_environment``, which
    warns about and removes a bad value), ``auto`` when unset or invalid."""
    value = (os.environ if environ is None else environ).get(c.ENV_PHOENIX_ANNOTATIONS)
    if not value or not value.strip():
        return AUTO
    try:
        return parse_mode(value)
    except ValueError:
        return AUTO


def base_url(traces_endpoint: str) -> str | None:
    """Phoenix's base URL for an OTLP/HTTP traces endpoint (``…/v1/traces`` less that path),
    None for an endpoint that does not end so."""
    endpoint = traces_endpoint.strip().rstrip("/")
    if not endpoint.startswith(("http://", "https://")) or not endpoint.endswith(TRACES_PATH):
        return None
    return endpoint[: -len(TRACES_PATH)]


# --- what is posted ----------------------------------------------------------------------------
def annotations_of(spans: Sequence[ReadableSpan]) -> list[dict[str, object]]:
    """Phoenix's span annotations (``POST /v1/span_annotations`` items) for the evaluations of
    every episode root span in ``spans``: the same name, score, label, explanation, annotator
    kind, identifier and metadata as its ``evaluations.<i>.evaluation.*`` attributes."""
    out: list[dict[str, object]] = []
    for span in spans:
        attributes = span.attributes or {}
        if span.context is None or attributes.get(c.RL_SPAN_KIND) != c.KIND_EPISODE:
            continue
        span_id = f"{span.context.span_id:016x}"
        for evaluation in read_evaluations(attributes):
            result = {field: evaluation[field] for field in
                      (c.OI_EVALUATION_SCORE, c.OI_EVALUATION_LABEL, c.OI_EVALUATION_EXPLANATION)
                      if evaluation.get(field) is not None}
            kind = evaluation.get(c.OI_EVALUATION_ANNOTATOR_KIND)
            annotation: dict[str, object] = {
                "span_id": span_id,
                "name": evaluation[c.OI_EVALUATION_NAME],
                "annotator_kind": kind if kind in _KINDS else c.OI_ANNOTATOR_CODE,
                "result": result,
            }
            identifier = evaluation.get(c.OI_EVALUATION_IDENTIFIER)
            if isinstance(identifier, str):
                annotation["identifier"] = identifier
            metadata = _metadata(evaluation.get(c.OI_EVALUATION_METADATA))
            if metadata:
                annotation["metadata"] = metadata
            out.append(annotation)
    return out


def _metadata(value: object) -> dict[str, object] | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


# --- the layer ---------------------------------------------------------------------------------
class _Export:
    """The exporter's own ``export``, then the layer's job on ``SUCCESS``.

    ``inner``: an ``export`` set on the instance before this one, else None: the class's
    ``export`` is then looked up at each call, so that a class patched later (an
    instrumentation, a test's spy) is still the one that exports."""

    def __init__(self, exporter: SpanExporter, inner: Callable[[Sequence[ReadableSpan]], SpanExportResult] | None,
                 layer: PhoenixAnnotations) -> None:
        self.exporter = exporter
        self.inner = inner
        self.layer = layer

    def __call__(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        inner = self.inner
        result = inner(spans) if inner is not None else type(self.exporter).export(self.exporter, spans)
        if result is SpanExportResult.SUCCESS:
            self.layer.exported(spans)
        return result


class PhoenixAnnotations:
    """Posts the evaluations of each exported batch's episode roots to Phoenix (see the module).

    ``base``: Phoenix's base URL; ``detect``: ask ``/arize_phoenix_version`` first (``auto``);
    ``headers``: sent with each request (the exporter's own, for an authenticated Phoenix).
    ``exporter``: the exporter it is attached to, whose name and run its counts go under.
    """

    def __init__(self, base: str, *, detect: bool = True, headers: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None, detect_timeout: float = DETECT_TIMEOUT_S,
                 post_timeout: float = POST_TIMEOUT_S) -> None:
        self.base = base.rstrip("/")
        self.headers = dict(headers or {})
        self.exporter = exporter
        self.detect_timeout = detect_timeout
        self.post_timeout = post_timeout
        self.phoenix: bool | None = None if detect else True  # None: not asked yet
        self.version: str | None = None
        self.stats = Stats()  # used when the exporter is not one of a run's (replay, own use)
        self._lock = threading.Lock()  # one batch at a time
        self._tries = 0
        self._pause = FIRST_PAUSE_S
        self._resume_at = 0.0
        self._counts: Any = None  # the run's DeliveryCounts of this exporter, once found
        self._context = _ssl_context()
        self.last_post_s: float | None = None  # how long the last request took

    # --- attaching ---------------------------------------------------------------------------
    @classmethod
    def attach(cls, exporter: SpanExporter, mode: str | None = None) -> PhoenixAnnotations | None:
        """Make ``exporter`` (the stock OTLP exporter) post annotations after each successful
        export, per ``mode`` (default: ``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS``, else ``auto``).
        None when nothing is to be posted (``off``; an endpoint that is no Phoenix base; gRPC
        without a URL; an exporter this does not know). Never raises."""
        try:
            mode = mode_from_env() if mode is None else parse_mode(mode)
            if mode == OFF:
                return None
            current = getattr(exporter, "export", None)
            if isinstance(current, _Export):
                return current.layer  # attached already
            endpoint, headers, http = _exporter_target(exporter)
            if mode in (AUTO, ON):
                base = base_url(endpoint) if http and endpoint else None
                if base is None:
                    if mode == ON and first_time("phoenix.annotations.no_url"):
                        _warn("%s=on, but %s is not an OTLP/HTTP .../v1/traces endpoint: give Phoenix's "
                              "base URL instead (e.g. http://127.0.0.1:6006); no annotations are posted",
                              c.ENV_PHOENIX_ANNOTATIONS, type(exporter).__name__)
                    return None
                layer = cls(base, detect=mode == AUTO, headers=headers, exporter=exporter)
            else:  # a URL: Phoenix's, given (the exporter's credentials only for its own host)
                same_host = endpoint is not None and _host(endpoint) == _host(mode)
                layer = cls(mode, detect=False, headers=headers if same_host else None, exporter=exporter)
            if current is None or not callable(current):
                return None
            own = vars(exporter).get("export") if hasattr(exporter, "__dict__") else None
            exporter.export = _Export(exporter, own, layer)  # type: ignore[method-assign]
            return layer
        except Exception:  # noqa: BLE001 - an exporter we do not know: no annotations
            return None

    # --- on the sender thread ----------------------------------------------------------------
    def exported(self, spans: Sequence[ReadableSpan]) -> None:
        """``spans`` were stored: post their episodes' evaluations. Never raises."""
        try:
            with self._lock:
                self._exported(spans)
        except BaseException as exc:  # noqa: BLE001 - a view never breaks delivery
            reraise_interrupt(exc)
            self._count("errors", 1)
            self._report("error", f"annotations: {exception_text(exc)}")

    def _exported(self, spans: Sequence[ReadableSpan]) -> None:
        if self.phoenix is False:
            return
        annotations = annotations_of(spans)
        if not annotations:
            return
        if time.monotonic() < self._resume_at:
            self._count("lost", len(annotations))
            return
        if self.phoenix is None and not self._detect():
            if self.phoenix is None:  # no answer yet: these are lost, the next batch asks again
                self._count("lost", len(annotations))
            return
        for start in range(0, len(annotations), MAX_ANNOTATIONS_PER_REQUEST):
            part = annotations[start:start + MAX_ANNOTATIONS_PER_REQUEST]
            problem = self._post(part)
            if problem is not None:
                self._count("failures", 1)
                self._count("lost", len(annotations) - start)
                self._resume_at = time.monotonic() + self._pause
                self._pause = min(self._pause * 2, MAX_PAUSE_S)
                self._report(problem[0], f"posting annotations to {self.base}{ANNOTATIONS_PATH} failed "
                                         f"({problem[1]}); paused, then retried with later batches")
                return
            self._count("posted", len(part))
        self._pause = FIRST_PAUSE_S

    def _detect(self) -> bool:
        """Ask once whether ``base`` is a Phoenix; True if it is."""
        self._tries += 1
        try:
            request = urllib.request.Request(self.base + VERSION_PATH, headers=self.headers, method="GET")
            with self._open(request, self.detect_timeout) as response:
                body = response.read(64)
                status = response.status
        except urllib.error.HTTPError as exc:
            status, body = exc.code, b""
            exc.close()
        except Exception as exc:  # noqa: BLE001 - no answer (down, slow): asked again later
            if self._tries >= MAX_DETECT_TRIES:
                self.phoenix = False
                self._report("detect", f"no answer from {self.base}{VERSION_PATH} ({exception_text(exc)}) "
                                       f"after {self._tries} tries: no annotations are posted")
            return False
        self.phoenix = status == 200 and _VERSION.match(body) is not None
        if self.phoenix:
            self.version = body.decode("ascii", "replace").strip()
        return self.phoenix

    def _post(self, annotations: list[dict[str, object]]) -> tuple[str, str] | None:
        """One request; None when Phoenix took it, else (kind, what happened)."""
        data = json.dumps({"data": annotations}, ensure_ascii=False, allow_nan=False).encode()
        headers = {**self.headers, "Content-Type": "application/json"}
        request = urllib.request.Request(self.base + ANNOTATIONS_PATH, data=data, headers=headers, method="POST")
        started = time.monotonic()
        try:
            with self._open(request, self.post_timeout) as response:
                response.read(4096)
                status = response.status
        except urllib.error.HTTPError as exc:
            reason = f"HTTP {exc.code} {exc.reason}"
            exc.close()
            return f"http.{exc.code}", reason
        except Exception as exc:  # noqa: BLE001 - down, slow, reset: counted
            return type(exc).__name__, exception_text(exc)
        finally:
            self.last_post_s = time.monotonic() - started
        return None if 200 <= status < 300 else (f"http.{status}", f"HTTP {status}")

    def _open(self, request: urllib.request.Request, timeout: float) -> Any:
        if self._context is not None and request.full_url.startswith("https://"):
            return urllib.request.urlopen(request, timeout=timeout, context=self._context)
        return urllib.request.urlopen(request, timeout=timeout)  # http(s) only (parse_mode)

    # --- counting and reporting --------------------------------------------------------------
    def _where(self) -> tuple[Stats, str]:
        """The run's counters and this exporter's name there (what ``otr.stats()`` shows), else
        the layer's own counters (an exporter used outside a run: replay)."""
        counts = self._counts
        if counts is None and self.exporter is not None:
            counts = self._counts = _run_counts(self.exporter)
        if counts is not None:
            return counts.stats, counts.name
        return self.stats, type(self.exporter).__name__ if self.exporter is not None else "phoenix"

    def _count(self, what: str, n: int) -> None:
        stats, name = self._where()
        stats.add(f"annotations.{what}.{name}", n)

    def _report(self, kind: str, message: str) -> None:
        _, name = self._where()
        if first_time(f"exporter.{name}.annotations.{kind}"):
            _warn("exporter %s: %s (logged once; counted in otr.stats())", name, message)


def _exporter_target(exporter: object) -> tuple[str | None, dict[str, str], bool]:
    """(traces endpoint, headers to forward, whether it is the OTLP/HTTP exporter) of a stock OTLP
    exporter: the one place that reads its private ``_endpoint`` and headers (the SDK has no
    public accessor for them)."""
    module = type(exporter).__module__ or ""
    if not module.startswith("opentelemetry.exporter.otlp"):
        return None, {}, False
    endpoint = getattr(exporter, "_endpoint", None)
    endpoint = endpoint if isinstance(endpoint, str) else None
    client = getattr(exporter, "_client", None)
    raw = getattr(client, "_headers", None)
    http = ".http" in module
    if raw is None:
        raw = getattr(exporter, "_headers", None)
    pairs = raw.items() if isinstance(raw, Mapping) else raw if isinstance(raw, (list, tuple)) else ()
    headers: dict[str, str] = {}
    for pair in pairs:
        try:
            key, value = pair
        except (TypeError, ValueError):
            continue
        if isinstance(key, str) and isinstance(value, str) and key.lower() not in _NOT_FORWARDED:
            headers[key] = value
    return endpoint, headers, http


def _host(url: str) -> str | None:
    try:
        return urllib.parse.urlsplit(url if "://" in url else "//" + url).hostname
    except ValueError:
        return None


def _ssl_context() -> ssl.SSLContext | None:
    """A context trusting the OTLP exporter's certificate file (``OTEL_EXPORTER_OTLP_*
    CERTIFICATE``), for a Phoenix behind TLS with its own CA; None: the system's."""
    for name in _CERTIFICATE_ENV:
        path = os.environ.get(name)
        if path:
            try:
                return ssl.create_default_context(cafile=path)
            except (OSError, ssl.SSLError, ValueError):
                return None
    return None


def _run_counts(exporter: object) -> Any:
    """The delivery counters (``DeliveryCounts``) of the run whose delivery holds ``exporter``:
    the installed run, or the one just stopped (``otr.stats()`` reads the same two)."""
    slot = _runtime.slot()
    for rt in (slot.installed, slot.last_stopped):
        delivery = getattr(rt, "delivery", None)
        for sender in getattr(delivery, "senders", ()) or ():
            if getattr(sender, "user_exporter", None) is exporter:
                return getattr(sender, "counts", None)
    return None


def _warn(message: str, *args: object) -> None:
    warn("otel_rollouts: " + message, *args)
