"""One per-step budget across Ray actors, agreed through a coordinator that is a Ray actor.

Each process that records episodes (rollout actors, the driver) configures
``TailSampler(distributed=otr.RayBudget(...))``. At ``otr.end_step(step)`` it sends the light
summaries of the candidates it holds (``distributed.summaries``: trace id, end time, the policy's
attributes) to the coordinator in one call; the coordinator runs the same merge as the
``torch.distributed`` path (``distributed.merge_all``) over every member's candidates of that
step and answers each member with the indices it keeps. So top-k, uniform and groups hold across
actors, and the job keeps at most the cap per (step, split).

The coordinator is one named, detached actor per budget (``lifetime="detached"``: owned by none
of the user's actors, so no actor's death takes it along; ``max_restarts=-1``: Ray restarts it),
named ``RayBudget.actor_name()`` in the Ray namespace ``"otel_rollouts"`` (``ray.get_actor``).
It needs no CPU (``num_cpus=0``) and keeps the decisions of the last ``_REMEMBERED_STEPS`` steps
of each of the last ``_REMEMBERED_RUNS`` runs.

Budgets are per *run*, never shared by two runs of one Ray job (a second run whose steps restart
at 0 must not find them spent by the first): the coordinator keys its steps by (run, step).

* A member configured with ``configure(run_id=...)`` belongs to that run: give every member of a
  run the same ``run_id`` (as ``rl.run.id`` joins their traces) and each run its own. Exact.
* A member configured without ``run_id`` belongs to the job's *unnamed* run. A member that was
  never seen before and whose first step was already decided in the unnamed run and is older
  than the newest step decided there is taken for the first member of a new run (steps restarting
  at 0 after the earlier run ended): it starts a new unnamed run, which every member seen after it
  joins; members already seen stay in theirs. With ``members=N``, a newcomer while the run has
  seen fewer than N members is one of them (late), never a new run. (Without it, a member of the
  same run that starts more than a step behind the others is taken for a new run too: pass
  ``run_id``, or ``members``, where that can happen.)

Rules (README, "Running on Ray"):

* Who is waited for: ``members=N`` waits for N members per step; without it, every member that
  has sent a step before and was not absent from the last decided step. A step is decided when
  they all sent it or ``timeout_s`` after its first summary arrived, whichever comes first.
  Without ``members``, a run's first step is decided at its deadline only (once per run): no
  member count is known before members send (rollout actors start seconds apart), so every
  member whose summary arrives within ``timeout_s`` of the first is in that decision: exact for
  members that start within ``timeout_s`` of each other.
* A member that dies or is slow (misses the deadline) is left out of that decision and is not
  waited for again until it sends a step; its summaries of a step already decided are *late*:
  it keeps the best of them within what the step has left of the cap (so the cap holds).
* A member that never calls ``end_step`` for a step: its steps close by the lag or timeout
  rules, or at flush/shutdown, without agreement, where each member keeps at most
  ``cap // members`` (the member count last seen).
* The coordinator's start (a worker process) is waited for apart from a step (at most
  ``max(_STARTUP_S, timeout_s)``), at the first step and after the coordinator was lost: a
  member's wait for the step's answer never counts it (else members on time give up on a
  coordinator still starting, decide alone and leave their summaries to a decision that no
  longer applies to them).
* The coordinator dead or unreachable: ``end_step`` waits ``timeout_s`` plus a margin for its
  answer, then once more as long if the coordinator answers a ping (alive: the call was queued),
  else decides locally within ``cap // members`` (counted ``budget.local_fallback``) and looks the
  coordinator up again at the next step; a restarted coordinator has forgotten its state and
  rebuilds it from the summaries that come in (a step it sees partly is decided on what it saw,
  the rest is late).
* A member whose summaries arrive late and find the step's cap spent (or partly spent) logs a
  warning, at most once per ``_WARN_INTERVAL_S`` per member (with how many more it held back),
  on top of the counter ``budget.late_steps``; the counter ``budget.spent`` counts late steps
  that kept nothing. A member that gets no answer and decides alone warns the same way.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from otel_rollouts._core import runtime as _runtime
from otel_rollouts.sampling import distributed
from otel_rollouts.sampling.policy import Policy

__all__ = ["BudgetCoordinator", "RayBudget"]

logger = logging.getLogger("otel_rollouts")

_REMEMBERED_STEPS = 256
_REMEMBERED_RUNS = 64
_REMEMBERED_MEMBERS = 65_536  # which unnamed run a member is in (bounded: members are uuids)
_WARN_INTERVAL_S = 60.0
_UNNAMED = "unnamed:"
_NAMESPACE = "otel_rollouts"
_MARGIN_S = 5.0  # beyond timeout_s: the call itself (a coordinator busy restarting)
_STARTUP_S = 60.0  # the coordinator's start (a worker process), waited for apart from a step's wait


class RayBudget:
    """``TailSampler(distributed=otr.RayBudget())``: one budget per (step, split) across every
    Ray actor and driver configured with the same ``name``.

    Budgets are per run (the coordinator keys its steps by run and step; see the module's
    rules): two runs of one Ray job never share one, so give every member of a run the same
    ``configure(run_id=...)``. ``name``: the coordinator actor's name (default: one per Ray
    job; ``actor_name()``). ``members``: how many members each step waits for (default: those
    seen, a run's first step waiting its whole ``timeout_s`` for them; see the module's rules).
    ``timeout_s``: how long a step waits for its members after the first one sent it.
    """

    def __init__(self, name: str | None = None, *, members: int | None = None, timeout_s: float = 10.0) -> None:
        if members is not None and (isinstance(members, bool) or not isinstance(members, int) or members < 1):
            raise ValueError(f"RayBudget: members must be a positive int or None, got {members!r}")
        if not timeout_s > 0:
            raise ValueError(f"RayBudget: timeout_s must be > 0, got {timeout_s!r}")
        self.name = name
        self.members = members
        self.timeout_s = float(timeout_s)

    #: the Ray namespace of every budget's coordinator actor
    namespace = _NAMESPACE

    def actor_name(self) -> str:
        """The coordinator actor's name in the current Ray job: ``name`` if given, else
        ``otel_rollouts-budget-<Ray job id>``. It lives in the Ray namespace ``"otel_rollouts"``
        (``RayBudget.namespace``), so operations reach it from any process of the job with
        ``ray.get_actor(budget.actor_name(), namespace="otel_rollouts")``. Needs Ray initialised."""
        if self.name is not None:
            return self.name
        import ray

        return f"otel_rollouts-budget-{ray.get_runtime_context().get_job_id()}"

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

    def __init__(self, budget: RayBudget, ray: Any) -> None:  # the ray module
        self.budget = budget
        self.ray = ray
        self.member_id = uuid.uuid4().hex
        self.members = budget.members or 1  # last count the coordinator told
        self.handle: Any = None
        self.name = budget.actor_name()
        self.warn_lock = threading.Lock()
        # per kind of warning: when it was last logged, and how many were not logged since
        self.warned: dict[str, tuple[float, int]] = {}

    def usable(self) -> bool:
        return bool(self.ray.is_initialized())

    def _coordinator(self) -> Any:
        """The coordinator's handle, made (or found) and *started* at the first step or after
        the coordinator was lost: its start (a new worker process, seconds on a loaded machine)
        is waited for here, at most ``max(_STARTUP_S, timeout_s)``, so that it never eats into
        the step's own wait for its answer (``_answer``)."""
        if self.handle is None:
            actor = self.ray.remote(BudgetCoordinator).options(
                name=self.name,
                namespace=_NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=-1,
                num_cpus=0,
            )
            handle = actor.remote()
            self.ray.get(handle.__ray_ready__.remote(), timeout=max(_STARTUP_S, self.budget.timeout_s))
            self.handle = handle
        return self.handle

    def _answer(self, handle: Any, ref: Any) -> dict[str, Any]:
        """The coordinator's reply to a submit. The coordinator answers at most ``timeout_s``
        after the step's first summary *reached it*, but this member's clock started when it
        sent: a call queued meanwhile (a busy or restarting coordinator) may outlast
        ``timeout_s + _MARGIN_S`` here with the answer on its way. So at that point the
        coordinator is asked whether it is alive (one ``_MARGIN_S`` ping); if it is, its answer
        is waited for once more (``timeout_s + _MARGIN_S``); if not, the timeout stands (local
        fallback)."""
        ray, wait = self.ray, self.budget.timeout_s + _MARGIN_S
        try:
            return dict(ray.get(ref, timeout=wait))
        except ray.exceptions.GetTimeoutError:
            ray.get(handle.__ray_ready__.remote(), timeout=_MARGIN_S)  # raises: dead or hung
            return dict(ray.get(ref, timeout=wait))

    def exchange(
        self, policy: Policy, cap: int, payload: distributed.Payload, step: int
    ) -> dict[tuple[int, str], distributed.Kept]:
        try:
            handle = self._coordinator()
            ref = handle.submit.remote(
                self.member_id, step, payload, policy, cap, self.budget.members, self.budget.timeout_s, _run_id()
            )
            reply = self._answer(handle, ref)
        except Exception as exc:
            self.handle = None  # looked up again next step (a restarted coordinator)
            _count("budget.local_fallback")
            self._warn(
                "fallback", "otel_rollouts: RayBudget %r: no answer from the coordinator for step %s (%s);"
                " this member decides it alone, within cap // members = %d (budget.local_fallback)%s",
                self.name, step, type(exc).__name__, self.local_share(cap),
            )
            raise
        self.members = max(int(reply["members"]), 1)
        keep: dict[tuple[int, str], distributed.Kept] = reply["keep"]
        if reply.get("new_run"):
            logger.info(
                "otel_rollouts: RayBudget %r: step %s starts a new run's budgets (configured without run_id;"
                " the steps of the run before it were already decided)", self.name, step,
            )
        if reply["late"]:
            _count("budget.late_steps")
            offered = sum(len(rows) for rows in payload.values())
            kept = sum(len(indices) for indices in keep.values())
            if offered and not kept:
                _count("budget.spent")
            if kept < offered:
                self._warn(
                    "late", "otel_rollouts: RayBudget %r: step %s was decided before this member's summaries"
                    " arrived; it kept %d of its %d candidates, what the step had left of the cap"
                    " (budget.late_steps, budget.spent). A member too slow for timeout_s=%s, or a second run"
                    " sharing the budget (give each run its own configure(run_id=...))%s",
                    self.name, step, kept, offered, self.budget.timeout_s,
                )
        return keep

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning of ``kind`` at most once per ``_WARN_INTERVAL_S``; the ones held back
        meanwhile are told in the next (``message`` ends with a ``%s`` for that). So a member
        whose steps lose episodes says so in its log, not only in a counter, without flooding it."""
        now = time.monotonic()
        with self.warn_lock:
            last = self.warned.get(kind)
            if last is not None and now - last[0] < _WARN_INTERVAL_S:
                self.warned[kind] = (last[0], last[1] + 1)
                return
            self.warned[kind] = (now, 0)
        more = last[1] if last is not None else 0
        logger.warning(message, *args, f"; {more} more since the last such warning" if more else "")


def _run_id() -> str | None:
    """The ``run_id`` the installed instance (the one closing the step) was configured with;
    None when it was not given."""
    rt = _runtime.installed()
    return rt.given_run_id if rt is not None else None


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
        self.keep: dict[str, dict[tuple[int, str], distributed.Kept]] = {}
        self.kept: dict[tuple[int, str], int] = {}  # per (step, split): how many were kept
        self.event = asyncio.Event()


class _Run:
    """One run's members and steps, as the coordinator knows them."""

    __slots__ = ("members", "absent", "steps", "newest")

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.absent: set[str] = set()
        self.steps: OrderedDict[int, _Step] = OrderedDict()
        self.newest: int | None = None  # the newest step decided

    def expected(self, wanted: int | None) -> int:
        """How many members a step waits for: ``members=N``, else those seen and not absent.
        Without ``members``, a run's first step (``newest is None``) is never complete before
        its deadline: who the run's members are is learnt then (see ``submit``)."""
        return wanted if wanted is not None else max(len(self.members - self.absent), 1)

    def restarts_at(self, step: int, wanted: int | None) -> bool:
        """Whether a member never seen before, sending ``step`` first, starts a new run: the
        step was decided already and is older than the newest one decided, and the run is not
        still short of the ``members=N`` it waits for (then the newcomer is one of them, late)."""
        if wanted is not None and len(self.members) < wanted:
            return False
        state = self.steps.get(step)
        return state is not None and state.decided and self.newest is not None and step < self.newest


