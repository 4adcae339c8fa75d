"""A global per-step budget across ranks, agreed with ``torch.distributed`` collectives.

With several ranks each recording its own episodes, a per-process cap would export
``cap × world_size`` episodes per step and a per-rank top-k is not the job's top-k. At
``otr.end_step(step)`` every rank sends a light summary of the candidates its sampler still holds
(trace id, end time, the few attributes the policy reads: reward, status, group id) with one
``all_gather_object``; every rank then runs the *same* policy over the union, in the same order,
so all ranks reach the same global choice, and each keeps its own chosen episodes. The candidates
a bucket holds are a superset of what the policy could pick globally (the global top-k is within
the union of the local top-k; the uniform policy ranks by a hash of the trace id, which merges
exactly), so the job exports at most the cap per (step, split) and the policy holds across ranks.
``Groups`` merges exactly when a group's samples are recorded on one rank and each rank's
bucket held every group that could be chosen: the merge itself holds all candidates, but a
rank's bucket holds ``max_held`` episodes (default ``2 × cap``) and past that lets groups go on
their standing at the time (see ``Groups``): raise ``max_held`` when that matters.

Rules: ``end_step`` is then a collective — every rank calls it for the same steps (as with any
``torch.distributed`` call). Steps closed without it (the lag rule, a timeout, flush/shutdown)
cannot be agreed, so there each rank keeps at most ``cap // world_size``; late episodes are
dropped. Single-process use needs none of this and never imports torch: a distributed budget
applies only when the application itself initialised ``torch.distributed`` with more than one
rank, or passed a process group as ``TailSampler(distributed=group)``.
"""

from __future__ import annotations

import sys
from typing import Any

from otel_rollouts.sampling.policy import Policy, reason_of

__all__ = ["Coordinator", "Member", "coordinator_for", "merge", "merge_all", "summaries"]


def _torch_distributed():
    """``torch.distributed`` when the application already imported it (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def coordinator_for(setting: Any) -> Member | None:
    """A coordinator for ``TailSampler(distributed=...)``: ``"auto"`` (the default group when
    torch.distributed is initialised with more than one rank), ``True`` (the same), or a
    process group; None when no distributed budget applies."""
    if setting is False or setting is None:
        return None
    other = getattr(setting, "coordinator", None)
    if callable(other):  # another transport (``RayBudget``): it builds its own
        return other()  # type: ignore[no-any-return]
    dist = _torch_distributed()
    if dist is None:
        return None
    group = None if setting in ("auto", True) else setting
    if dist.get_world_size(group) < 2:
        return None
    return Coordinator(dist, group)


class _Summary:
    """What a rank tells the others about one candidate: enough to run the policy on it."""

    __slots__ = ("trace_id", "attrs", "rank", "index", "reason")

    def __init__(self, trace_id: int, attrs: dict[str, Any], rank: int, index: int) -> None:
        self.trace_id, self.attrs, self.rank, self.index = trace_id, attrs, rank, index
        self.reason: str | None = None  # why the global choice keeps it

    def attribute(self, key: str) -> Any:
        return self.attrs.get(key)


class Member:
    """One member of a budget shared by several processes, as the pipeline sees it at
    ``end_step``. A transport says how the summaries reach the others (``exchange``) and how many
    members share the cap (``members``); the rest is the same for all."""

    members = 1

    def usable(self) -> bool:
        raise NotImplementedError

    def local_share(self, cap: int) -> int:
        """What one member may keep of a step closed without agreement."""
        return cap // max(self.members, 1)

    def exchange(self, policy: Policy, cap: int, payload: Payload, step: int) -> dict[tuple[int, str], Kept]:
        """Send this member's summaries; the indices of its own candidates that it keeps."""
        raise NotImplementedError

    def choose(
        self,
        policy: Policy,
        cap: int,
        candidates: dict[tuple[int, str], list[Any]],
        *,
        step: int,
    ) -> dict[tuple[int, str], list[Any]]:
        """This member's records of the global choice, per (step, split)."""
        keep = self.exchange(policy, cap, summaries(policy, candidates), step)
        out: dict[tuple[int, str], list[Any]] = {}
        for key, chosen in keep.items():
            if key not in candidates:
                continue
            records = out[key] = []
            for i, reason in chosen:
                record = candidates[key][i]
                if reason is not None and getattr(record, "reason", None) is None:
                    record.reason = reason
                records.append(record)
        return out


