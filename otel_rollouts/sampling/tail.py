"""``TailSampler``: at most ``max_traces_per_step`` whole episodes per (step, split), chosen
by a policy when the step closes, plus the prompts watched across the run."""

from __future__ import annotations

from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts.sampling.companions import with_companions
from otel_rollouts.sampling.compose import DEFAULT_POLICY, default_policy, make_policy
from otel_rollouts.sampling.policy import Bucket, Candidate, Policy, budget_of

__all__ = ["MAX_WATCH", "TailSampler"]


class TailSampler:
    """Keeps at most ``max_traces_per_step`` whole episodes per (rl.step, rl.split), fewer when
    the policy is one part with its own ``n`` (``TailSampler(8, Slowest(3))`` keeps 3).

    ``policy`` is a name (``"first"``, ``"uniform"``, ``"top_bottom"``, ``"errors"``,
    ``"groups"``, or several joined by ``+``, e.g. ``"errors+slowest+top_bottom"`` or
    ``"errors+top_bottom+degenerate_groups"``) or a ``Policy`` object such as
    ``Compose(Errors(2), TopBottom(top=4, bottom=4), Uniform())``. The default keeps errors
    (failed, then truncated) within a quarter of the cap, then the best and worst by reward
    (``default_policy``). Every kept root says why in ``rl.trace.keep_reason``.

    ``watch``: prompts followed across the run, by dataset index (``rl.dataset.index``, an int
    or a string) or prompt hash (``otr.prompt_hash(prompt)``, matched against what
    ``ep.prompt()`` recorded): every episode of a watched prompt is chosen when it finishes, with
    the reason ``watch``, outside the cap, at most ``watch_per_step`` per (step, split) (then
    the policy decides as for any other), and kept when its step closes, with the others (so
    the advantage recorded after its block and its group's health reach it). At most
    ``MAX_WATCH`` keys.

    ``group_size``: how many episodes the framework samples per group (GRPO's group size), when
    every group has the same; a group with fewer members that step lost some (group health).
    An episode's own ``rl.group.expected_size`` wins.

    When a step closes (the decision is taken then):

    * ``otr.end_step(step)`` closes every split of that step (or one, with ``split=``);
    * once an episode of step ``step + step_lag`` of the same split has *started*, older steps
      close (``step_lag=None`` turns that off; asynchronous RL overlaps policy versions);
    * ``step_timeout_s`` seconds after the last episode of that step finished, checked every
      second by a background ticker (``None``: no timeout);
    * at ``otr.flush()`` / ``otr.shutdown()``.

    Late rule: an episode that finishes after its step closed is counted ``late``. It is kept
    only while its step kept fewer than the cap (first come), otherwise dropped and counted
    ``dropped.late``. With a distributed budget a rank cannot know what the other ranks kept,
    so late episodes are always dropped.

    ``distributed`` (default ``"auto"``): when ``torch.distributed`` is initialised with more
    than one rank (or a process group is passed), ``end_step`` agrees one global budget per step
    across ranks (see ``otel_rollouts.sampling.distributed``); every rank must call ``end_step`` for the
    same steps. ``False`` keeps the cap per process.
    """

    def __init__(
        self,
        max_traces_per_step: int = 32,
        policy: str | Policy = DEFAULT_POLICY,
        *,
        step_lag: int | None = 2,
        step_timeout_s: float | None = None,
        seed: int = 0,
        distributed: object = "auto",
        watch: object = None,
        watch_per_step: int = 16,
        group_size: int | None = None,
    ) -> None:
        if (
            isinstance(max_traces_per_step, bool)
            or not isinstance(max_traces_per_step, int)
            or max_traces_per_step < 0
        ):
            raise ValueError(
                f"max_traces_per_step must be a non-negative int, got {max_traces_per_step!r}"
            )
        if step_lag is not None and (not isinstance(step_lag, int) or step_lag < 1):
            raise ValueError(f"step_lag must be an int >= 1 or None, got {step_lag!r}")
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {step_timeout_s!r}")
        self.max_traces_per_step = max_traces_per_step
        self.policy = (default_policy(max_traces_per_step) if isinstance(policy, str) and policy == DEFAULT_POLICY
                       else make_policy(policy, seed))
        # a policy of one part with its own ``n`` (``Slowest(3)``, ``Mismatch(2)``) keeps that
        # many, not the cap: the part's budget is what its user asked for, alone or composed
        budget = budget_of(self.policy)
        self.cap = max_traces_per_step if budget is None else min(budget, max_traces_per_step)
        self.watch = _watch_keys(watch)
        if isinstance(watch_per_step, bool) or not isinstance(watch_per_step, int) or watch_per_step < 0:
            raise ValueError(f"watch_per_step must be a non-negative int, got {watch_per_step!r}")
        self.watch_per_step = watch_per_step
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1):
            raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
        self.group_size = group_size
        self.step_lag = step_lag
        self.step_timeout_s = step_timeout_s
        self.seed = seed
        self.distributed = distributed

    def bucket(self, key: tuple[int, str], *, stream: bool = True) -> Bucket:
        return with_companions(self.policy.bucket(self.cap, key, stream=stream), self.cap)

    def __repr__(self) -> str:
        return (
            f"TailSampler(max_traces_per_step={self.max_traces_per_step}, policy={self.policy!r},"
            f" step_lag={self.step_lag}, step_timeout_s={self.step_timeout_s}"
            + (f", watch={sorted(map(str, self.watch))}" if self.watch else "") + ")"
        )

    def watched(self, record: Candidate) -> str | None:
        """The watch key ``record`` matches (its dataset index or prompt hash), or None."""
        watch = self.watch
        index = record.attribute(c.RL_DATASET_INDEX)
        if type(index) in (int, str) and index in watch:
            return str(index)
        digest = record.attribute(c.RL_PROMPT_HASH)
        if type(digest) is str and digest in watch:
            return str(digest)
        return None


MAX_WATCH = 4096  # watched prompts at most (a set of their keys: a few hundred KB)


def _watch_keys(watch: Any) -> frozenset[int | str]:  # the user's value, checked item by item
    """The watch list as a set of ints and strings; a clear error for anything else."""
    if watch is None:
        return frozenset()
    if isinstance(watch, (str, int)):
        watch = [watch]
    keys: set[int | str] = set()
    for i, key in enumerate(watch):
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ValueError(f"watch[{i}]: expected a dataset index (int or str) or a prompt hash (str), "
                             f"got {type(key).__name__}")
        keys.add(key)
        if len(keys) > MAX_WATCH:
            raise ValueError(f"watch: at most {MAX_WATCH} prompts")
    return frozenset(keys)
