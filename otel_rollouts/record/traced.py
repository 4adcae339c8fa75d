"""``@otr.traced``: a span per call of a function, method, coroutine or generator.

Inside an episode the span is recorded cheaply with the episode (and kept or dropped with it);
outside any episode it is an ordinary OpenTelemetry SDK span. ``kind="episode"`` makes each
call an episode root; ``kind="turn"`` numbers turns; ``kind="generation"`` names the span
``chat {model}``; ``kind="tool"`` records arguments and result with the GenAI tool attributes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import Token
from typing import Any, TypeVar, overload

from opentelemetry.context import Context
from opentelemetry.trace.status import StatusCode

from otel_rollouts import conventions as c
from otel_rollouts._core import exit as _exit
from otel_rollouts._core import runtime as _runtime
from otel_rollouts._core.content import call_user, exception_text, snapshot, text
from otel_rollouts._core.guard import report
from otel_rollouts._core.spans import (
    SPAN_KEY,
    SpanRecord,
    attach_context,
    current_context,
    detach_context,
    exception_attributes,
)
from otel_rollouts.record.episode import (
    _BAGGAGE,
    OPEN_CALL,
    CallHandle,
    Episode,
    as_messages,
    record_usage,
    stage_call,
    with_identity,
)
from otel_rollouts.record.response import read_response

F = TypeVar("F", bound=Callable[..., Any])

_CALL_ARGUMENTS = (c.INPUT_VALUE, c.GEN_AI_TOOL_CALL_ARGUMENTS)
_EPISODE_ARGS = ("step", "split", "group_id", "sample_index", "policy_version", "episode_id")


class _Call:
    """One traced call: its span, and how to attach it to the context.

    ``merged``: the entered ``turn.tool_call`` / ``turn.generation`` this call records into
    (see ``CallHandle``): its span is that block's, which fails or ends with the block."""

    __slots__ = ("span", "episode", "sdk", "kind", "merged", "ctx")

    def __init__(self, span: Any, episode: Episode | None, sdk: bool, kind: str,
                 merged: Any = None, ctx: Context | None = None) -> None:
        self.span = span
        self.episode = episode
        self.sdk = sdk
        self.kind = kind
        self.merged = merged
        self.ctx = ctx  # the context the call started in: its first attach needs no other read

    def attach(self) -> Token[Context]:
        """Make the span current (``span_context``, in place): the same context object for
        a span of the episode the context names already, else the episode's identity added."""
        span = self.span
        ctx = self.ctx
        if ctx is None:
            ctx = current_context()
        else:
            self.ctx = None  # a generator resumed later reads the context of its resumption
        if self.sdk or getattr(ctx.get(_BAGGAGE), "episode", None) is not span.episode:
            ctx = with_identity(span, ctx)
        values = dict(ctx)  # with_span, in place
        values[SPAN_KEY] = span
        return attach_context(Context(values))

    def fail(self, exc: BaseException) -> None:
        try:
            if self.sdk:
                # not the SDK's record_exception: it calls the exception's __str__ unguarded
                self.span.add_event(c.EVENT_EXCEPTION, exception_attributes(exc))
                self.span.set_status(StatusCode.ERROR, exception_text(exc))
            elif self.episode is not None:
                # the rule of ``with otr.episode()`` (Episode.__exit__), from the one place that
                # holds it: cut short (sys.exit, Ctrl-C, an abandoned generator) is truncated,
                # any other exception an error; the episode ends here
                self.episode._close(exc)
            else:
                self.span.fail(exc)
                if self.merged is not None:
                    self.merged.merged_error = exc  # call.error(exc) of the block: the same failure
        except Exception as err:  # noqa: BLE001
            report(f"traced: {exception_text(err)}", exc=err)

    def abandoned(self, exc: GeneratorExit) -> None:
        """A traced generator closed before its end (the consumer gave up): an episode is cut
        short (truncated, as ``with otr.episode()`` records it); another span just ends."""
        if self.episode is not None:
            self.fail(exc)

    def output(self, value: Any) -> None:
        try:
            span = self.span
            kind = self.kind
            light = not self.sdk
            if light and kind == c.KIND_GENERATION and type(value) is str:
                # the common case, in place: a text answer, a message made here (nothing of the
                # caller's to copy), on a light span (an attribute of the library's own)
                if span.episode.capture_content:
                    span.attributes[c.GEN_AI_OUTPUT_MESSAGES] = [{"role": "assistant", "content": value}]
                return
            if light and kind == c.KIND_TOOL:  # the other common case, in place: a tool's result
                if span.episode.capture_content:
                    span.attributes[c.GEN_AI_TOOL_CALL_RESULT] = snapshot(value)
                return
            if kind == c.KIND_GENERATION and light and not isinstance(value, str):
                response = read_response(value)
                if response is not None:
                    self._response(span, response)
                    return
            if not (span.episode.capture_content if light else _runtime.current().capture_content):
                return
            if kind == c.KIND_GENERATION:
                if isinstance(value, str):
                    self.span.set_attribute(
                        c.GEN_AI_OUTPUT_MESSAGES, _render(self, [{"role": "assistant", "content": value}])
                    )
                    return
                if isinstance(value, dict) and "content" in value:
                    message = dict(value)
                    message.setdefault("role", "assistant")
                    self.span.set_attribute(c.GEN_AI_OUTPUT_MESSAGES, _render(self, [message]))
                    return
            if kind == c.KIND_TOOL:
                self.span.set_attribute(c.GEN_AI_TOOL_CALL_RESULT, _render(self, value))
                return
            if value is not None:
                self.span.set_attribute(c.OUTPUT_VALUE, _render(self, value))
        except Exception as err:  # noqa: BLE001
            report(f"traced: output: {exception_text(err)}", exc=err)

    def _response(self, span: SpanRecord, response: Any) -> None:
        """A model response's parts on the generation span: the message (content capture on),
        the finish reason, the model, and the token usage, which counts are, content or not."""
        record_usage(span, response.input_tokens, response.output_tokens)
        if response.finish_reason is not None:
            span.attributes[c.GEN_AI_RESPONSE_FINISH_REASONS] = [text(response.finish_reason)]
        if response.model and not span.attributes.get(c.GEN_AI_REQUEST_MODEL):
            span.attributes[c.GEN_AI_REQUEST_MODEL] = response.model
            span.name = c.chat_span_name(response.model)
        if response.message is not None and span.episode.capture_content:
            span.attributes[c.GEN_AI_OUTPUT_MESSAGES] = [snapshot(response.message)]

    def end(self) -> None:
        if self.merged is not None:
            return  # the block's span: it ends with the block
        try:
            if self.episode is not None:
                self.episode.end()
            else:
                self.span.end()
        except Exception as err:  # noqa: BLE001
            report(f"traced: end: {exception_text(err)}", exc=err)


