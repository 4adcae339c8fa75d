"""Remote functions and actors the Ray tests call (importable by Ray's worker processes)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import otel_rollouts as otr
from otel_rollouts.sampling.ray_budget import BudgetCoordinator


@otr.traced(kind="span")
def measure(text: str) -> int:
    return len(text)


@otr.ray_remote
@otr.traced(kind="tool")
def score(text: str) -> dict:
    return {"length": measure(text)}


@otr.ray_remote(num_returns=2)
@otr.traced(kind="tool")
def split_words(text: str) -> tuple[str, str]:
    head, _, tail = text.partition(" ")
    return head, tail


@otr.ray_remote
@otr.traced(kind="tool")
def refuse(text: str) -> None:
    raise ValueError(f"refused {text}")


@otr.ray_remote
class SyncEnv:
    """A plain actor: one call at a time."""

    def __init__(self) -> None:
        self.steps = 0

    @otr.traced(kind="tool")
    def step(self, action: str) -> str:
        self.steps += 1
        return self._observe(action)  # a call between the actor's own methods stays plain

    def _observe(self, action: str) -> str:
        return f"obs:{action}:{measure(action)}"

    def pid(self) -> int:
        return os.getpid()


@otr.ray_remote(max_concurrency=8)
class ThreadedEnv:
    """A threaded actor: up to eight calls at once, each in its own thread."""

    def __init__(self) -> None:
        self.inside = 0
        self.most = 0
        self.lock = threading.Lock()
        self.together = threading.Barrier(4, timeout=30)

    @otr.traced(kind="tool")
    def step(self, action: str, wait_for_others: bool = False) -> str:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        if wait_for_others:
            self.together.wait()  # four calls in flight at once, for certain
        try:
            return f"{action}:{measure(action)}:{measure(action * 2)}"
        finally:
            with self.lock:
                self.inside -= 1

    def most_at_once(self) -> int:
        return self.most


@otr.ray_remote
class AsyncEnv:
    """An async actor: calls interleave on one event loop."""

    @otr.traced(kind="tool")
    async def step(self, action: str) -> str:
        await asyncio.sleep(0.001)
        return f"{action}:{measure(action)}"


@otr.ray_remote(max_concurrency=2)
class Stuck:
    """An actor whose call never finishes on its own (the test kills it)."""

    def __init__(self) -> None:
        self.started = threading.Event()

    @otr.traced(kind="tool")
    def hang(self, action: str) -> None:
        measure(action)
        self.started.set()
        threading.Event().wait()

    def wait_started(self) -> bool:
        return self.started.wait(60)


class Warnings(logging.Handler):
    """The library's log records in this process (``otel_rollouts`` logger), kept as text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("otel_rollouts").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@otr.ray_remote
class Unconfigured:
    """An actor that never calls ``configure()`` (its spans go back with each call); it keeps
    what the library logs in its process."""

    def __init__(self) -> None:
        self.log = Warnings()

    @otr.traced(kind="tool")
    def step(self, action: str) -> str:
        return f"{action}:{measure(action)}"

    def logged(self) -> list[str]:
        return self.log.lines


def record_logprobs(ep, e: dict) -> None:
    """A generation with the engine's and the trainer's logprobs, when the episode has them
    (what the mismatch part ranks by)."""
    if e.get("logprobs") is not None:
        with ep.turn() as turn:
            turn.record_generation("answer", logprobs=e["logprobs"], trainer_logprobs=e["trainer_logprobs"])


