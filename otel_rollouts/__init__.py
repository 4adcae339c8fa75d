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
"""

# Before anything imports the OpenTelemetry SDK: it reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT & co at
# import and raises on an invalid value. check_environment() warns once about such a value and
# removes it, so that `import otel_rollouts` never fails on the environment (it never raises).
from otel_rollouts._core.settings import check_environment as _check_environment

_check_environment()

from otel_rollouts import conventions  # noqa: E402
from otel_rollouts._core.guard import InvalidValue  # noqa: E402
from otel_rollouts._core.logprobs import MismatchOptions  # noqa: E402
from otel_rollouts._rollouts import (  # noqa: E402
    Rollouts,
    configure,
    end_step,
    flush,
    gateway,
    set_step,
    shutdown,
    stats,
    tracer_provider,
    version,
)
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
from otel_rollouts.sampling.hung import HangOptions  # noqa: E402
from otel_rollouts.sampling.policies import (  # noqa: E402
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
from otel_rollouts.sampling.ray_budget import RayBudget  # noqa: E402

__version__ = version()

__all__ = [
    "__version__",
    "Rollouts",
    "tracer_provider",
    "adopt",
    "context_carrier",
    "copy_baggage_to_logs",
    "copy_baggage_to_spans",
    "extract_context",
    "httpx_event_hooks",
    "inject_headers",
    "instrument_logging",
    "instrument_requests_session",
    "openai_extra_headers",
    "ray_actor",
    "ray_remote",
    "submit",
    "uninstrument_logging",
    "with_context",
    "WorkerResult",
    "Compose",
    "DegenerateGroups",
    "HangOptions",
    "Mismatch",
    "MismatchOptions",
    "Slowest",
    "prompt_hash",
    "CountingExporter",
    "DatasetFilters",
    "DatasetResult",
    "build_dataset",
    "DeliveryCounts",
    "SplittingExporter",
    "SpoolingSender",
    "configure",
    "conventions",
    "current_episode",
    "current_generation",
    "trace_id_for",
    "Bucket",
    "end_step",
    "episode",
    "Episode",
    "Errors",
    "First",
    "flush",
    "gateway",
    "GatewayOptions",
    "Generation",
    "Groups",
    "SpanGateway",
    "InvalidValue",
    "Policy",
    "RayBudget",
    "record_token_batch",
    "record_batch",
    "set_step",
    "shutdown",
    "stats",
    "TailSampler",
    "TokenBatchSummary",
    "BatchSummary",
    "ToolCall",
    "TopBottom",
    "traced",
    "Turn",
    "Uniform",
]