def _render(call: _Call, value: Any) -> Any:
    """SDK spans need attribute values now; light spans keep a snapshot for later."""
    if call.sdk:
        from otel_rollouts._core.content import cut, to_json

        return cut(to_json(value), _runtime.current().max_attribute_chars)[0]
    return snapshot(value)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


_PLAIN_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class _Params:
    """A traced callable's parameters, read once when it is decorated.

    ``bind`` names a call's arguments as ``inspect``'s ``bind_partial`` + ``apply_defaults``
    would (in the signature's order, defaults filled in, ``self``/``cls`` left out), without
    calling it when the signature is plain (no ``*args``, ``**kwargs`` or positional-only
    parameters) and the call fits it: inspect's binding cost each call more than its span."""

    __slots__ = ("sig", "plain", "positional", "names", "defaults_from", "hidden")

    def __init__(self, sig: inspect.Signature | None) -> None:
        self.sig = sig
        self.plain: tuple[tuple[str, Any], ...] | None = None
        self.positional = 0
        # for a call with positional arguments only (the common case), its binding in C: the
        # names zipped with the arguments, then the defaults of the parameters after them
        self.names: tuple[str, ...] = ()
        self.defaults_from: tuple[dict[str, Any], ...] = ()
        self.hidden: tuple[str, ...] = ()  # self / cls: not recorded
        if sig is not None and all(p.kind in _PLAIN_KINDS for p in sig.parameters.values()):
            self.plain = tuple((name, p.default) for name, p in sig.parameters.items())
            self.positional = sum(
                p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
            self.names = tuple(name for name, _ in self.plain)
            empty = inspect.Parameter.empty
            self.defaults_from = tuple(
                {name: default for name, default in self.plain[i:] if default is not empty}
                for i in range(self.positional + 1))
            self.hidden = tuple(name for name in self.names if name in ("self", "cls"))

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        plain = self.plain
        n = len(args)
        if plain is None or n > self.positional:
            return _bound_args(self.sig, args, kwargs)
        if not kwargs:  # positional arguments only: in signature order, defaults filled in
            out = dict(zip(self.names, args, strict=False))
            defaults = self.defaults_from[n]
            if defaults:
                out.update(defaults)
            for name in self.hidden:
                out.pop(name, None)
            return out
        out = {}
        used = 0
        empty = inspect.Parameter.empty
        for i, (name, default) in enumerate(plain):
            if i < n:
                if name in kwargs:  # given twice: inspect says how
                    return _bound_args(self.sig, args, kwargs)
                value = args[i]
            elif name in kwargs:
                value = kwargs[name]
                used += 1
            elif default is not empty:
                value = default
            else:
                continue
            if name != "self" and name != "cls":
                out[name] = value
        if used != len(kwargs):  # a keyword the signature does not have
            return _bound_args(self.sig, args, kwargs)
        return out


def _bound_args(sig: inspect.Signature | None, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> dict[str, Any]:
    if sig is None:
        return {"args": list(args), **kwargs} if args else dict(kwargs)
    try:
        bound = sig.bind_partial(*args, **kwargs)
        bound.apply_defaults()
    except TypeError:
        return {"args": list(args), **kwargs}
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if name in ("self", "cls"):
            continue
        param = sig.parameters[name]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _model_of(model: str | None, arguments: dict[str, Any], args: tuple[Any, ...]) -> str | None:
    if model:
        return model
    for key in ("model", "model_name"):
        value = arguments.get(key)
        if isinstance(value, str) and value:
            return value
    if args:
        owner = args[0]
        for key in ("model_name", "model"):
            value = None
            if not isinstance(owner, (str, int, float)):
                value, _ = call_user(getattr, owner, key, None)  # a user __getattr__ may raise anything
            if isinstance(value, str) and value:
                return value
    return None


class _Spec:
    """What a traced callable's calls share, read once when it is decorated."""

    __slots__ = ("fn_name", "name", "kind", "model", "binder", "own", "tool",
                 "tool_span", "chat_span")

    def __init__(self, fn: Callable[..., Any], name: str | None, kind: str, model: str | None,
                 own: _runtime.Runtime | None) -> None:
        self.binder = _Params(_signature(fn))
        short_name = _label(getattr(fn, "__name__", "call")) or "call"
        self.fn_name = _label(getattr(fn, "__qualname__", short_name)) or short_name
        # the names as text once, here (a user's object: its __str__ guarded, as every value's)
        self.name, self.model = _label(name), _label(model)
        self.kind, self.own = kind, own
        self.tool = self.name or short_name
        self.tool_span = c.tool_span_name(self.tool)
        self.chat_span = self.name or c.chat_span_name(self.model)  # a call naming no other model


def _label(value: object) -> str | None:
    """A name given to ``traced`` (or the function's own) as text; None for none or empty."""
    if value is None:
        return None
    return (value if type(value) is str else text(value)) or None


def _start(spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call | None:
    """The call's span, started (None: not recorded; never raises: the traced function runs
    whatever happens here)."""
    try:
        return _started(spec, args, kwargs)
    except Exception as err:  # noqa: BLE001 - never break the traced function
        report(f"traced: start: {exception_text(err)}", exc=err)
        return None


def _started(spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call | None:
    fn_name, name, kind, model, own = spec.fn_name, spec.name, spec.kind, spec.model, spec.own
    ctx = current_context()
    current = ctx.get(SPAN_KEY)
    parent = current if isinstance(current, SpanRecord) and current.episode.state < 2 else None
    inside = parent.episode if parent is not None else None
    if inside is None or kind == c.KIND_EPISODE:
        rt = own if own is not None else _runtime.current()
        if not rt.enabled:
            return None
        capture = rt.capture_content
    else:
        # an episode's span in the context records its children, whatever is installed here: a
        # worker process records for its parent's episode without a runtime of its own
        capture = inside.capture_content
    arguments = spec.binder.bind(args, kwargs)
    if kind == c.KIND_EPISODE:
        params = {k: arguments[k] for k in _EPISODE_ARGS if k in arguments}
        split = params.pop("split", "train")
        step = params.pop("step", None)
        ep = Episode(step, split, name=name or c.SPAN_EPISODE, runtime=own, **params)
        ep.start()
        root = ep.root
        if root is None:
            return None
        root.attributes[c.CODE_FUNCTION] = fn_name
        if capture and arguments:
            root.attributes[c.INPUT_VALUE] = snapshot(arguments)
        return _Call(root, ep, False, kind)

    attributes: dict[str, Any] = {}
    if kind == c.KIND_GENERATION:
        if model:
            span_name = spec.chat_span
        else:
            model = _model_of(model, arguments, args)
            span_name = name or c.chat_span_name(model)
        if model:
            attributes[c.GEN_AI_REQUEST_MODEL] = model
        if capture and "messages" in arguments:
            attributes[c.GEN_AI_INPUT_MESSAGES] = as_messages(arguments["messages"], "user", inside)
        elif capture and arguments:
            attributes[c.INPUT_VALUE] = arguments
    elif kind == c.KIND_TOOL:
        span_name = spec.tool_span
        attributes[c.GEN_AI_TOOL_NAME] = spec.tool
        if capture and arguments:
            attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS] = arguments
    elif kind == c.KIND_TURN:
        span_name = name or c.SPAN_TURN
        if capture and arguments:
            attributes[c.INPUT_VALUE] = arguments
    else:
        span_name = name or fn_name
        if capture and arguments:
            attributes[c.INPUT_VALUE] = arguments

    if inside is not None:
        record = inside
        if kind in _MERGING_KINDS:
            handle = ctx.get(OPEN_CALL)
            target = (handle.take(kind, attributes.get(c.GEN_AI_TOOL_NAME))
                      if isinstance(handle, CallHandle) else None)
            if target is not None:
                _merge(target, kind, attributes)
                return _Call(target, None, False, kind, handle, ctx)
        if kind == c.KIND_TURN:
            attributes[c.RL_TURN_INDEX] = record.next_turn
            record.next_turn += 1
        for key in _CALL_ARGUMENTS:  # the call's own arguments are copied (messages already are)
            if key in attributes:
                attributes[key] = snapshot(attributes[key])
        child = stage_call(record, span_name, kind, parent, attributes)
        return _Call(child, None, False, kind, None, ctx)

    # outside any episode: an ordinary SDK span
    if rt.tracer is None:
        return None
    attributes.update(c.kind_attributes(kind))
    from otel_rollouts._core.content import cut, to_json

    sdk_attrs = {
        k: (v if isinstance(v, (str, bool, int, float)) else cut(to_json(v), rt.max_attribute_chars)[0])
        for k, v in attributes.items()
    }
    span = rt.tracer.start_span(span_name, attributes=sdk_attrs)
    return _Call(span, None, True, kind)


_MERGING_KINDS = (c.KIND_TOOL, c.KIND_GENERATION)


def _merge(span: SpanRecord, kind: str, attributes: dict[str, Any]) -> None:
    """What a traced call knows at its start, on the block's span it records into: only what the
    block did not say (the block's own arguments, model and messages win)."""
    held = span.attributes
    for key, value in attributes.items():
        if key in held:
            continue
        if key == c.INPUT_VALUE and kind == c.KIND_GENERATION and c.GEN_AI_INPUT_MESSAGES in held:
            continue  # the block gave the conversation: that is this generation's input
        held[key] = snapshot(value) if key in _CALL_ARGUMENTS else value
        if key == c.GEN_AI_REQUEST_MODEL:
            span.name = c.chat_span_name(value)


def _wrap(fn: Callable[..., Any], name: str | None, kind: str, model: str | None,
          own: _runtime.Runtime | None = None) -> Callable[..., Any]:
    spec = _Spec(fn, name, kind, model, own)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def agen_wrapper(*args: Any, **kwargs: Any) -> Any:
            call = _start(spec, args, kwargs)
            agen = fn(*args, **kwargs)
            if call is None:
                async for item in agen:
                    yield item
                return
            try:
                to_send: Any = None
                to_throw: BaseException | None = None
                while True:
                    token = call.attach()
                    try:
                        if to_throw is not None:
                            item = await agen.athrow(to_throw)
                        else:
                            item = await agen.asend(to_send)
                    except StopAsyncIteration:
                        return
                    except BaseException as exc:
                        if not isinstance(exc, GeneratorExit):
                            call.fail(exc)
                        raise
                    finally:
                        detach_context(token)
                    try:
                        to_send, to_throw = (yield item), None
                    except GeneratorExit as exc:
                        try:
                            await agen.aclose()  # its own clean-up still inside the episode
                        finally:
                            call.abandoned(exc)
                        raise
                    except BaseException as exc:  # thrown in by the caller
                        to_send, to_throw = None, exc
            finally:
                call.end()

        return agen_wrapper

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
            call = _start(spec, args, kwargs)
            gen = fn(*args, **kwargs)
            if call is None:
                return (yield from gen)
            try:
                to_send: Any = None
                to_throw: BaseException | None = None
                while True:
                    token = call.attach()
                    try:
                        if to_throw is not None:
                            item = gen.throw(to_throw)
                        else:
                            item = gen.send(to_send)
                    except StopIteration as stop:
                        call.output(stop.value)
                        return stop.value
                    except BaseException as exc:
                        call.fail(exc)
                        raise
                    finally:
                        detach_context(token)
                    try:
                        to_send, to_throw = (yield item), None
                    except GeneratorExit as exc:
                        try:
                            gen.close()  # its own clean-up still inside the episode
                        finally:
                            call.abandoned(exc)
                        raise
                    except BaseException as exc:
                        to_send, to_throw = None, exc
            finally:
                call.end()

        return gen_wrapper

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            call = _start(spec, args, kwargs)
            if call is None:
                return await fn(*args, **kwargs)
            token = call.attach()
            try:
                result = await fn(*args, **kwargs)
            except BaseException as exc:
                call.fail(exc)
                raise
            else:
                call.output(result)
                return result
            finally:
                detach_context(token)
                call.end()

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = _start(spec, args, kwargs)
        if call is None:
            return fn(*args, **kwargs)
        token = call.attach()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            call.fail(exc)
            raise
        else:
            call.output(result)
            return result
        finally:
            # a module function, not the ContextVar's bound reset: a traced function is pickled
            # by value where Ray ships it, and a ContextVar cannot be
            detach_context(token)
            call.end()

    return wrapper


# a wrapper's frame only runs the user's function: a signal landing below it may flush at once
_exit.calls_user_code([_wrap])


@overload
def traced(fn: F) -> F: ...
@overload
def traced(*, name: str | None = None, kind: str = "span", model: str | None = None,
           rollouts: _runtime.Runtime | None = None) -> Callable[[F], F]: ...


def traced(fn: Callable[..., Any] | None = None, *, name: str | None = None, kind: str = c.KIND_SPAN,
           model: str | None = None, rollouts: _runtime.Runtime | None = None) -> Any:
    """Trace each call of the decorated callable as a span.

    ``kind`` is one of ``span``, ``generation``, ``tool``, ``turn`` or ``episode``. Works on
    functions, methods, classmethods, staticmethods, coroutines, generators and async
    generators. Exceptions mark the span as an error and propagate untouched.

    ``rollouts``: the instance an episode (or a span outside any episode) records into
    (``otr.configure(install=False)``); default: the one active when the call starts
    (``Rollouts.activate()``), else the installed one. A span inside an episode records into
    that episode, whichever instance it belongs to.
    """
    if kind not in c.TRACED_KINDS:
        raise ValueError(f"traced: kind must be one of {', '.join(c.TRACED_KINDS)}, got {kind!r}")
    if rollouts is not None and not isinstance(rollouts, _runtime.Runtime):
        raise TypeError(f"traced: rollouts must be an otr.Rollouts (from otr.configure), got {type(rollouts).__name__}")

    def decorate(target: Any) -> Any:
        if isinstance(target, classmethod):
            return classmethod(_wrap(target.__func__, name, kind, model, rollouts))
        if isinstance(target, staticmethod):
            return staticmethod(_wrap(target.__func__, name, kind, model, rollouts))
        return _wrap(target, name, kind, model, rollouts)

    if fn is not None:
        return decorate(fn)
    return decorate
