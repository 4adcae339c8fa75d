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
``/v1/traces``). It wraps the exporter's ``export``, ``force_flush`` and ``shutdown`` on the
instance, the way ``OtlpProbe`` wraps its transport, so that the exporter stays itself for every
other layer (its name in ``otr.stats()``, the request-size limit, the collector's answer).
Without ``?sync=true`` Phoenix queues the annotations and postpones one whose span is not
inserted yet (every 10 s, 60 times), so posting right after the spans is safe.

The rules:

* Off the export path. ``export`` only turns the batch's evaluations into JSON and queues
  them; a poster thread of the layer's own (started at the first, a daemon) sends them.
  A slow, hanging or hostile annotation endpoint never delays span delivery, nor loses it.
* Bounded: the queue holds at most ``MAX_QUEUED_ANNOTATIONS`` annotations and ``MAX_QUEUED_BYTES``
  of their JSON; what does not fit is lost (``queue_full``). The poster sends what is queued
  together, up to ``MAX_ANNOTATIONS_PER_REQUEST`` a request, so it keeps up with a step's kept
  episodes however many batches they came in. Each request, the detection included, has
  one total deadline (connecting, sending, the status line, the headers and the body together:
  a server answering one byte at a time is cut off at it, as is one that never answers). After a
  failure, posting pauses (5 s, doubling up to 5 min) and the annotations of batches exported
  meanwhile are lost (``paused``).
* No redirect is followed. A 3xx is a failed request (``redirect``): following it would carry
  the request, and the exporter's credentials, to wherever the answer points, and turn the POST
  into a body-less GET. Credentials go only to Phoenix's base URL (the exporter's own host).
