"""otel_rollouts: every episode of a language-model RL run as an OpenTelemetry trace.

    import otel_rollouts as otr

    otr.configure(service_name="grpo", sampler=otr.TailSampler(max_traces_per_step=32))
    with otr.episode(step=0, group_id="p0", sample_index=0) as ep:
        ep.prompt([{"role": "user", "content": "2+2?"}])
        with ep.turn() as turn:
            turn.record_generation("4", model="policy")
        ep.reward(1.0)
    otr.end_step(0)
    otr.shutdown()

The sampling names at the root (``otr.TailSampler``, ``otr.Policy``, ``otr.Bucket``, ``otr.Errors``,
``otr.Groups``, ...) are the objects of ``otel_rollouts.sampling`` (``otr.sampling``), their
canonical home, which also holds ``Candidate``, ``Decision``, ``BasePolicy`` and ``make_policy``:
import from there in a library, use the root in a script. The exporters and their optional extras
(``MetricsSink``, ``GroupsSink``, ``NotStoredReporter``, ``PendingViewer``) are in ``otel_rollouts.exporters``.
"""

# From a source checkout the exporters live beside this folder (installs map them inside): map them
# the same way before any module below imports them.
from otel_rollouts._core.layout import map_exporters as _map_exporters

_map_exporters(__path__[0])

# Before anything imports the OpenTelemetry SDK: it reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT & co at
# import and raises on an invalid value. check_environment() warns once about such a value and
# removes it, so that `import otel_rollouts` never fails on the environment (it never raises).
from otel_rollouts._core.settings import check_environment as _check_environment  # noqa: E402

_check_environment()

from otel_rollouts import conventions, sampling  # noqa: E402
from otel_rollouts._core.guard import InvalidValue  # noqa: E402
from otel_rollouts._core.logprobs import MismatchOptions  # noqa: E402
from otel_rollouts._rollouts import (  # noqa: E402
    Rollouts,
    configure,
    describe_run,
    end_step,
    flush,
    gateway,
    set_step,
    shutdown,
    stats,
    tracer_provider,
)
from otel_rollouts._rollouts import version as _version  # noqa: E402
from otel_rollouts.correlate.baggage import copy_baggage_to_logs, copy_baggage_to_spans  # noqa: E402
from otel_rollouts.correlate.gateway import GatewayOptions, SpanGateway  # noqa: E402
from otel_rollouts.correlate.logs import instrument_logging, uninstrument_logging  # noqa: E402
from otel_rollouts.correlate.propagation import (  # noqa: E402
    extract_context,
    httpx_event_hooks,
    inject_headers,
    instrument_requests_session,
    openai_extra_headers,
)
from otel_rollouts.correlate.ray_calls import ray_actor, ray_remote  # noqa: E402
from otel_rollouts.correlate.workers import (  # noqa: E402
    WorkerResult,
    adopt,
    context_carrier,
    submit,
    with_context,
)
from otel_rollouts.decode.batch import TokenBatchSummary, record_token_batch  # noqa: E402
from otel_rollouts.delivery.dataset import DatasetResult, build_dataset  # noqa: E402
from otel_rollouts.delivery.layers import CountingExporter, DeliveryCounts, SplittingExporter  # noqa: E402
from otel_rollouts.delivery.sender import SpoolingSender  # noqa: E402
from otel_rollouts.exporters.dataset import Filters as DatasetFilters  # noqa: E402
from otel_rollouts.record.batch import BatchSummary, record_batch  # noqa: E402
from otel_rollouts.record.episode import (  # noqa: E402
    Episode,
    Generation,
    ToolCall,
    Turn,
    current_episode,
    current_generation,
    episode,
    prompt_hash,
    trace_id_for,
)
from otel_rollouts.record.traced import traced  # noqa: E402
from otel_rollouts.sampling import (  # noqa: E402
    Bucket,
    Compose,
    DegenerateGroups,
    Errors,
    First,
    Groups,
    Mismatch,
    Policy,
    Slowest,
    TailSampler,
    TopBottom,
    Uniform,
)
from otel_rollouts.sampling.hung import HangOptions  # noqa: E402
from otel_rollouts.sampling.ray_budget import RayBudget  # noqa: E402

__version__ = _version()

__all__ = [
    "BatchSummary",
    "Bucket",
    "Compose",
    "CountingExporter",
    "DatasetFilters",
    "DatasetResult",
    "DegenerateGroups",
    "DeliveryCounts",
    "Episode",
    "Errors",
    "First",
    "GatewayOptions",
    "Generation",
    "Groups",
    "HangOptions",
    "InvalidValue",
    "Mismatch",
    "MismatchOptions",
    "Policy",
    "RayBudget",
    "Rollouts",
    "Slowest",
    "SpanGateway",
    "SplittingExporter",
    "SpoolingSender",
    "TailSampler",
    "TokenBatchSummary",
    "ToolCall",
    "TopBottom",
    "Turn",
    "Uniform",
    "WorkerResult",
    "__version__",
    "adopt",
    "build_dataset",
    "configure",
    "context_carrier",
    "conventions",
    "copy_baggage_to_logs",
    "copy_baggage_to_spans",
    "current_episode",
    "current_generation",
    "describe_run",
    "end_step",
    "episode",
    "extract_context",
    "flush",
    "gateway",
    "httpx_event_hooks",
    "inject_headers",
    "instrument_logging",
    "instrument_requests_session",
    "openai_extra_headers",
    "prompt_hash",
    "ray_actor",
    "ray_remote",
    "record_batch",
    "record_token_batch",
    "sampling",
    "set_step",
    "shutdown",
    "stats",
    "submit",
    "trace_id_for",
    "traced",
    "tracer_provider",
    "uninstrument_logging",
    "with_context",
]