class Coordinator(Member):
    """Runs the policy globally over every rank's candidates of a step: one ``all_gather_object``,
    then every rank merges the same union (a collective)."""

    def __init__(self, dist: Any, group: Any = None) -> None:
        self.dist = dist
        self.group = group
        self.members = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def usable(self) -> bool:
        return _torch_distributed() is self.dist

    def exchange(self, policy: Policy, cap: int, payload: Payload, step: int) -> dict[tuple[int, str], Kept]:
        gathered: list[Any] = [None] * self.members
        self.dist.all_gather_object(gathered, (step, payload), group=self.group)
        for other in gathered:
            if other is None or other[0] != step:
                raise RuntimeError(
                    f"otel_rollouts: end_step({step}) met end_step({None if other is None else other[0]})"
                    " on another rank; every rank must close the same steps in the same order"
                )
        return merge(policy, cap, [p for _, p in gathered], self.rank)


Payload = dict[tuple[int, str], list[tuple[int, int, int, dict[str, Any]]]]
Kept = list[tuple[int, str | None]]  # a member's kept candidates: (index, rl.trace.keep_reason)


def summaries(policy: Policy, candidates: dict[tuple[int, str], list[Any]]) -> Payload:
    """What one member tells the others of its candidates, per (step, split): trace id, end
    time, arrival order and the attributes the policy reads. Plain tuples: pickled small."""
    needs = sorted(policy.needs())
    return {
        key: [
            (
                r.trace_id,
                r.root.end_ns if r.root is not None and r.root.end_ns is not None else 0,
                r.seq,
                {name: r.attribute(name) for name in needs},
            )
            for r in records
        ]
        for key, records in candidates.items()
    }


def merge_all(policy: Policy, cap: int, payloads: list[Payload]) -> dict[tuple[int, str], list[Kept]]:
    """The global choice over every member's candidates, per (step, split): for each member (in
    the order of ``payloads``), the indices of its own candidates that it keeps. One order for
    all (first to finish first), so every member computing it reaches the same choice. The
    bucket may hold every candidate (they are all in memory already): a bucket bounded by its
    memory rule (``Groups``' ``max_held``) would let groups go on partial evidence when their
    members arrive interleaved, and the merge would not be exact."""
    out: dict[tuple[int, str], list[Kept]] = {}
    for key in sorted({key for p in payloads for key in p}):
        rows = [
            (end_ns, r, seq, trace_id, attrs, index)
            for r, p in enumerate(payloads)
            for index, (trace_id, end_ns, seq, attrs) in enumerate(p.get(key, ()))
        ]
        rows.sort(key=lambda row: row[:3])
        bucket = policy.bucket(cap, key, margin=len(rows))
        for _, r, _, trace_id, attrs, index in rows:
            bucket.offer(_Summary(trace_id, attrs, r, index))
        kept: list[list[tuple[int, str | None]]] = [[] for _ in payloads]
        for summary in bucket.decide(cap):  # (index, why it is kept)
            kept[summary.rank].append((summary.index, summary.reason or reason_of(policy)))
        out[key] = kept
    return out


def merge(policy: Policy, cap: int, payloads: list[Payload], rank: int) -> dict[tuple[int, str], Kept]:
    """``merge_all``, for one member: the indices of ``rank``'s own candidates that it keeps."""
    return {key: kept[rank] for key, kept in merge_all(policy, cap, payloads).items()}