* Phoenix or not: asked once per exporter, on the poster thread, before its first post:
  ``GET <base>/arize_phoenix_version`` answering 200 with a version number. Not a Phoenix: nothing
  more is ever sent, and nothing counted. ``OTEL_ROLLOUTS_PHOENIX_ANNOTATIONS`` (``auto``, the
  default; ``on``: post without asking; ``off``; or Phoenix's base URL, e.g.
  ``http://127.0.0.1:6006``) decides. A gRPC exporter's endpoint is not Phoenix's HTTP port:
  there, annotations are posted only to a URL given in that variable.
* Annotations are a view: what happens to them never changes the export's result, so never the
  delivery ledger (an episode is delivered when its spans are stored), and never raises.
* Flush and shutdown: the exporter's ``force_flush(timeout)`` waits for the poster for at most
  half of what is left of its timeout; ``shutdown()`` waits at most ``CLOSE_GRACE_S``, then cuts
  the request under way and counts what was not posted lost (``shutdown``).
* Every annotation handed to the poster ends in exactly one outcome, counted in ``otr.stats()``
  totals, per exporter: ``annotations.posted.<exporter>`` (Phoenix took them) or
  ``annotations.lost.<exporter>`` (not posted), which is the sum of
  ``annotations.lost.<reason>.<exporter>`` over the reasons ``queue_full``, ``paused``,
  ``timeout``, ``redirect``, ``refused`` (an HTTP error status), ``unreachable`` (connection
  refused or reset, TLS), ``bad_answer`` (not HTTP), ``detect`` (the version request had no
  answer), ``invalid`` (not encodable as JSON), ``error`` (a bug of the layer, also counted in
  ``annotations.errors.<exporter>``) and ``shutdown``. Requests that failed:
  ``annotations.failures.<exporter>``, the sum of ``annotations.failures.<kind>.<exporter>``
  (``timeout``, ``redirect``, ``refused``, ``unreachable``, ``bad_answer``); a failure's kind is
  logged once.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_rollouts import conventions as c
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import exception_text, reraise_interrupt
from otel_rollouts._core.guard import first_time
from otel_rollouts._core.health import health_text
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
    "columns_of",
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
MAX_QUEUED_ANNOTATIONS = 16_384  # annotations waiting for the poster
MAX_QUEUED_BYTES = 4 * 1024 * 1024  # their JSON, in all
FLUSH_SHARE = 0.5  # of what is left of a flush's timeout, the most the poster is waited for
CLOSE_GRACE_S = 0.25  # shutdown: the most the poster is waited for before its request is cut
CLOSE_JOIN_S = 0.5  # then, the most its thread is waited for
_VERSION = re.compile(rb"\s*\d+\.\d+")
_KINDS = frozenset({"HUMAN", "LLM", c.OI_ANNOTATOR_CODE})
_NOT_FORWARDED = frozenset({"content-type", "content-encoding", "content-length", "user-agent"})
_CERTIFICATE_ENV = (c.ENV_OTLP_TRACES_CERTIFICATE, c.ENV_OTLP_CERTIFICATE)


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
    """Phoenix's span annotations (``POST /v1/span_annotations`` items) for every episode root
    span in ``spans``: its evaluations (the same name, score, label, explanation, annotator kind,
    identifier and metadata as its ``evaluations.<i>.evaluation.*`` attributes) and the columns
    of ``columns_of``. The reward goes first, then the columns, then the other evaluations:
    Phoenix lists a project's annotation columns (its Columns menu, the Stats panel) in the
    order their names were first stored, so the columns a researcher ticks first come first."""
    out: list[dict[str, object]] = []
    queued: dict[int, float] = {}  # trace id -> seconds its generations waited in the engine's queue
    for span in spans:
        seconds = _finite((span.attributes or {}).get(c.RL_SERVER_QUEUE_SECONDS))
        if span.context is not None and seconds is not None and seconds >= 0:
            queued[span.context.trace_id] = queued.get(span.context.trace_id, 0.0) + seconds
    for span in spans:
        attributes = span.attributes or {}
        if span.context is None or attributes.get(c.RL_SPAN_KIND) != c.KIND_EPISODE:
            continue
        span_id = f"{span.context.span_id:016x}"
        evaluations = [_evaluation_annotation(span_id, evaluation) for evaluation in read_evaluations(attributes)]
        first = 1 if evaluations and evaluations[0]["name"] == c.EVALUATION_REWARD else 0
        out.extend(evaluations[:first])
        # a reward component of the same name (the user's) keeps it: Phoenix keeps one per name
        taken = {annotation["name"] for annotation in evaluations}
        out.extend({"span_id": span_id, "name": name, "annotator_kind": c.OI_ANNOTATOR_CODE, "result": result}
                   for name, result in columns_of(attributes, queued.get(span.context.trace_id))
                   if name not in taken)
        out.extend(evaluations[first:])
    return out


def _evaluation_annotation(span_id: str, evaluation: Mapping[str, object]) -> dict[str, object]:
    """The annotation of one of a root's evaluations (``read_evaluations``' shape)."""
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
    return annotation


def columns_of(attributes: Mapping[str, object],
               queued: float | None = None) -> list[tuple[str, dict[str, object]]]:
    """(name, result) of the annotations an episode root gets beyond its evaluations, so that
    Phoenix's span list shows them as columns and filters by them (its metadata JSON is one
    column that sorts by nothing, and a column shows a score, or a label when there is none):

    * ``step``: score = ``rl.step`` (``evals['step'].score == 40``);
    * ``stage``: label = the stage the episode spent most time in (the largest of its
      ``rl.stage.<stage>.seconds``: generation, tool, environment, reward, waiting),
      explanation = ``tool 8.0 s of 8.3 s`` (``evals['stage'].label == 'tool'``). A label only:
      with a score, Phoenix's column would show the seconds and not the stage;
    * ``kl``: score = ``rl.mismatch.kl``, when both logprobs were known (sort by it);
    * ``kept``: label = why the tail sampler kept the episode (``rl.trace.keep_reason``:
      ``evals['kept'].label == 'watch'``);
    * ``queue``: score = ``queued``, the seconds the episode's generations waited in the
      inference engine's queue (their ``rl.server.queue.seconds``, summed), when the engine's
      timings reached them before the export (sort by it: an engine straggler on top);
    * ``group``: label = its GRPO group's ``rl.group.degenerate`` (``all_equal``,
      ``lost_members``, ``all_equal,lost_members``) or ``none``, explanation = the group's health
      as Trackio's tables say it (``all equal ×3, lost 1/4``): ``evals['group'].label != 'none'``
      lists the members of degenerate groups, sorted by the column.

    None of them is an evaluation of the episode (a quality judged), so none is on the span as
    an OpenInference evaluation or a ``gen_ai.evaluation.result`` event: other backends read
    those as scores. Each is absent when its attribute is (never 0 for unknown)."""
    out: list[tuple[str, dict[str, object]]] = []
    step = attributes.get(c.RL_STEP)
    if isinstance(step, int) and not isinstance(step, bool):
        out.append((c.ANNOTATION_STEP, {c.OI_EVALUATION_SCORE: step}))
    stages = [(seconds, stage) for stage in c.STAGES
              if (seconds := _finite(attributes.get(c.stage_seconds(stage)))) is not None and seconds >= 0]
    if stages:
        seconds, stage = max(stages, key=lambda pair: pair[0])  # the first of equal ones: STAGES' order
        total = _finite(attributes.get(c.RL_DURATION_SECONDS))
        of = f" of {total:.3g} s" if total is not None and total >= seconds else ""
        out.append((c.ANNOTATION_STAGE, {c.OI_EVALUATION_LABEL: stage,
                                         c.OI_EVALUATION_EXPLANATION: f"{stage} {seconds:.3g} s{of}"}))
    kl = _finite(attributes.get(c.RL_MISMATCH_KL))
    if kl is not None:
        out.append((c.ANNOTATION_KL, {c.OI_EVALUATION_SCORE: kl}))
    reason = attributes.get(c.RL_KEEP_REASON)
    if isinstance(reason, str) and reason:
        out.append((c.ANNOTATION_KEPT, {c.OI_EVALUATION_LABEL: reason}))
    if queued is not None:
        out.append((c.ANNOTATION_QUEUE, {c.OI_EVALUATION_SCORE: round(queued, 6)}))
    size = attributes.get(c.RL_GROUP_SIZE)
    if isinstance(size, int) and not isinstance(size, bool):
        degenerate = attributes.get(c.RL_GROUP_DEGENERATE)
        label = degenerate if isinstance(degenerate, str) and degenerate else c.DEGENERATE_NONE
        expected = _count(attributes.get(c.RL_GROUP_EXPECTED_SIZE)) or None
        text = health_text(size, expected, attributes.get(c.RL_GROUP_ALL_EQUAL) is True,
                           _count(attributes.get(c.RL_GROUP_LOST)), _count(attributes.get(c.RL_GROUP_TRUNCATED)))
        out.append((c.ANNOTATION_GROUP, {c.OI_EVALUATION_LABEL: label, c.OI_EVALUATION_EXPLANATION: text}))
    return out


def _count(value: object) -> int:
    """A count attribute as a positive int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _finite(value: object) -> float | None:
    """A finite number as a float (JSON and Phoenix take no NaN), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _metadata(value: object) -> dict[str, object] | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


# --- one request, bounded in total -------------------------------------------------------------
class _Deadline:
    """One request's total time: connecting, sending, the status line, the headers and the body
    together. Each connection attempt gets only what is left, and a timer shuts the request's
    socket down at the deadline (a read timeout alone is reset by every byte a server trickles,
    and does nothing while ``getresponse`` reads headers one line at a time). ``abort()`` does
    the same at once (the layer's shutdown). Name resolution is the system resolver's and is not
    bounded here: it runs on the poster thread, off the export path."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.cut = False  # the timer or abort() shut the request down
        self._lock = threading.Lock()
        self._watched: list[socket.socket] = []  # a dup of each socket the request opened
        self._done = False
        self._timer = threading.Timer(max(seconds, 0.0), self.abort)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.at - time.monotonic()

    def connect(self, address: tuple[str, int], timeout: object = None,
                source_address: tuple[str, int] | None = None) -> socket.socket:
        """``socket.create_connection`` within the deadline (``http.client``'s hook for it):
        every address tried gets what is left, not a timeout of its own."""
        host, port = address
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
            left = self.left()
            if left <= 0 or self.cut:
                break
            sock = socket.socket(family, kind, proto)
            try:
                self._watch(sock)
                sock.settimeout(left)
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                error = exc
                sock.close()
        raise error if error is not None and not self.cut else TimeoutError("the request's deadline passed")

    def _watch(self, sock: socket.socket) -> None:
        """Keep a duplicate of ``sock``'s descriptor: ``shutdown(2)`` on it cuts the connection
        whatever object wraps the socket by then (TLS wraps it in a new one, mid-handshake too)."""
        with self._lock:
            if self.cut or self._done:
                raise TimeoutError("the request's deadline passed")
            self._watched.append(sock.dup())

    def abort(self) -> None:
        """Cut the request now: whatever it is waiting for returns at once, with an error."""
        with self._lock:
            if self._done:
                return
            self.cut = True
            for sock in self._watched:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # not connected yet, or closed already
                    pass

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._done = True
            watched, self._watched = self._watched, []
        for sock in watched:
            sock.close()


class _HTTPConnection(http.client.HTTPConnection):
    """``http.client``'s connection, connecting within a ``_Deadline``."""

    def __init__(self, host: str, *, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self._create_connection = deadline.connect  # http.client's hook for making the socket


class _HTTPSConnection(http.client.HTTPSConnection):
    """The TLS one (the handshake is cut at the deadline too: the socket is watched before it)."""

    def __init__(self, host: str, *, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self._create_connection = deadline.connect


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPConnection, deadline=self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline, context: ssl.SSLContext | None) -> None:
        super().__init__(context=context)
        self.deadline = deadline
        self.tls = context

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPSConnection, deadline=self.deadline), req, context=self.tls)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is the answer, never followed (``urllib`` then raises it as an ``HTTPError``):
    following it would send the request, and the exporter's credentials, wherever the answer
    points, and make a POST a body-less GET."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


class _Failed(Exception):
    """A request that did not get a 2xx: ``kind`` (the counters' word), ``detail`` (logged)."""

    def __init__(self, kind: str, log_kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.log_kind = log_kind
        self.detail = detail


def _fetch(url: str, *, method: str, headers: Mapping[str, str], data: bytes | None, timeout: float,
           context: ssl.SSLContext | None, limit: int,
           started: Callable[[_Deadline], None] = lambda deadline: None) -> tuple[int, bytes]:
    """One request within ``timeout`` seconds in all, no redirect followed (``urllib`` for the
    rest: the environment's proxies, TLS); (status, at most ``limit`` bytes of the body) of a 2xx
    answer, else ``_Failed``. ``started`` is told the request's deadline (to abort it)."""
    deadline = _Deadline(timeout)
    started(deadline)
    opener = urllib.request.build_opener(_NoRedirect(), _HTTPHandler(deadline), _HTTPSHandler(deadline, context))
    request = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
    try:
        with opener.open(request, timeout=max(deadline.left(), 0.001)) as response:
            body = response.read(limit)
            return response.status, body
    except urllib.error.HTTPError as exc:
        exc.close()
        if 300 <= exc.code < 400:
            raise _Failed("redirect", f"http.{exc.code}",
                          f"HTTP {exc.code}, a redirect (not followed: give the final URL)") from None
        raise _Failed("refused", f"http.{exc.code}", f"HTTP {exc.code} {exc.reason}") from None
    except Exception as exc:  # noqa: BLE001 - down, slow, reset, cut at the deadline
        if deadline.cut or _is_timeout(exc):
            raise _Failed("timeout", "timeout",
                          f"timed out: no complete answer within {timeout:g} s") from None
        if isinstance(exc, OSError):  # URLError included: refused, reset, TLS, name unknown
            raise _Failed("unreachable", type(exc).__name__, exception_text(exc)) from None
        raise _Failed("bad_answer", type(exc).__name__, exception_text(exc)) from None  # not HTTP
    finally:
        deadline.close()


def _is_timeout(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)  # URLError wraps the socket's error
    return isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)


# --- the layer ---------------------------------------------------------------------------------
class _Wrapped:
    """One of the exporter's own methods (``inner``, an attribute set on the instance before
    this one, else None: the class's method is then looked up at each call, so that a class
    patched later, an instrumentation or a test's spy, is still the one called), with the
    layer's part around it."""

    method = ""

    def __init__(self, exporter: SpanExporter, inner: Callable[..., Any] | None, layer: PhoenixAnnotations) -> None:
        self.exporter = exporter
        self.inner = inner
        self.layer = layer

    def own(self, *args: Any) -> Any:
        inner = self.inner
        return inner(*args) if inner is not None else getattr(type(self.exporter), self.method)(self.exporter, *args)


class _Export(_Wrapped):
    """The exporter's ``export``, then, on ``SUCCESS``, the batch's annotations queued."""

    method = "export"

    def __call__(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.own(spans)
        if result is SpanExportResult.SUCCESS:
            self.layer.exported(spans)
        return result


class _Flush(_Wrapped):
    """The exporter's ``force_flush``, then the poster waited for (half of the time left at
    most); the answer is the exporter's (annotations are a view)."""

    method = "force_flush"

    def __call__(self, timeout_millis: int = 30000) -> Any:
        started = time.monotonic()
        result = self.own(timeout_millis)
        left = max(timeout_millis, 0) / 1000 - (time.monotonic() - started)
        self.layer.wait_idle(left * FLUSH_SHARE)
        return result


class _Shutdown(_Wrapped):
    """The poster stopped (what it did not post counted lost), then the exporter's ``shutdown``."""

    method = "shutdown"

    def __call__(self) -> None:
        self.layer.close()
        self.own()


def _per_episode(annotations: list[dict[str, object]]) -> list[list[dict[str, object]]]:
    """``annotations`` (in episode order) as one list per episode root span."""
    parts: list[list[dict[str, object]]] = []
    for annotation in annotations:
        if parts and parts[-1][0]["span_id"] == annotation["span_id"]:
            parts[-1].append(annotation)
        else:
            parts.append([annotation])
    return parts


class _Batch:
    """Annotations waiting for the poster, encoded: how many, and the items of their JSON array
    without its brackets (so that batches queued together are sent as one request)."""

    __slots__ = ("count", "items")

    def __init__(self, count: int, items: bytes) -> None:
        self.count = count
        self.items = items

    def body(self) -> bytes:
        """The request's body: Phoenix's ``{"data": [...]}``."""
        return b'{"data": [' + self.items + b"]}"


class PhoenixAnnotations:
    """Posts the evaluations of each exported batch's episode roots to Phoenix (see the module).

    ``base``: Phoenix's base URL; ``detect``: ask ``/arize_phoenix_version`` first (``auto``);
    ``headers``: sent with each request (the exporter's own, for an authenticated Phoenix).
    ``exporter``: the exporter it is attached to, whose name and run its counts go under.
    ``post_timeout`` / ``detect_timeout``: each request's total deadline, in seconds.
    """

    def __init__(self, base: str, *, detect: bool = True, headers: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None, detect_timeout: float = DETECT_TIMEOUT_S,
                 post_timeout: float = POST_TIMEOUT_S) -> None:
        self.base = base.rstrip("/")
        self.headers = dict(headers or {})
        self.exporter = exporter
        self.detect_timeout = detect_timeout
        self.post_timeout = post_timeout
        self.max_queued_annotations = MAX_QUEUED_ANNOTATIONS
        self.max_queued_bytes = MAX_QUEUED_BYTES
        self.phoenix: bool | None = None if detect else True  # None: not asked yet
        self.version: str | None = None
        self.stats = Stats()  # used when the exporter is not one of a run's (replay, own use)
        self._cond = threading.Condition()  # guards the queue, the request under way, closed
        self._queue: deque[_Batch] = deque()
        self._queued_bytes = 0
        self._queued_annotations = 0
        self._current: _Batch | None = None  # taken by the poster, its outcome not counted yet
        self._deadline: _Deadline | None = None  # the request under way (aborted at shutdown)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._unanswered = False  # given up on detection for want of an answer
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
            own = vars(exporter) if hasattr(exporter, "__dict__") else {}
            wrapped = [(wrapper, own.get(wrapper.method)) for wrapper in (_Flush, _Shutdown, _Export)]
            for wrapper, inner in wrapped:
                setattr(exporter, wrapper.method, wrapper(exporter, inner, layer))
            return layer
        except Exception:  # noqa: BLE001 - an exporter we do not know: no annotations
            return None

    # --- on the sender thread: queue, never send ---------------------------------------------
    def exported(self, spans: Sequence[ReadableSpan]) -> None:
        """``spans`` were stored: queue their episodes' evaluations for the poster. Never raises,
        never waits on the network."""
        try:
            if self.phoenix is False:
                return
            # one part per episode (the sender sends many episodes in one export): what fits the
            # queue is queued, episode by episode, and what does not is lost; the poster sends the
            # parts queued together in one request
            for part in _per_episode(annotations_of(spans)):
                try:
                    items = json.dumps(part, ensure_ascii=False, allow_nan=False).encode()[1:-1]
                except (TypeError, ValueError) as exc:
                    self._lose("invalid", len(part))
                    self._report("invalid", f"annotations not encodable as JSON ({exception_text(exc)})")
                    continue
                self._submit(_Batch(len(part), items))
        except BaseException as exc:  # noqa: BLE001 - a view never breaks delivery
            reraise_interrupt(exc)
            self._count("errors", 1)
            self._report("error", f"annotations: {exception_text(exc)}")

    def _submit(self, batch: _Batch) -> None:
        with self._cond:
            if self._closed:
                reason: str | None = "shutdown"
            elif time.monotonic() < self._resume_at:
                reason = "paused"
            elif (self._queued_annotations + batch.count > self.max_queued_annotations
                  or self._queued_bytes + len(batch.items) > self.max_queued_bytes):
                reason = "queue_full"
            else:
                reason = None
                self._queue.append(batch)
                self._queued_bytes += len(batch.items)
                self._queued_annotations += batch.count
                self._start()
                self._cond.notify_all()
        if reason is not None:
            self._lose(reason, batch.count)

    def _start(self) -> None:
        """Start the poster thread if it is not running (the first request; after a fork)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="otel-rollouts-phoenix-annotations", daemon=True)
            self._thread.start()

    # --- the poster thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return  # close() counted what was queued
                request = self._take()
                self._current = request
            try:
                outcome = self._handle(request)
            except BaseException as exc:  # noqa: BLE001 - the poster never dies
                outcome = "error"
                self._count("errors", 1)
                self._report("error", f"annotations: {exception_text(exc)}")
            with self._cond:
                if self._current is request:  # else close() counted it already
                    self._current = None
                    self._settle(request, outcome)
                self._cond.notify_all()

    def _take(self) -> _Batch:
        """The queued batches that fit one request, as one (the caller holds ``_cond``)."""
        taken = [self._queue.popleft()]
        count = taken[0].count
        while self._queue and count + self._queue[0].count <= MAX_ANNOTATIONS_PER_REQUEST:
            taken.append(self._queue.popleft())
            count += taken[-1].count
        items = taken[0].items if len(taken) == 1 else b", ".join(batch.items for batch in taken)
        self._queued_bytes -= sum(len(batch.items) for batch in taken)
        self._queued_annotations -= count
        return _Batch(count, items)

    def _handle(self, request: _Batch) -> str | None:
        """Post one request; its outcome: ``posted``, a loss's reason, or None (not a Phoenix:
        never made)."""
        if self.phoenix is False:
            return "detect" if self._unanswered else None
        if time.monotonic() < self._resume_at:
            return "paused"
        if self.phoenix is None:
            self._detect()
            if self.phoenix is False:
                return "detect" if self._unanswered else None
            if self.phoenix is None:  # no answer yet: lost, the next request asks again
                return "shutdown" if self._closed else "detect"
        try:
            self._post(request.body())
        except _Failed as failed:
            if self._closed:
                return "shutdown"  # cut by close(): not Phoenix's failure
            self._count(f"failures.{failed.kind}", 1)
            self._count("failures", 1)
            self._resume_at = time.monotonic() + self._pause
            self._pause = min(self._pause * 2, MAX_PAUSE_S)
            self._report(failed.log_kind, f"posting annotations to {self.base}{ANNOTATIONS_PATH} failed "
                                          f"({failed.detail}); paused, then retried with later batches")
            return failed.kind
        self._pause = FIRST_PAUSE_S
        return "posted"

    def _settle(self, request: _Batch, outcome: str | None) -> None:
        if outcome == "posted":
            self._count("posted", request.count)
        elif outcome is not None:
            self._lose(outcome, request.count)

    def _detect(self) -> None:
        """Ask whether ``base`` is a Phoenix: ``phoenix`` becomes True or False, or stays None
        (no answer; given up on, False, after ``MAX_DETECT_TRIES``)."""
        self._tries += 1
        try:
            status, body = _fetch(self.base + VERSION_PATH, method="GET", headers=self.headers, data=None,
                                  timeout=self.detect_timeout, context=self._context, limit=64,
                                  started=self._under_way)
        except _Failed as failed:
            if failed.kind == "redirect":
                self.phoenix = False  # an answer: not Phoenix's (it answers its version itself)
                self._report("detect", f"{self.base}{VERSION_PATH} answered {failed.detail}: "
                                       f"no annotations are posted")
            elif failed.kind == "refused":
                self.phoenix = False
            elif self._tries >= MAX_DETECT_TRIES and not self._closed:
                self.phoenix = False
                self._unanswered = True
                self._report("detect", f"no answer from {self.base}{VERSION_PATH} ({failed.detail}) "
                                       f"after {self._tries} tries: no annotations are posted")
            return
        self.phoenix = status == 200 and _VERSION.match(body) is not None
        if self.phoenix:
            self.version = body.decode("ascii", "replace").strip()

    def _post(self, body: bytes) -> None:
        """One request; returns when Phoenix took it, else raises ``_Failed``."""
        headers = {**self.headers, "Content-Type": "application/json"}
        started = time.monotonic()
        try:
            _fetch(self.base + ANNOTATIONS_PATH, method="POST", headers=headers, data=body,
                   timeout=self.post_timeout, context=self._context, limit=4096, started=self._under_way)
        finally:
            self.last_post_s = time.monotonic() - started

    def _under_way(self, deadline: _Deadline) -> None:
        """The poster's request under way: cut at once if the layer is closing."""
        with self._cond:
            self._deadline = deadline
            closed = self._closed
        if closed:
            deadline.abort()

    # --- flush and shutdown -------------------------------------------------------------------
    def wait_idle(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every queued request has an outcome; True if
        so. Never raises."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while self._queue or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """Stop the poster: wait ``grace`` seconds at most for it to finish, then cut the request
        under way; what was not posted is lost (``shutdown``). Later batches are lost too. Never
        raises; bounded by ``grace`` + ``CLOSE_JOIN_S``."""
        try:
            self.wait_idle(grace)
            with self._cond:
                self._closed = True
                rest = list(self._queue)
                self._queue.clear()
                self._queued_bytes = self._queued_annotations = 0
                deadline = self._deadline
                self._cond.notify_all()
            for batch in rest:
                self._settle(batch, "shutdown" if self.phoenix is not False or self._unanswered else None)
            if deadline is not None:
                deadline.abort()
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(CLOSE_JOIN_S)
            with self._cond:  # a request still under way (a resolver that hangs): lost now
                under_way, self._current = self._current, None
                if under_way is not None:
                    self._settle(under_way, "shutdown")
                self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - shutdown of a view never raises
            reraise_interrupt(exc)
            self._count("errors", 1)

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

    def _lose(self, reason: str, n: int) -> None:
        """``n`` annotations not posted, for ``reason``: in all and by reason."""
        self._count("lost", n)
        self._count(f"lost.{reason}", n)

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