class BudgetCoordinator:
    """The coordinator actor (async: members wait on one event loop, never on a thread each)."""

    def __init__(self) -> None:
        self.runs: OrderedDict[str, _Run] = OrderedDict()
        self.unnamed: OrderedDict[str, str] = OrderedDict()  # member → its unnamed run's key
        self.generation = 0  # the unnamed runs started so far, less one

    def _run_of(self, member: str, run: str | None, step: int, wanted: int | None) -> tuple[_Run, bool]:
        """The run ``member`` records for, and whether its ``step`` just started a new one."""
        new_run = False
        if run is not None:
            key = "run:" + run
        else:
            known = self.unnamed.get(member)
            if known is not None:
                key = known
                self.unnamed.move_to_end(member)
            else:
                key = f"{_UNNAMED}{self.generation}"
                current = self.runs.get(key)
                if current is not None and current.restarts_at(step, wanted):
                    self.generation += 1
                    key, new_run = f"{_UNNAMED}{self.generation}", True
                self.unnamed[member] = key
                while len(self.unnamed) > _REMEMBERED_MEMBERS:
                    self.unnamed.popitem(last=False)
        state = self.runs.get(key)
        if state is None:
            state = self.runs[key] = _Run()
            while len(self.runs) > _REMEMBERED_RUNS:
                self.runs.popitem(last=False)
        else:
            self.runs.move_to_end(key)
        return state, new_run

    async def submit(
        self,
        member: str,
        step: int,
        payload: distributed.Payload,
        policy: Policy,
        cap: int,
        wanted: int | None,
        timeout_s: float,
        run: str | None = None,
    ) -> dict[str, object]:
        """``member``'s summaries of ``step``; answers with the indices it keeps once the step
        is decided: when every member waited for sent it, or at its deadline (``timeout_s``
        after its first summary arrived), whichever comes first.

        Without ``members=N`` (``wanted`` None) a run's first step is decided at its deadline
        only: no member count is known before it (rollout actors start seconds apart, and the
        first to send would otherwise be taken for the whole run, its step decided over its own
        candidates alone), so every member that sends it within ``timeout_s`` is in its
        decision. Once per run; from then on the members seen are waited for."""
        runs, new_run = self._run_of(member, run, step, wanted)
        runs.members.add(member)
        runs.absent.discard(member)
        state = runs.steps.get(step)
        if state is None:
            state = runs.steps[step] = _Step(time.monotonic() + timeout_s, policy, cap)
            while len(runs.steps) > _REMEMBERED_STEPS:
                runs.steps.popitem(last=False)
        if state.decided:
            return {**self._late(runs, state, payload), "new_run": new_run}
        state.payloads[member] = payload
        if len(state.payloads) >= runs.expected(wanted) and (wanted is not None or runs.newest is not None):
            self._decide(runs, step, state)
        else:
            try:
                await asyncio.wait_for(state.event.wait(), max(state.deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                if not state.decided:
                    runs.absent |= runs.members - set(state.payloads)
                    self._decide(runs, step, state)
        return {"keep": state.keep.get(member, {}), "members": runs.expected(wanted), "late": False,
                "new_run": new_run}

    def _decide(self, runs: _Run, step: int, state: _Step) -> None:
        order = sorted(state.payloads)
        chosen = distributed.merge_all(state.policy, state.cap, [state.payloads[m] for m in order])
        for key, per_member in chosen.items():
            state.kept[key] = sum(len(k) for k in per_member)
            for m, indices in zip(order, per_member, strict=True):
                state.keep.setdefault(m, {})[key] = indices
        state.payloads.clear()  # decided: the summaries are not needed any more
        state.decided = True
        runs.newest = step if runs.newest is None else max(runs.newest, step)
        state.event.set()

    def _late(self, runs: _Run, state: _Step, payload: distributed.Payload) -> dict[str, object]:
        """A member's summaries for a step already decided: the best of them within what the
        step has left of the cap."""
        keep: dict[tuple[int, str], distributed.Kept] = {}
        for key, rows in payload.items():
            left = state.cap - state.kept.get(key, 0)
            if left <= 0 or not rows:
                keep[key] = []
                continue
            (indices,) = distributed.merge_all(state.policy, left, [{key: rows}])[key]
            keep[key] = indices
            state.kept[key] = state.kept.get(key, 0) + len(indices)
        return {"keep": keep, "members": runs.expected(None), "late": True}

    def state(self, run: str | None = None) -> dict[str, object]:
        """What the coordinator knows of ``run`` (a ``run_id``; None: the run that sent a step
        last), for tests and debugging."""
        if run is not None:
            runs = self.runs.get("run:" + run)
        else:
            runs = next(reversed(self.runs.values()), None)
        if runs is None:
            return {"members": 0, "absent": 0, "steps": [], "runs": len(self.runs)}
        return {"members": len(runs.members), "absent": len(runs.absent), "steps": list(runs.steps),
                "runs": len(self.runs)}