class Rollouts:
    """A rollout actor that runs whole episodes (the asynchronous-RL layout) under one budget
    shared with the other actors: made with ``ray.remote(Rollouts)`` (the user's own actor).
    ``run_id=None`` configures it without one (the unnamed run of the Ray job)."""

    def __init__(self, budget: str, members: int | None, policy: str, cap: int, timeout_s: float = 20.0,
                 run_id: str | None = "ray-budget") -> None:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.log = Warnings()
        self.exporter = InMemorySpanExporter()
        otr.configure(
            exporters=[self.exporter],
            sampler=otr.TailSampler(
                cap, policy, step_lag=None, distributed=otr.RayBudget(budget, members=members, timeout_s=timeout_s)
            ),
            run_id=run_id,
            # the same episode id gives the same trace id in every process (with a shared run_id)
            deterministic_ids=run_id is not None,
            handle_signals=False,
        )

    def run_step(self, step: int, episodes: list[dict]) -> None:
        for e in episodes:
            with otr.episode(step=step, group_id=e["group"], sample_index=e["index"], episode_id=e["id"]) as ep:
                if "seconds" in e:  # what a framework measured (the slowest part ranks by it)
                    ep.set_attribute(otr.conventions.RL_DURATION_SECONDS, e["seconds"])
                record_logprobs(ep, e)
                ep.reward(e["reward"])

    def end_step(self, step: int) -> dict:
        otr.end_step(step)
        assert otr.flush(30)
        return otr.stats()["totals"]

    def kept(self) -> list[str]:
        return sorted(f"{s.context.trace_id:032x}" for s in self.exporter.get_finished_spans() if s.name == "episode")

    def kept_rewards(self) -> list[float]:
        return [s.attributes[otr.conventions.RL_REWARD] for s in self.exporter.get_finished_spans() if s.name == "episode"]

    def kept_reasons(self) -> list[str]:
        return [s.attributes[otr.conventions.RL_KEEP_REASON] for s in self.exporter.get_finished_spans()
                if s.name == "episode"]

    def logged(self) -> list[str]:
        return self.log.lines

    def coordinator_state(self, name: str) -> dict | None:
        """The budget coordinator's state as this process reaches it now (None: it is dead).
        A call from this process also brings this process's view of the actor up to date
        (restarted at a new address, or dead) before its own ``end_step`` uses it."""
        import ray

        try:
            return ray.get(ray.get_actor(name, namespace="otel_rollouts").state.remote(), timeout=120)
        except (ValueError, ray.exceptions.RayActorError):
            return None

    def shutdown(self) -> None:
        otr.shutdown(timeout=10)

    def pid(self) -> int:
        return os.getpid()


class AsyncRollouts(Rollouts):
    """``Rollouts`` as an async actor: its methods run on the actor's event loop."""

    async def run_step(self, step: int, episodes: list[dict]) -> None:  # type: ignore[override]
        Rollouts.run_step(self, step, episodes)

    async def end_step(self, step: int) -> dict:  # type: ignore[override]
        return Rollouts.end_step(self, step)

    async def kept(self) -> list[str]:  # type: ignore[override]
        return Rollouts.kept(self)


