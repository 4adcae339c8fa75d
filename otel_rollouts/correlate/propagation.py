"""Trace context into outgoing requests, and out of incoming ones (W3C TraceContext + Baggage).

An episode's spans are light records, but the current one sits in the OpenTelemetry context as
a real ``Span`` with the episode's trace id, so OpenTelemetry's own propagators serialise it as
is. On top of ``traceparent``/``tracestate`` the W3C ``baggage`` header carries ``rl.run.id``,
``rl.step``, ``rl.episode.id`` and ``rl.group.id`` so a server (vLLM, SGLang, a reward model) can
tag its own spans or logs with the episode they served (``otr.copy_baggage_to_spans()`` there).
The episode's handles put these keys in the OpenTelemetry context itself, so the stock client
instrumentations (httpx, requests, aiohttp, grpc) send them as well.

    with turn.generation("policy") as gen:
        response = client.chat.completions.create(..., extra_headers=otr.openai_extra_headers())

The server's span then becomes a child of this generation span, in the episode's trace.

The ``sampled`` flag stays set: when the request leaves, the tail sampler has not decided yet
(rewards come later), so the server records and exports its spans itself. Server-side spans of
an episode that is later dropped reach the collector as a fragment without its root; they carry
the episode id in baggage if the server copies baggage to span attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Protocol, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_rollouts.record.episode import with_identity

if TYPE_CHECKING:
    from requests.adapters import HTTPAdapter

__all__ = [
    "extract_context",
    "httpx_event_hooks",
    "inject_headers",
    "instrument_requests_session",
    "openai_extra_headers",
    "propagator",
]

# Always W3C, whatever OTEL_PROPAGATORS says: inference servers (vLLM, SGLang) and the OTel
# server instrumentations read exactly these headers.
_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


class _Request(Protocol):
    """What is read of an outgoing request (an ``httpx.Request``): its mutable headers."""

    @property
    def headers(self) -> MutableMapping[str, str]: ...


class _Session(Protocol):
    """What is used of a ``requests.Session``: mounting an adapter on a URL prefix."""

    def mount(self, prefix: str, adapter: HTTPAdapter) -> None: ...


_SessionT = TypeVar("_SessionT", bound=_Session)


def propagator() -> CompositePropagator:
    """The propagator used here: W3C TraceContext followed by W3C Baggage."""
    return _PROPAGATOR


def _episode_context(ctx: otel_context.Context | None = None) -> otel_context.Context:
    """``ctx`` (default: current) whose baggage carries the identity of its current span's
    episode. Inside an entered episode the context carries it already (the episode's handles
    put it there, once per episode) and is returned as is; a context made some other way (a
    span set current with OpenTelemetry's own API) gets it here."""
    ctx = ctx if ctx is not None else otel_context.get_current()
    return with_identity(trace.get_current_span(ctx), ctx)


def inject_headers(
    headers: MutableMapping[str, str] | None = None,
    context: otel_context.Context | None = None,
) -> MutableMapping[str, str]:
    """Add ``traceparent``/``tracestate``/``baggage`` for the current span to ``headers``.

    Returns ``headers`` (a new dict when None was given). Outside any span nothing is added
    (baggage set by the user still is). Never raises: a failure leaves the headers as they were.
    """
    if headers is None:
        headers = {}
    try:
        _PROPAGATOR.inject(headers, context=_episode_context(context))
    except Exception:  # noqa: BLE001 - telemetry never breaks a request
        pass
    return headers


def openai_extra_headers(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """Headers for the ``extra_headers=`` argument of an OpenAI-compatible client call."""
    out = dict(headers) if headers else {}
    inject_headers(out)
    return out


def extract_context(
    headers: Mapping[str, object], context: otel_context.Context | None = None
) -> otel_context.Context:
    """The context (remote parent span + baggage) carried by incoming ``headers``.

    Use it as ``parent``/``context`` of the server's span, or ``otel_context.attach`` it.
    Header names are matched case-insensitively.
    """
    lowered = {str(k).lower(): v for k, v in headers.items()}
    return _PROPAGATOR.extract(lowered, context=context)


# --- httpx -----------------------------------------------------------------------------------------
def _httpx_inject(request: _Request) -> None:
    carrier: dict[str, str] = {}
    inject_headers(carrier)
    for key, value in carrier.items():
        request.headers[key] = value


async def _httpx_inject_async(request: _Request) -> None:
    _httpx_inject(request)


def httpx_event_hooks(asynchronous: bool = False) -> dict[str, list[Callable[[_Request], object]]]:
    """``event_hooks`` for ``httpx.Client`` (or ``httpx.AsyncClient`` with ``asynchronous=True``).

    ``httpx.Client(event_hooks=otr.httpx_event_hooks())``: every request carries the context
    current when it is sent (hooks run in the caller's thread / task).
    """
    return {"request": [_httpx_inject_async if asynchronous else _httpx_inject]}


# --- requests --------------------------------------------------------------------------------------
def _adapter_class() -> type[HTTPAdapter]:
    from requests import PreparedRequest
    from requests.adapters import HTTPAdapter

    class ContextAdapter(HTTPAdapter):
        """A ``requests`` adapter that adds the current trace context to each request it sends."""

        def add_headers(self, request: PreparedRequest, **kwargs: object) -> None:
            super().add_headers(request, **kwargs)
            carrier: dict[str, str] = {}
            inject_headers(carrier)
            request.headers.update(carrier)

    return ContextAdapter


def instrument_requests_session(session: _SessionT) -> _SessionT:
    """Mount an adapter on ``session`` (http and https) that injects the trace context; returns it."""
    adapter = _adapter_class()()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
