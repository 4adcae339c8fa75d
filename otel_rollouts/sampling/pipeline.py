"""The rollout pipeline: holds undecided episodes, runs the tail sampler, hands kept ones on.

Data path: episode API / @traced (records) → this pipeline (sampler) → delivery → exporters.
It also sits in the SDK TracerProvider as a ``SpanProcessor``, so spans made by other
OpenTelemetry instrumentation inside an episode are held with that episode and kept or dropped
with it (also when they end after the episode was decided); spans outside any episode pass
straight through.

The pipeline is the front (the ``SpanProcessor`` and the library's calls) and makes the decisions
(offer, keep, drop) under its lock; three parts it holds do the rest: ``steps.StepBook`` (the step
bookkeeping: open and closed steps, the lag and timeout rules), ``batch_offer.BatchOffer`` (whole
batches offered as rows) and ``foreign.Foreign`` (spans and logs of other instrumentation and
processes joined to the held episodes); the last two hold a reference to the pipeline typed by
their own protocols (``BatchHost``, ``ForeignHost``), whose declared members (``lock``, ``live``,
``arrivals``, ``keep``, ``drop``, ...) are all they use of it.

Complete episodes wait in a ready queue and are offered 64 at a time under the built-in
policies, whose buckets decide only when the step closes (``part_ended``). Per episode the offer
does little: the numbers its step needs (group, reward, status) appended
to the step's columns (``health.StepGroups.note``: added up per group when the step's health is
asked for), the step's counts kept as ints (they reach ``Stats`` when the step closes; a read
before that adds them in, ``pending_counts``), and, for the built-in policies, a streaming
reject (``screen``) that drops most episodes by two comparisons before the bucket.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from otel_rollouts import conventions as c
from otel_rollouts._core.spans import DROPPED, KEPT, OFFERED, OPEN, EpisodeRecord, SpanRecord
from otel_rollouts._core.stats import Stats
from otel_rollouts.delivery.dispatch import Delivery
from otel_rollouts.sampling.batch import DROP, KEEP, BatchRow, RowBatch
from otel_rollouts.sampling.batch_offer import BatchOffer
from otel_rollouts.sampling.companions import CompanionsBucket
from otel_rollouts.sampling.foreign import Foreign, GatewaySink
from otel_rollouts.sampling.observer import StepObserver
from otel_rollouts.sampling.policy import reason_of
from otel_rollouts.sampling.steps import SEEN, StepBook, StepState
from otel_rollouts.sampling.tail import TailSampler

if TYPE_CHECKING:
    from otel_rollouts.sampling.distributed import Member
    from otel_rollouts.sampling.hung import HungWatcher

_MAX_CLAIMED = 16_384  # deterministic trace ids remembered to tell a repeated episode id (~2 MB)

_SHUTDOWN_S = 30.0  # provider.shutdown() has no timeout argument: this bounds it
_PENDING_LOCK_S = 0.25  # a stats read waits this long for the lock, then reads the counts without it
SAMPLED_OUT_REASON = "sampled_out"
_NO_ATTRIBUTES: dict[str, Any] = {}  # an episode without a root (never written to)
# complete episodes wait in the ready queue until this many are there, or until the oldest of
# them ended this long ago (ns), then are offered together (``Pipeline.part_ended``)
READY_BATCH = 64
READY_NS = 1_000_000_000


def _score(value: object) -> float:
    """An attribute as a score: a float, NaN when it is none (not a number, a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _ended(ready: deque[EpisodeRecord]) -> int:
    """When the oldest episode of the ready queue ended (ns); now's if it was just taken."""
    try:
        root = ready[0].root
    except IndexError:
        return time.time_ns()
    return root.end_ns if root is not None and root.end_ns is not None else time.time_ns()


class Pipeline(SpanProcessor):
    """Thread-safe holder of the episodes in flight and the per-step sampler buckets."""

    def __init__(
        self, sampler: TailSampler, delivery: Delivery, stats: Stats, episode_timeout_s: float | None = None
    ) -> None:
        if episode_timeout_s is not None and not episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s!r}")
        self.episode_timeout_s = episode_timeout_s
        self.sampler = sampler
        self.delivery = delivery
        self.stats = stats
        self._lock = threading.RLock()  # ``lock``
        self.live: dict[int, EpisodeRecord] = {}  # trace id → undecided episode
        # complete episodes not offered yet, in the order they completed (``part_ended``); every
        # path that closes a step or reads its counts offers them first (``_drain``)
        self._ready: deque[EpisodeRecord] = deque()
        self.steps = StepBook(sampler)  # open and closed steps, the lag and timeout rules
        self.arrivals = itertools.count(1)  # arrival order; next() is atomic: no lock needed
        self._coordinator: Member | None = None  # resolved lazily: torch.distributed may start later
        self.observer: StepObserver | None = None  # metrics: told of each decision and each closed step
        self._kept_hook: Callable[[EpisodeRecord], None] | None = None  # on_kept
        # deterministic trace ids given out lately (insertion order: the oldest forgotten first)
        self._claimed: OrderedDict[int, None] = OrderedDict()
        self._claim_lock = threading.Lock()
        # the node's span gateway, told which traces are episodes and what was decided (set by
        # the run when it has one; ``foreign.GatewaySink``)
        self.gateway: GatewaySink | None = None
        # a watch list with prompt hashes: episodes hash their prompt when they record it
        self.watch_hashes = any(isinstance(k, str) for k in sampler.watch)
        self.hung: HungWatcher | None = None  # episodes shown while they hang
        self._policy_reason = reason_of(sampler.policy)
        self._timeouts = sampler.step_timeout_s is not None  # steps note when they last saw one
        self._watch = bool(sampler.watch)
        stats.pending = self.pending_counts  # a read of the stats adds the open steps' counts
        self.batches = BatchOffer(self)  # the batch path: whole batches offered as rows
        self.foreign = Foreign(self)  # other instrumentation's and processes' spans and logs

    @property
    def lock(self) -> threading.RLock:
        """The lock every decision and every change of the sampler's state is made under (the
        parts, ``BatchOffer`` and ``Foreign``, take it as the pipeline does)."""
        return self._lock

    # --- deterministic ids ---------------------------------------------------------------------
    def claim_trace_id(
        self, trace_id: int, key: tuple[int, str], derive: Callable[[int], int]
    ) -> tuple[int, int]:
        """A deterministic trace id for an episode of ``key``: ``trace_id`` itself, or, when an
        episode already had it (its episode id repeated), ``derive(n)`` for the first
        occurrence number ``n >= 2`` still free, counted ``duplicate_id`` for the step.

        Two episodes under one trace id would be one trace to every backend (one of them
        overwritten or merged: an episode counted kept that nobody can see). Returns the trace
        id and the occurrence (0: the first). Remembers the last ``_MAX_CLAIMED`` ids: a repeat
        further apart than that is not told (bounded memory)."""
        with self._claim_lock:
            claimed = self._claimed
            n = 0
            while trace_id in claimed:
                n = 2 if n == 0 else n + 1
                trace_id = derive(n)
            claimed[trace_id] = None
            if len(claimed) > _MAX_CLAIMED:
                claimed.popitem(last=False)
        if n:
            self.stats.step(key, "duplicate_id")
        return trace_id, n

    # --- distributed budget --------------------------------------------------------------------
    def coordinator(self) -> Member | None:
        """The cross-rank coordinator when a distributed budget applies now, else None."""
        setting = self.sampler.distributed
        if setting is False or setting is None:
            return None
        from otel_rollouts.sampling import distributed

        coordinator = self._coordinator
        if coordinator is None or not coordinator.usable():
            coordinator = self._coordinator = distributed.coordinator_for(setting)
        return coordinator

    # --- episodes ------------------------------------------------------------------------------
    def started(self, record: EpisodeRecord) -> None:
        """An episode began. No lock unless its step is newer than any of its split (the lag
        rule may close older steps) or steps time out: an episode's lock round-trip is its offer
        to the sampler (one for 64 episodes under the built-in policies: ``part_ended``)."""
        record.seq = next(self.arrivals)
        self.live[record.trace_id] = record  # one dict store: atomic
        gateway = self.gateway
        if gateway is not None:
            gateway.opened(record.trace_id)
        step, split = record.step, record.split
        self.stats.step((step, split), "started")
        steps = self.steps
        # the lock only when this step may close others: the newest of its split (the lag
        # rule), or steps time out
        newest = steps.newest.get(split)
        if newest is None or step > newest or self._timeouts:
            with self._lock:
                self._step_advanced(step, split)

    def step_started(self, step: int, split: str, n: int) -> None:
        """``n`` episodes of (step, split) started: counted; the lag and timeout rules apply."""
        self.stats.step((step, split), "started", n)
        self._step_advanced(step, split)

    def _step_advanced(self, step: int, split: str) -> None:
        newest_closed = self.steps.advance(step, split)
        if newest_closed is not None:
            self._close_old(split, newest_closed)
        if self.sampler.step_timeout_s is not None:
            self._expire()

    # --- batches: the batch path (batch_offer.BatchOffer) -------------------------------------
    def takes_batches(self) -> bool:
        """Whether a batch can be offered as rows (see ``BatchOffer.takes_batches``)."""
        return self.batches.takes_batches()

    def offer_batch(self, batch: RowBatch) -> list[BatchRow] | None:
        """Offer every row of ``batch`` in one lock round-trip (see ``BatchOffer.offer_batch``)."""
        return self.batches.offer_batch(batch)

    def attach(self, recorded: list[tuple[BatchRow, EpisodeRecord | None]]) -> None:
        """The episodes recorded for rows ``offer_batch`` returned (see ``BatchOffer.attach``)."""
        self.batches.attach(recorded)

    def new_step(self, key: tuple[int, str]) -> StepState:
        return self.steps.start(key, stream=self.coordinator() is None)

    def part_ended(self, record: EpisodeRecord) -> None:
        """The root or the reward span ended: offer the episode once it is complete.

        An episode whose root ended without a reward waits for one while its step is open (the
        step's close offers it as it is). If its step is closed already, nothing would ever
        close it again (``step_lag=None``, no timeout): it is offered now, under the late rule
        (which compares nothing, so the missing reward changes nothing), and a reward recorded
        later goes out as a late span of a kept episode. Memory never holds it past its step."""
        if record.state != OPEN:
            return
        root, reward = record.root, record.reward_span
        if root is None or root.end_ns is None:
            return  # the reward span ended first: the root's end offers it
        hung = self.hung
        if hung is not None and record.timed and (reward is None or reward.end_ns is None
                                                  or reward.end_ns <= root.end_ns):
            # once per episode, when its root ends (a reward span that ended after the root
            # was noted then): its duration goes to the hang watcher (an atomic append)
            # (record.duration(), in place for the common case: no duration given by hand)
            seconds = (max(root.end_ns - root.start_ns, 0) / 1e9
                       if c.RL_DURATION_SECONDS not in root.attributes else record.duration())
            if seconds is not None:
                hung.finished.append(((record.step, record.split), seconds))
        if reward is None or reward.end_ns is None:  # not complete (EpisodeRecord.complete)
            # the lock-free check (a dict lookup): a step closing meanwhile offers it itself,
            # since its root's end is set before this is called
            if not self.steps.is_closed((record.step, record.split)):
                return
            with self._lock:
                if record.state == OPEN:
                    self._offer(record)
            return
        # complete. A step whose bucket decides only when the step closes (the built-in
        # policies: its screen) takes it through the ready queue (an atomic append, no lock),
        # offered with the others when enough wait or the oldest waited long enough: the
        # sampler's code runs once for many episodes, while it is warm, not once per episode
        # right after the user's own work (what a training step feels); none is kept later than
        # it would be (the bucket keeps at the close), a dropped one is let go at most 64
        # episodes or a second later. A step closing meanwhile offers every episode that ended
        # (``_offer_waiting``): none is missed. Any other bucket may keep it at once: offered now
        step = self.steps.open.get((record.step, record.split))  # a dict read: atomic
        if step is None or step.screen is None:
            with self._lock:
                if record.state == OPEN:
                    self._offer(record)
            return
        ready = self._ready
        ready.append(record)
        if len(ready) >= READY_BATCH or root.end_ns - _ended(ready) > READY_NS:
            with self._lock:
                self._drain()

    def _drain(self) -> None:
        """Offer the complete episodes of the ready queue, in the order they completed (under
        the lock). One a step's close offered already is skipped."""
        ready = self._ready
        while ready:
            try:
                record = ready.popleft()
            except IndexError:  # emptied by another thread meanwhile
                return
            if record.state == OPEN:
                self._offer(record)

    def late_span(self, record: EpisodeRecord, span: SpanRecord) -> None:
        """A span of an already decided episode ended: it goes out only with a kept one."""
        if record.state == KEPT:
            self.delivery.late_span(record, span)
        else:
            self.stats.add("dropped.late_spans")

    def is_closed(self, key: tuple[int, str]) -> bool:
        """Whether (step, split) was closed (its episodes from now on are late)."""
        return self.steps.is_closed(key)

    def _offer(self, record: EpisodeRecord) -> None:
        """Offer a finished episode to its step (under the lock): the numbers the step needs
        appended to its columns (``StepGroups.note``), counted by plain ints, then rejected by
        the step's screen (two comparisons against the built-in policy's thresholds) or offered
        to its bucket (watched prompts and custom policies: the full path)."""
        key = (record.step, record.split)
        record.state = OFFERED
        step = self.steps.open.get(key)
        if step is None:
            if self.steps.is_closed(key):
                self.stats.step(key, SEEN)
                self._late(record, key)
                return
            step = self.new_step(key)
        step.seen += 1
        if self._timeouts:
            step.last_seen = time.monotonic()
        root = record.root
        attrs = root.attributes if root is not None else _NO_ATTRIBUTES
        reward: Any = attrs.get(c.RL_REWARD)
        score: float = reward if type(reward) is float else _score(reward)
        status = attrs.get(c.RL_STATUS)
        gid = attrs.get(c.RL_GROUP_ID)
        if gid is not None:
            step.groups.note(gid, score, status, attrs.get(c.RL_GROUP_EXPECTED_SIZE))
        if self._watch and step.watched < self.sampler.watch_per_step:
            watched = self.sampler.watched(record)
            if watched is not None:  # kept outside the cap, the policy never sees it; handed
                step.watched += 1  # on when the step closes (StepState.watching), like the rest
                record.reason = c.REASON_WATCH
                record.notes = {c.RL_WATCH_KEY: watched}
                step.watching.append(record)
                return
        screen = step.screen
        if screen is not None and status not in screen.statuses and attrs.get(c.RL_COMPANIONS_ID) is None:
            ranked = screen.ranked
            if ranked is None:
                self._sampled_out(record, step)
                return
            if ranked.full:
                if screen.score != c.RL_REWARD:
                    score = _score(attrs.get(screen.score))
                if score == score and not score > ranked.above and not score <= ranked.below:
                    self._sampled_out(record, step)
                    return
        released, keep_now = step.bucket.offer(record)
        for r in released:
            if r is record:
                self._sampled_out(record, step)
            else:
                self.drop(r, SAMPLED_OUT_REASON)
        for r in keep_now:  # (a streaming policy: kept before its group's health is known)
            step.kept += 1
            step.groups.count_kept(r.attribute(c.RL_GROUP_ID))  # its group's row says it was kept
            self.keep(r)

    def _sampled_out(self, record: EpisodeRecord, step: StepState) -> None:
        """The episode just offered to ``step`` was let go at once: dropped, counted by the
        step (``dropped.sampled_out`` reaches the stats when it closes)."""
        step.sampled_out += 1
        if record.held_bytes or record.logs or self.gateway is not None:
            self._discard(record)
        else:  # _discard's common case in place: nothing held beside the record itself
            record.state = DROPPED
            self.live.pop(record.trace_id, None)
        observer = self.observer
        if observer is not None:  # _observe_decided, in place
            try:
                observer.decided(record, SAMPLED_OUT_REASON)
            except Exception:  # noqa: BLE001 - metrics never break the pipeline
                self.stats.add("errors.metrics")
        record.release()

    def _late(self, record: EpisodeRecord, key: tuple[int, str]) -> None:
        """The late rule: kept while its step kept fewer than the cap (first come), else dropped.

        With a distributed budget a rank cannot know what others kept: late ones are dropped.
        """
        self.stats.step(key, "late")
        if self.steps.late_room(key) > 0 and self.coordinator() is None:
            self.steps.kept_late(key)
            record.reason = record.reason or c.REASON_LATE
            self.keep(record)
        else:
            self.drop(record, "late")

    def keep(self, record: EpisodeRecord | BatchRow) -> None:
        if isinstance(record, BatchRow):
            row = record
            if row.record is None:  # decided before its episode was recorded: kept on arrival
                if row.built:  # its recording failed: nothing to keep
                    self.batches.record_failed(row)
                row.decision = KEEP
                return
            record = row.record
            if record.reason is None:
                record.reason = row.reason
            if row.notes:
                record.notes = {**(record.notes or {}), **row.notes}
        record.state = KEPT
        if record.reason is None:  # a custom bucket that said nothing: the policy's own label
            record.reason = self._policy_reason
        self.live.pop(record.trace_id, None)
        self.foreign.release(record)
        if self.gateway is not None:
            self.gateway.decided(record.trace_id, True)
        self.stats.step((record.step, record.split), "kept")
        if record.dropped_spans:
            self.stats.add("dropped.span_limit", record.dropped_spans)
        self._observe_decided(record, None)
        logs, record.logs = record.logs, None
        self.delivery.episode(record)
        if logs:
            for outlet, items, _ in logs:
                self.foreign.send_logs(outlet, items)
        hook = self._kept_hook
        if hook is not None:
            try:
                hook(record)
            except Exception:  # noqa: BLE001 - a log outlet never breaks the pipeline
                self.stats.add("errors.evaluation_logs")

    def on_kept(self, hook: Callable[[EpisodeRecord], None] | None) -> None:
        """Call ``hook`` with every episode kept from now on (see ``EpisodeSink.on_kept``)."""
        self._kept_hook = hook

    def drop(self, record: EpisodeRecord | BatchRow, reason: str | None) -> None:
        """``reason`` None: counted already (a row dropped before its record arrived)."""
        if isinstance(record, BatchRow):
            row = record
            if row.record is None:
                if row.decision != DROP and reason is not None:
                    row.decision = DROP
                    self.batches.dropped_rows(row.batch, [row.index], reason)
                return
            record = row.record
        self._discard(record)
        if reason is not None:
            self.stats.step((record.step, record.split), "dropped." + reason)
            self._observe_decided(record, reason)
        record.release()

    def _discard(self, record: EpisodeRecord) -> None:
        """``record`` is dropped: no longer live, its held bytes and logs let go (counted), the
        gateway told. The caller counts it and releases it."""
        record.state = DROPPED
        self.live.pop(record.trace_id, None)
        if record.held_bytes:
            self.foreign.release(record)
        if self.gateway is not None:
            self.gateway.decided(record.trace_id, False)
        if record.logs:
            for _, items, _ in record.logs:
                self.stats.add("dropped.episode_logs", len(items))
            record.logs = None

    # --- closing steps -----------------------------------------------------------------------
    def end_step(self, step: int, split: str | None = None) -> None:
        """Close ``step`` (every split, or one). With a distributed budget this is collective."""
        coordinator = self.coordinator()
        with self._lock:
            self._offer_waiting(lambda r: r.step == step and (split is None or r.split == split))
            keys = self.steps.of_step(step, split)
            splits = {split} if split is not None else {k[1] for k in keys} | set(self.steps.newest)
            for s in splits:
                self.steps.mark_closed((step, s))
            if coordinator is None:
                for key in keys:
                    self._close(key)
                self.steps.trim()
                return
            closing = {key: state for key in keys if (state := self._pop_step(key)) is not None}
        # the collective runs outside the lock: other threads keep recording meanwhile
        try:
            chosen = coordinator.choose(
                self.sampler.policy,
                self.sampler.cap,
                {key: s.bucket.held() for key, s in closing.items()},
                step=step,
            )
        except Exception:
            # no agreement (ranks out of step, a dead peer): decide locally within this rank's
            # share so the job stays under the cap, then let the error be reported
            with self._lock:
                share = coordinator.local_share(self.sampler.cap)
                for key, held in closing.items():
                    self._apply(key, held, held.bucket.decide(share))
            raise
        with self._lock:
            for key, held in closing.items():
                self._apply(key, held, chosen.get(key, []))
            self.steps.trim()

    def close_all(self, timeout: float | None = None, deadline: float | None = None) -> bool:
        """Close every open step (flush/shutdown). Not collective: see ``_close``.

        With ``timeout``, gives up (returning False, counted) if the lock is not free by then:
        at exit the thread holding it may be the one a signal interrupted. With ``deadline``
        (``time.monotonic()``), stops offering and closing when it passes (returning False):
        what is left undecided is counted by ``count_undecided``.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self.stats.add("errors.close_lock_busy")
            return False
        try:
            if not self._offer_waiting(lambda r: True, deadline):
                return False
            for key in list(self.steps.open):
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._close(key)
            self.steps.trim()
            return True
        finally:
            self._lock.release()

    def end_open(self, status: str, timeout: float | None = None, deadline: float | None = None) -> int:
        """End every episode whose root is still open, marked ``status`` (shutdown, reconfigure);
        with ``deadline`` (``time.monotonic()``), only those it leaves time for (the rest stay
        open, undecided: ``count_undecided``). Returns how many were ended."""
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self.stats.add("errors.close_lock_busy")
            return 0
        try:
            ended = 0
            for record in [r for r in list(self.live.values()) if r.state == OPEN]:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                root = record.root
                if root is not None and root.end_ns is None:
                    root.attributes[c.RL_STATUS] = status
                    root.end()
                    ended += 1
            return ended
        finally:
            self._lock.release()

    def count_undecided(self) -> int:
        """At exit, after the last decisions: count the episodes still undecided (open, or held
        by a step that was not closed in time), per step as ``undecided_at_exit`` and in all as
        ``episodes.undecided_at_exit``. None of them was kept: the ledger never saw them, but
        ``started`` = decided + this. Reads a copy of the live records, without the lock (its
        holder may be the thread a signal interrupted). Returns the count."""
        per_step: dict[tuple[int, str], int] = {}
        for record in list(self.live.values()):  # one C-level copy
            if record.state in (OPEN, OFFERED):
                key = (record.step, record.split)
                per_step[key] = per_step.get(key, 0) + 1
        for key, n in per_step.items():
            self.stats.step(key, "undecided_at_exit", n)
        total = sum(per_step.values())
        if total:
            self.stats.add("episodes.undecided_at_exit", total)
        return total

    def _close_old(self, split: str, newest_closed: int) -> None:
        """Close the steps of ``split`` up to ``newest_closed`` (the lag rule)."""
        self._offer_waiting(lambda r: r.split == split and r.step <= newest_closed)
        for key in self.steps.up_to(split, newest_closed):
            self._close(key)
        self.steps.trim()

    def _offer_waiting(self, match, deadline: float | None = None) -> bool:
        """The ready queue offered; then episodes whose root ended but whose reward never came
        are offered as they are; with ``deadline``, until it passes (False: some were left
        unoffered)."""
        self._drain()
        waiting = [
            r
            for r in list(self.live.values())  # a copy: episodes start without the lock
            if r.state == OPEN and r.root is not None and r.root.end_ns is not None and match(r)
        ]
        for n, record in enumerate(sorted(waiting, key=lambda r: r.seq)):
            if deadline is not None and n % 64 == 0 and time.monotonic() >= deadline:
                return False
            if record.state == OPEN:
                self._offer(record)
        return True

    def _close(self, key: tuple[int, str]) -> None:
        """A local decision. Under a distributed budget (lag, timeout, flush: no collective is
        possible there) each rank keeps at most ``cap // world_size``, so the job stays under
        the cap."""
        step = self._pop_step(key)
        if step is None:
            return
        coordinator = self.coordinator()
        limit = None if coordinator is None else coordinator.local_share(
            self.sampler.cap
        )
        self._apply(key, step, step.bucket.decide(limit))

    def _pop_step(self, key: tuple[int, str]) -> StepState | None:
        """Take ``key`` out of the open steps (under the lock), its counts into the stats."""
        step = self.steps.open.pop(key, None)
        if step is not None:
            for name, n in step.take_counts():
                self.stats.step(key, name, n)
        return step

    def pending_counts(self) -> list[tuple[tuple[int, str], str, int]]:
        """The per-step counts the open steps hold and the stats do not have yet, as
        ``(key, name, n)``: ``Stats`` adds them to what it reports. Read under the lock (waiting
        at most ``_PENDING_LOCK_S``: at exit its holder may be a thread a signal stopped; past
        that, read without it)."""
        locked = self._lock.acquire(timeout=_PENDING_LOCK_S)
        try:
            if locked:  # complete episodes are counted seen
                self._drain()
            return [(key, name, n) for key, step in list(self.steps.open.items())
                    for name, n in step.counts()]
        finally:
            if locked:
                self._lock.release()

    def _apply(self, key: tuple[int, str], step: StepState, chosen: list[EpisodeRecord]) -> None:
        if isinstance(step.bucket, CompanionsBucket):  # the local companions of what was chosen
            # what a bucket hands back are the records it was offered: this pipeline's own
            chosen = cast("list[EpisodeRecord]", step.bucket.with_companions(list(chosen)))
        chosen_ids = {id(r) for r in chosen}
        for record in step.bucket.held():
            if id(record) not in chosen_ids:
                self.drop(record, "sampled_out")
        groups = step.groups
        watching, step.watching = step.watching, []
        if watching:  # the watched episodes (outside the cap), complete now as the others are
            self.stats.step(key, "kept.watch", len(watching))
        for record in itertools.chain(watching, chosen):
            if groups.groups or groups.pending():  # each kept member says how its group fared
                # (and its group's row counts it kept: StepGroups.keep)
                health = groups.keep(record.attribute(c.RL_GROUP_ID))
                if health is not None:
                    record.notes = {**(record.notes or {}), **health}
            self.keep(record)
        self.steps.mark_closed(key, step.kept + len(chosen))
        observer = self.observer
        if observer is not None:
            try:
                observer.step_closed(key, groups.summary())
            except Exception:  # noqa: BLE001 - metrics never break the pipeline
                self.stats.add("errors.metrics")

    def _observe_decided(self, record: EpisodeRecord, reason: str | None) -> None:
        """Tell the observer (the metrics) that ``record`` was kept or dropped (``reason``)."""
        observer = self.observer
        if observer is not None:
            try:
                observer.decided(record, reason)
            except Exception:  # noqa: BLE001 - metrics never break the pipeline
                self.stats.add("errors.metrics")

    def _expire(self) -> None:
        expired = self.steps.expired()
        for key in expired:
            self._offer_waiting(lambda r, key=key: (r.step, r.split) == key)
            self._close(key)
            self.steps.mark_closed(key)
        if expired:
            self.steps.trim()

    def tick(self) -> None:
        """Called every second by the configuration's ticker thread: ends episodes open past
        ``episode_timeout_s``, closes timed-out steps."""
        if self.episode_timeout_s is not None and self.live:
            self.end_stale(self.episode_timeout_s)
        if self._ready:  # episodes that completed a while ago are offered (a slow loop)
            with self._lock:
                self._drain()
        if self.sampler.step_timeout_s is not None and self.steps.open:
            with self._lock:
                self._expire()
        hung = self.hung
        if hung is not None:  # also with nothing open: episodes shown hanging may have ended
            hung.tick(list(self.live.values()))  # a copy made without the lock

    def stop_watching(self, timeout: float | None = None) -> None:
        """Before open episodes are ended at shutdown: those still hanging are counted hung
        (waiting at most ``timeout`` for a tick under way)."""
        hung = self.hung
        if hung is not None:
            hung.stop(timeout)

    def end_stale(self, timeout_s: float) -> int:
        """End, as truncated, every episode whose root has been open longer than ``timeout_s``:
        a hung rollout becomes a decided, counted, visible episode instead of memory nobody
        sees. Its later spans are late spans (delivered if it was kept)."""
        cutoff = time.time_ns() - int(timeout_s * 1e9)
        ended = 0
        with self._lock:
            for record in list(self.live.values()):
                root = record.root
                if record.state != OPEN or root is None or root.end_ns is not None:
                    continue
                if root.start_ns > cutoff:
                    break  # in start order: the rest are younger
                root.attributes[c.RL_STATUS] = c.STATUS_TRUNCATED
                root.attributes[c.RL_TIMED_OUT] = True
                root.end()
                ended += 1
        if ended:
            self.stats.add("episodes.timed_out", ended)
        return ended

    def open_episodes(self) -> list[EpisodeRecord]:
        with self._lock:
            return [r for r in list(self.live.values()) if r.state == OPEN]

    # --- SpanProcessor and other processes' telemetry: foreign.Foreign -----------------------
    def on_start(self, span, parent_context=None) -> None:
        """Note which episode a foreign span belongs to (see ``Foreign.on_start``)."""
        self.foreign.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        """A foreign span ended: held, exported or dropped with its episode (``Foreign.on_end``)."""
        self.foreign.on_end(span)

    def adopt(self, spans: list[ReadableSpan], record: EpisodeRecord | None = None) -> None:
        """Finished spans of a worker task for an episode held here (see ``Foreign.adopt``)."""
        self.foreign.adopt(spans, record)

    def join_logs(self, trace_id: int, logs: Sequence[Any], outlet: Callable[[Sequence[Any]], None],
                  size: int, record: EpisodeRecord | None = None) -> bool:
        """Log records joined to episode ``trace_id``; False: no episode known here (see
        ``Foreign.join_logs``)."""
        return self.foreign.join_logs(trace_id, logs, outlet, size, record)

    def shutdown(self) -> None:
        """OpenTelemetry's ``provider.shutdown()``: end open episodes (truncated), close every
        step and deliver, then stop delivery. The library's own ``otr.shutdown()`` does the same
        with deadlines on every lock; after either, this is a no-op."""
        if self.delivery.closed:
            return
        self.stop_watching()
        self.end_open(c.STATUS_TRUNCATED, timeout=_SHUTDOWN_S / 4)
        self.close_all(timeout=_SHUTDOWN_S / 4)
        self.delivery.shutdown(_SHUTDOWN_S / 2)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """OpenTelemetry's ``provider.force_flush()``: close every open step (the sampler
        decides) and wait until kept episodes reached the exporters, within the timeout; False
        when that did not happen (an exporter failing: its batches wait in the spool)."""
        deadline = time.monotonic() + max(timeout_millis, 0) / 1000
        if not self.close_all(timeout=max(deadline - time.monotonic(), 0.0)):
            return False
        return self.delivery.flush(max(deadline - time.monotonic(), 0.0))