class GatewayRollouts:
    """A rollout actor of the asynchronous-RL layout: it runs whole episodes whose generations
    are requests to an inference server shared by every actor, and exports what it keeps over
    OTLP. Every actor asks for the same gateway ports, so the node's actors share one gateway.
    Made with ``ray.remote(GatewayRollouts)``."""

    def __init__(self, sink_endpoint: str, logs_endpoint: str, http_port: int, grpc_port: int, cap: int) -> None:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

        otr.configure(
            service_name="rollout-actor",
            exporters=[OTLPSpanExporter(endpoint=sink_endpoint)],
            sampler=otr.TailSampler(cap, "top_bottom", distributed=False),
            # the renderer waits up to 30 s (default 5) for a kept episode's server spans: the
            # gateway runs at nice 10, and on a loaded machine a shorter wait renders an episode
            # before its server span is pulled (it then goes out on its own, as designed, without
            # lending its timings to the generation, which this test checks)
            gateway=otr.GatewayOptions(http_port=http_port, grpc_port=grpc_port, pull_timeout_s=30.0,
                                       log_exporter=OTLPLogExporter(endpoint=logs_endpoint)),
            handle_signals=False,
        )
        # the stock instrumentation, as the docs recommend: requests outside episodes get a
        # client span too
        self.instrumentor = HTTPXClientInstrumentor()
        self.instrumentor.instrument(tracer_provider=otr.tracer_provider())

    def gateway_pid(self) -> int | None:
        gateway = otr.gateway()
        return gateway.pid if gateway is not None else None

    def run_step(self, step: int, server_url: str, rewards: list[float]) -> list[str]:
        """One step's episodes, each one generation served by the shared server; their trace ids."""
        import httpx

        ids = []
        with httpx.Client(base_url=server_url) as client:
            for i, reward in enumerate(rewards):
                with otr.episode(step=step, group_id=f"g{step}", sample_index=i) as ep:
                    ids.append(ep.trace_id)
                    with ep.turn() as turn, turn.generation("policy") as gen:
                        body = {"model": "policy", "max_tokens": 10 * (i + 1),
                                "messages": [{"role": "user", "content": f"question {i}"}]}
                        gen.output(client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])
                    ep.reward(reward)
        return ids

    def outside(self, server_url: str) -> str:
        """A request made outside any episode (an eval): the trace id of its client span."""
        import httpx
        from opentelemetry import trace

        tracer = otr.tracer_provider().get_tracer("eval")
        with tracer.start_as_current_span("eval") as span, httpx.Client(base_url=server_url) as client:
            body = {"model": "policy", "max_tokens": 5, "messages": [{"role": "user", "content": "eval"}]}
            client.post("/v1/chat/completions", json=body).raise_for_status()
            return f"{span.get_span_context().trace_id:032x}" if span is not trace.INVALID_SPAN else ""

    def finish(self, step: int) -> dict:
        otr.end_step(step)
        assert otr.flush(30)
        self.instrumentor.uninstrument()
        otr.shutdown()
        return otr.stats()["totals"]


# --- log records made in Ray calls (they travel back to the caller's episode) ----------------------
TASK_LOGGER = "otr-ray-task"
_task_logs: list = []  # this worker process's log exporter, once made


def log_here():
    """This worker process's log records exported through otel_rollouts, set up once per process
    (what a user does in an actor's ``__init__`` or a task): an in-memory exporter, kept so a test
    can check that none of the records made in an episode is exported from the worker."""
    if not _task_logs:
        from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

        _task_logs.append(InMemoryLogRecordExporter())
        logging.getLogger(TASK_LOGGER).setLevel(logging.INFO)
        otr.instrument_logging(TASK_LOGGER, exporter=_task_logs[0])
    return _task_logs[0]


@otr.ray_remote
@otr.traced(kind="tool")
def log_and_score(text: str) -> int:
    log_here()
    logging.getLogger(TASK_LOGGER).info("ray call scored %s", text)
    return measure(text)


@otr.ray_remote
@otr.traced(kind="tool")
def log_and_refuse(text: str) -> None:
    log_here()
    logging.getLogger(TASK_LOGGER).warning("ray call refused %s", text)
    raise ValueError(f"refused {text}")


@otr.ray_remote(max_concurrency=4)
class LoggingEnv:
    """A threaded actor whose calls log (its process's records exported through otel_rollouts)."""

    def __init__(self) -> None:
        log_here()

    @otr.traced(kind="tool")
    def step(self, action: str) -> str:
        logging.getLogger(TASK_LOGGER).info("ray call env step %s", action)
        return f"obs:{action}"

    def exported(self) -> list[str]:
        """The bodies this process's own exporter sent (none of an episode's)."""
        from otel_rollouts.correlate.logs import active_processor

        processor = active_processor()
        assert processor is not None and processor.force_flush(10_000)
        return [str(r.log_record.body) for r in log_here().get_finished_logs()]



class SlowStartingCoordinator(BudgetCoordinator):
    """``RayBudget``'s coordinator whose start takes ``seconds`` (made by a test under the
    budget's name before any member): a worker process starting on a loaded machine, made
    certain here. The delay is the condition under test, not a synchronisation."""

    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)
        super().__init__()
