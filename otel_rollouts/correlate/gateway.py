"""The span gateway: OTLP in from other processes; their spans and logs share their episode's fate.

An inference server (vLLM, SGLang, any OpenTelemetry-instrumented service) exports its spans
itself, long before the tail sampler has decided on the episode that made the request. Pointed
at the gateway instead of a collector, its spans and log records join their episode by trace id:

* the episode is still undecided: they are held with it, and leave with it if it is kept, in the
  episode's own tree (a server span under a generation span also lends it the engine's
  ``gen_ai.latency.*`` timings, as ``rl.server.*``);
* the episode was kept: they go out at once (late spans of a kept episode), as do its log records;
* the episode was dropped: they are dropped, counted (``dropped.gateway_spans``,
  ``dropped.episode_logs``): no orphan fragment reaches the collector;
* a request made outside any episode (no parent, or a client span this process saw start outside
  any episode: an eval, a health check, a weight sync) passes through to the exporters;
* a span or record of a trace no recording process has announced is held up to ``hold_s``
  (bounded in bytes) in case its episode appears, then let go: dropped and counted
  ``dropped.gateway_unknown.*`` (or exported, with ``unknown="export"``).

**The training process owns no socket and parses no network input.** The gateway is a process of
its own (``gateway_node``), one per node and set of ports, shared by every recording process there
that asks for the same ports (Ray rollout actors, forked workers, ranks): they tell it over a local
channel (``delivery.gateway_channel``) which traces are episodes and what was decided, and the
renderer pulls the spans of each kept episode, parsed and re-encoded by the gateway. The training
thread only appends trace ids to a bounded queue. Beyond one node, the Collector recipe in
``docker/`` does the same job at cluster scale.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from otel_rollouts._core.content import exception_text
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.gateway_channel import Channel, gateway_dir

__all__ = ["GatewayOptions", "SpanGateway"]

logger = logging.getLogger("otel_rollouts")

_READY_TIMEOUT_S = 20.0  # how long the ports may take to be known (a new interpreter starting)


@dataclass(frozen=True)
class GatewayOptions:
    """Where the gateway listens, how long it holds what it cannot place yet, and what a
    neighbour may cost it.

    Ports: ``None`` turns that protocol off, ``0`` picks a free port (read it back from
    ``SpanGateway.http_endpoint`` / ``grpc_endpoint``; such a gateway is this process's alone).
    The defaults are OTLP's own ports, so a server exporting to ``localhost`` with no endpoint set
    reaches the gateway; every process of a node asking for the same fixed ports shares one
    gateway. ``hold_s`` / ``max_held_bytes``: how long what belongs to no known trace is held, and
    how many bytes everything held may take (counted at what it costs in memory); ``unknown``:
    what then happens to it. ``max_connections``, ``header_timeout_s``, ``body_timeout_s``,
    ``max_request_bytes``: the receivers' limits (``gateway_serve``). Received log records of kept
    episodes (and of no episode) go to ``log_exporter``, else to the OTLP log exporter the
    environment names (``OTEL_LOGS_EXPORTER=otlp`` or an OTLP endpoint set), else nowhere
    (counted); it must be one the gateway process can rebuild (the SDK's OTLP log exporters).
    """

    host: str = "127.0.0.1"
    http_port: int | None = 4318
    grpc_port: int | None = 4317
    hold_s: float = 30.0
    max_held_bytes: int = 64 * 1024 * 1024
    max_request_bytes: int = 16 * 1024 * 1024
    unknown: Literal["drop", "export"] = "drop"
    log_exporter: Any = None  # an SDK log exporter for received records (default: OTLP per env)
    max_connections: int = 1024
    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    linger_s: float = 5.0  # how long the gateway outlives its last client
    pull_timeout_s: float = 5.0  # how long a renderer waits for a kept episode's server spans

    def __post_init__(self) -> None:
        if self.unknown not in ("drop", "export"):
            raise ValueError(f"GatewayOptions.unknown must be 'drop' or 'export', got {self.unknown!r}")
        for name in ("hold_s", "max_held_bytes", "max_request_bytes", "max_connections",
                     "header_timeout_s", "body_timeout_s", "pull_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GatewayOptions.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if port is not None and not (isinstance(port, int) and 0 <= port < 65536):
                raise ValueError(f"GatewayOptions.{name} must be a port number or None, got {port!r}")


class SpanGateway:
    """This process's handle on the node's span gateway (``otr.gateway()``)."""

    def __init__(self, options: GatewayOptions, stats: Stats, *, run_id: str | None = None,
                 span_recipes: Sequence[Any] = (), log_recipe: Any = None) -> None:
        self.options = options
        self.stats = stats
        self.run_id = run_id
        self._span_recipes = list(span_recipes)
        self._log_recipe = log_recipe
        o = options
        # free ports: a gateway of this process's own, which goes when it leaves
        self.private = (o.http_port == 0 or o.grpc_port == 0) or (o.http_port is None and o.grpc_port is None)
        if self.private:
            name = f"gw-{os.getpid()}-{secrets.token_hex(6)}"
        else:
            name = f"gw-{o.host.replace(':', '_')}-{o.http_port}-{o.grpc_port}"
        self.address = str(gateway_dir() / name)
        self.channel = Channel(self.address, stats, role="recorder", run_id=run_id)
        self._process: subprocess.Popen[bytes] | None = None
        self._gave_up = threading.Event()  # no gateway will answer
        self._reported = threading.Event()  # what the gateway this process started could not bind: said

    # --- where to point a server ---------------------------------------------------------------
    @property
    def http_port(self) -> int | None:
        return self._ports().get("http_port")

    @property
    def grpc_port(self) -> int | None:
        return self._ports().get("grpc_port")

    @property
    def pid(self) -> int | None:
        """The gateway process's pid (its RSS is where what it holds is)."""
        return self._ports().get("pid")

    @property
    def http_endpoint(self) -> str | None:
        """``http://host:port`` for ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``http/protobuf``
        (or ``http/json``): the paths ``/v1/traces`` and ``/v1/logs`` are served."""
        port = self.http_port
        return None if port is None else f"http://{_host(self.options.host)}:{port}"

    @property
    def grpc_endpoint(self) -> str | None:
        """``http://host:port`` for a gRPC OTLP exporter (vLLM's ``--otlp-traces-endpoint``)."""
        port = self.grpc_port
        return None if port is None else f"http://{_host(self.options.host)}:{port}"

    def _ports(self) -> dict[str, Any]:
        """The gateway's welcome (pid and ports), once it answers: {} when it never will (the
        gateway this process started bound nothing, and no other one answered)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            welcome = self.channel.wait_welcome(0.05)
            if welcome is not None:
                if self._process is not None:  # its warnings (a port it could not bind) first
                    self._reported.wait(max(deadline - time.monotonic(), 0.0))
                return welcome
            if self._gave_up.is_set():
                return {}
        return {}

    # --- life ----------------------------------------------------------------------------------
    def start(self) -> SpanGateway:
        """Join the node's gateway on these ports, starting it if there is none. Never blocks on
        the gateway: the ports are known once it answers (``http_port`` waits for that)."""
        self.channel.start()
        if self.channel.wait_welcome(0.3) is None:
            self._spawn()
        return self

    def _spawn(self) -> None:
        o = self.options
        config = {
            "address": self.address, "private": self.private, "host": o.host, "http_port": o.http_port,
            "grpc_port": o.grpc_port,
            "hold_s": o.hold_s, "max_held_bytes": o.max_held_bytes, "unknown": o.unknown,
            "linger_s": 0.0 if self.private else o.linger_s, "span_recipes": self._span_recipes, "log_recipe": self._log_recipe,
            "limits": {"max_request_bytes": o.max_request_bytes, "max_connections": o.max_connections,
                       "header_timeout_s": o.header_timeout_s, "body_timeout_s": o.body_timeout_s},
        }
        try:
            code = ("import sys; sys.path[:0] = " + repr([p for p in sys.path if p]) +
                    "; from otel_rollouts.correlate.gateway_node import main; main()")
            process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
            assert process.stdin is not None
            process.stdin.write(pickle.dumps(config))
            process.stdin.close()
        except Exception as exc:  # noqa: BLE001 - no gateway: reported, training goes on
            self.stats.add("errors.gateway_start")
            logger.warning("otel_rollouts: the span gateway could not start: %s", exception_text(exc))
            self._gave_up.set()
            self._reported.set()
            return
        self._process = process
        threading.Thread(target=self._read_answer, args=(process,), name="otel-rollouts-gateway-start",
                         daemon=True).start()

    def _read_answer(self, process: subprocess.Popen[bytes]) -> None:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            answer = json.loads(line) if line else {"errors": ["the gateway process exited"]}
        except Exception as exc:  # noqa: BLE001
            answer = {"errors": [exception_text(exc)]}
        try:
            served = answer.get("http_port") or answer.get("grpc_port")
            if not served and self.channel.wait_welcome(2.0) is not None:
                return  # another process's gateway has these ports: this one joined it
            for error in answer.get("errors") or ():
                self.stats.add("errors.gateway_bind")
                logger.warning("otel_rollouts: span gateway could not listen on %s", error)
            if not served:
                self._gave_up.set()
        finally:
            self._reported.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Leave the gateway: what was decided is sent, its counts received; the gateway exits
        once its last client has left (after ``linger_s``; at once, ports freed before this
        returns, for a gateway of this process's own)."""
        deadline = time.monotonic() + timeout
        self.channel.close(timeout)
        process = self._process
        if process is None:
            return
        if process.stdout is not None:
            try:
                process.stdout.close()
            except OSError:
                pass
        if self.private:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                self.stats.add("errors.gateway_stop")

    # --- what the pipeline and the renderer call -------------------------------------------------
    def opened(self, trace_id: int) -> None:
        self.channel.opened(trace_id)

    def decided(self, trace_id: int, kept: bool) -> None:
        self.channel.decided(trace_id, kept)

    def outside(self, trace_id: int) -> None:
        self.channel.outside(trace_id)

def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
