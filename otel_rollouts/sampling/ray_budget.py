"""One per-step budget across Ray actors, agreed through a coordinator that is a Ray actor.

Each process that records episodes (rollout actors, the driver) configures
``TailSampler(distributed=otr.RayBudget(...))``. At ``otr.end_step(step)`` it sends the light
summaries of the candidates it holds (``distributed.summaries``: trace id, end time, the policy's
attributes) to the coordinator in one call; the coordinator runs the same merge as the
``torch.distributed`` path (``distributed.merge_all``) over every member's candidates of that
step and answers each member with the indices it keeps. So top-k, uniform and groups hold across
actors, and the job keeps at most the cap per (step, split).

The coordinator is one named, detached actor per budget (``lifetime="detached"``: owned by none
of the user's actors, so no actor's death takes it along; ``max_restarts=-1``: Ray restarts it).
It needs no CPU (``num_cpus=0``) and keeps the decisions of the last ``_REMEMBERED_STEPS`` steps.

Rules (README, "Running on Ray"):

* Who is waited for: ``members=N`` waits for N members per step; without it, every member that
  has sent a step before and was not absent from the last decided step. A step is decided when
  they all sent it or ``timeout_s`` after its first summary arrived, whichever comes first.
* A member that dies or is slow (misses the deadline) is left out of that decision and is not
  waited for again until it sends a step; its summaries of a step already decided are *late*:
  it keeps the best of them within what the step has left of the cap (so the cap holds).
* A member that never calls ``end_step`` for a step: its steps close by the lag or timeout
  rules, or at flush/shutdown, without agreement, where each member keeps at most
  ``cap // members`` (the member count last seen).
* The coordinator dead or unreachable: ``end_step`` waits at most ``timeout_s`` plus a margin,
  decides locally within ``cap // members`` (counted ``budget.local_fallback``) and looks the
  coordinator up again at the next step; a restarted coordinator has forgotten its state and
  rebuilds it from the summaries that come in (a step it sees partly is decided on what it saw,
  the rest is late).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections import OrderedDict
from typing import Any

from otel_rollouts._core import runtime as _runtime
from otel_rollouts.sampling import distributed
from otel_rollouts.sampling.policies import Policy

__all__ = ["BudgetCoordinator", "RayBudget"]

_REMEMBERED_STEPS = 256
_NAMESPACE = "otel_rollouts"
_MARGIN_S = 5.0  # beyond timeout_s: the call itself (a coordinator busy restarting)


class RayBudget:
    """``TailSampler(distributed=otr.RayBudget())``: one budget per (step, split) across every
    Ray actor and driver configured with the same ``name``.

    ``name``: the coordinator actor's name (default: one per Ray job). ``members``: how many
    members each step waits for (default: those seen; see the module's rules). ``timeout_s``:
    how long a step waits for its members after the first one sent it.
    """

    def __init__(self, name: str | None = None, *, members: int | None = None, timeout_s: float = 10.0) -> None:
        if members is not None and (isinstance(members, bool) or not isinstance(members, int) or members < 1):
            raise ValueError(f"RayBudget: members must be a positive int or None, got {members!r}")
        if not timeout_s > 0:
            raise ValueError(f"RayBudget: timeout_s must be > 0, got {timeout_s!r}")
        self.name = name
        self.members = members
        self.timeout_s = float(timeout_s)

    def coordinator(self) -> RayMember | None:
        """This process's side of the budget; None until Ray is initialised here."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return None
        return RayMember(self, ray)

    def __repr__(self) -> str:
        return f"RayBudget(name={self.name!r}, members={self.members}, timeout_s={self.timeout_s})"


class RayMember(distributed.Member):
    """A member of a ``RayBudget``: its summaries go to the coordinator actor in one call."""

    def __init__(self, budget: RayBudget, ray: Any) -> None:
        self.budget = budget
        self.ray = ray
        self.member_id = uuid.uuid4().hex
        self.members = budget.members or 1  # last count the coordinator told
        self.handle: Any = None
        self.name = budget.name or f"otel_rollouts-budget-{ray.get_runtime_context().get_job_id()}"

    def usable(self) -> bool:
        return bool(self.ray.is_initialized())

    def _coordinator(self) -> Any:
        if self.handle is None:
            actor = self.ray.remote(BudgetCoordinator).options(
                name=self.name,
                namespace=_NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=-1,
                num_cpus=0,
            )
            self.handle = actor.remote()
        return self.handle

    def exchange(
        self, policy: Policy, cap: int, payload: distributed.Payload, step: int
    ) -> dict[tuple[int, str], list[int]]:
        try:
            ref = self._coordinator().submit.remote(
                self.member_id, step, payload, policy, cap, self.budget.members, self.budget.timeout_s
            )
            reply = self.ray.get(ref, timeout=self.budget.timeout_s + _MARGIN_S)
        except Exception:
            self.handle = None  # looked up again next step (a restarted coordinator)
            _count("budget.local_fallback")
            raise
        self.members = max(int(reply["members"]), 1)
        if reply["late"]:
            _count("budget.late_steps")
        keep: dict[tuple[int, str], list[int]] = reply["keep"]
        return keep


def _count(name: str) -> None:
    rt = _runtime.installed()
    if rt is not None and rt.counters is not None:
        rt.counters.add(name)


class _Step:
    __slots__ = ("deadline", "payloads", "policy", "cap", "decided", "keep", "kept", "event")

    def __init__(self, deadline: float, policy: Policy, cap: int) -> None:
        self.deadline = deadline
        self.payloads: dict[str, distributed.Payload] = {}
        self.policy = policy
        self.cap = cap
        self.decided = False
        self.keep: dict[str, dict[tuple[int, str], list[int]]] = {}
        self.kept: dict[tuple[int, str], int] = {}  # per (step, split): how many were kept
        self.event = asyncio.Event()


class BudgetCoordinator:
    """The coordinator actor (async: members wait on one event loop, never on a thread each)."""

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.absent: set[str] = set()
        self.steps: OrderedDict[int, _Step] = OrderedDict()

    def _expected(self, wanted: int | None) -> int:
        return wanted if wanted is not None else max(len(self.members - self.absent), 1)

    async def submit(
        self,
        member: str,
        step: int,
        payload: distributed.Payload,
        policy: Policy,
        cap: int,
        wanted: int | None,
        timeout_s: float,
    ) -> dict[str, Any]:
        self.members.add(member)
        self.absent.discard(member)
        state = self.steps.get(step)
        if state is None:
            state = self.steps[step] = _Step(time.monotonic() + timeout_s, policy, cap)
            while len(self.steps) > _REMEMBERED_STEPS:
                self.steps.popitem(last=False)
        if state.decided:
            return self._late(state, member, payload)
        state.payloads[member] = payload
        if len(state.payloads) >= self._expected(wanted):
            self._decide(state)
        else:
            try:
                await asyncio.wait_for(state.event.wait(), max(state.deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                if not state.decided:
                    self.absent |= self.members - set(state.payloads)
                    self._decide(state)
        return {"keep": state.keep.get(member, {}), "members": self._expected(wanted), "late": False}

    def _decide(self, state: _Step) -> None:
        order = sorted(state.payloads)
        chosen = distributed.merge_all(state.policy, state.cap, [state.payloads[m] for m in order])
        for key, per_member in chosen.items():
            state.kept[key] = sum(len(k) for k in per_member)
            for m, indices in zip(order, per_member, strict=True):
                state.keep.setdefault(m, {})[key] = indices
        state.payloads.clear()  # decided: the summaries are not needed any more
        state.decided = True
        state.event.set()

    def _late(self, state: _Step, member: str, payload: distributed.Payload) -> dict[str, Any]:
        """A member's summaries for a step already decided: the best of them within what the
        step has left of the cap."""
        keep: dict[tuple[int, str], list[int]] = {}
        for key, rows in payload.items():
            left = state.cap - state.kept.get(key, 0)
            if left <= 0 or not rows:
                keep[key] = []
                continue
            (indices,) = distributed.merge_all(state.policy, left, [{key: rows}])[key]
            keep[key] = indices
            state.kept[key] = state.kept.get(key, 0) + len(indices)
        return {"keep": keep, "members": max(len(self.members - self.absent), 1), "late": True}

    def state(self) -> dict[str, Any]:
        """What the coordinator knows (for tests and debugging)."""
        return {"members": len(self.members), "absent": len(self.absent), "steps": list(self.steps)}
