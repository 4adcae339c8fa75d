"""The one OpenTelemetry ``Resource`` of a run: the same on its traces, metrics and logs.

It says who produced the telemetry, so a user can join an episode trace (Jaeger, Phoenix,
Trackio metadata), the run's metrics (Prometheus labels) and its log records:

* ``service.name`` — the job (``configure(service_name=...)``, else ``OTEL_SERVICE_NAME``,
  else ``otel-rollouts``);
* ``service.instance.id`` — this process: ``{host}-{pid}``;
* ``rl.run.id`` — the training run, shared by every rank and worker;
* ``host.name``, ``host.arch``, ``process.pid``, ``process.runtime.name/version``;
* ``rl.rank``, ``rl.local_rank``, ``rl.world_size`` — from ``torch.distributed`` when it is
  initialised, else from the launcher's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``.

``OTEL_RESOURCE_ATTRIBUTES`` is honoured (explicit ``resource_attributes`` win over it).
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import (
    HOST_ARCH,
    HOST_NAME,
    PROCESS_PID,
    PROCESS_RUNTIME_NAME,
    PROCESS_RUNTIME_VERSION,
    Resource,
)
from opentelemetry.util.types import AttributeValue

from otel_rollouts import conventions as c

__all__ = ["rank_info", "run_resource"]

DEFAULT_SERVICE_NAME = "otel-rollouts"


def rank_info() -> dict[str, int]:
    """``rl.rank`` / ``rl.local_rank`` / ``rl.world_size`` of this process, as far as known.

    ``torch.distributed`` is asked only when something already imported it (no heavy import).
    """
    info: dict[str, int] = {}
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            info[c.RL_RANK] = int(dist.get_rank())
            info[c.RL_WORLD_SIZE] = int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a half-initialised process group: fall back to env
        info = {}
    for key, env in ((c.RL_RANK, "RANK"), (c.RL_LOCAL_RANK, "LOCAL_RANK"),
                     (c.RL_WORLD_SIZE, "WORLD_SIZE")):
        if key in info:
            continue
        value = os.environ.get(env, "").strip()
        if value.lstrip("-").isdigit():
            info[key] = int(value)
    return info


def run_resource(
    service_name: str | None = None,
    attributes: Mapping[str, Any] | None = None,  # the user's values: Resource.create drops invalid ones
    run_id: str | None = None,
) -> Resource:
    """The resource for this process of run ``run_id`` (see the module docstring)."""
    host = socket.gethostname()
    pid = os.getpid()
    attrs: dict[str, AttributeValue] = {
        c.SERVICE_INSTANCE_ID: f"{host}-{pid}",
        HOST_NAME: host,
        HOST_ARCH: platform.machine(),
        PROCESS_PID: pid,
        PROCESS_RUNTIME_NAME: sys.implementation.name,
        PROCESS_RUNTIME_VERSION: platform.python_version(),
    }
    attrs.update(rank_info())
    if run_id:
        attrs[c.RL_RUN_ID] = run_id
    if attributes:
        attrs.update(attributes)
    if service_name:
        attrs[c.SERVICE_NAME] = service_name
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME underneath `attrs`
    resource = Resource.create(attrs)
    if not service_name and not os.environ.get(c.ENV_SERVICE_NAME):
        name = resource.attributes.get(c.SERVICE_NAME)
        if not name or str(name).startswith("unknown_service"):
            resource = resource.merge(Resource({c.SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource
