"""The cross-rank merge of the distributed budget, as a pure function: every rank's bucket is
offered its own episodes as they finish, the summaries of what each holds are merged in one
order, and the union keeps exactly what one process seeing every episode would keep.

The collective around it (``all_gather_object`` over gloo) is tested with real ranks in
``test_distributed.py``; here the merge is checked over many seeded layouts (hypothesis), which
real process groups would make too slow.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.sampling.distributed import merge

KEY = (0, "train")


class _Episode:
    """What a rank's bucket and the summary read of a finished episode."""

    def __init__(self, trace_id: int, group: str, reward: float, end_ns: int) -> None:
        self.trace_id, self.end_ns, self.seq = trace_id, end_ns, 0
        self.attrs = {c.RL_GROUP_ID: group, c.RL_REWARD: reward}

    def attribute(self, name: str):
        return self.attrs.get(name)


def _ideal(episodes: list[_Episode], cap: int) -> set[str]:
    """Whole groups by reward spread (ties: the group whose first episode finished first),
    each taken while it fits in what is left of the cap."""
    spans: dict[str, list[float]] = {}
    first: dict[str, int] = {}
    for position, e in enumerate(sorted(episodes, key=lambda e: e.end_ns)):
        g = e.attrs[c.RL_GROUP_ID]
        spans.setdefault(g, []).append(e.attrs[c.RL_REWARD])
        first.setdefault(g, position)
    chosen, left = set(), cap
    for g in sorted(spans, key=lambda g: (-(max(spans[g]) - min(spans[g])), first[g])):
        if len(spans[g]) <= left:
            chosen.add(g)
            left -= len(spans[g])
    return chosen


LAYOUT = st.lists(  # per rank: the sizes of its groups
    st.lists(st.integers(1, 5), min_size=1, max_size=10), min_size=2, max_size=4)


@settings(max_examples=examples(600), deadline=None)
@given(layout=LAYOUT, cap=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), whole=st.booleans())
def test_groups_merge_exactly_when_each_group_is_recorded_on_one_rank(layout, cap, seed, whole):
    import random

    rnd = random.Random(seed)
    ranks: list[list[_Episode]] = []
    tid = 0
    for r, sizes in enumerate(layout):
        episodes = []
        for g, size in enumerate(sizes):
            for _ in range(size):
                tid += 1
                episodes.append(_Episode(tid, f"r{r}g{g}", rnd.choice([0.0, 0.25, 0.5, 1.0]) + rnd.random(),
                                         rnd.getrandbits(40)))
        if whole:  # each group's episodes finish together (a GRPO group scored at once)
            times = sorted(e.end_ns for e in episodes)
            for e, t in zip(episodes, times, strict=True):
                e.end_ns = t
        ranks.append(episodes)
    # every rank's bucket holds all its episodes (room for them all): what is checked is the
    # merge, which must not let a group go on partial evidence, whatever the order the ranks'
    # episodes finish in, with the policy's default memory rule
    policy = otr.Groups()
    payloads = []
    for episodes in ranks:
        bucket = policy.bucket(cap, KEY, margin=len(episodes))
        for seq, e in enumerate(sorted(episodes, key=lambda e: e.end_ns)):
            e.seq = seq
            bucket.offer(e)
        payloads.append({KEY: [(e.trace_id, e.end_ns, e.seq, dict(e.attrs)) for e in bucket.held()]})
    chosen = set()
    for r, episodes in enumerate(ranks):
        held = payloads[r][KEY]
        for index, _ in merge(policy, cap, payloads, r).get(KEY, []):
            trace_id = held[index][0]
            chosen.add(next(e.attrs[c.RL_GROUP_ID] for e in episodes if e.trace_id == trace_id))
    assert chosen == _ideal([e for episodes in ranks for e in episodes], cap)
