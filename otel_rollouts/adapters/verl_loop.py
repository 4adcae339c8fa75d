"""verl without a source edit: one config entry records every generated batch.

verl's trainers load their agent-loop manager from a config entry
(``actor_rollout_ref.rollout.agent.agent_loop_manager_class``, read by ``RayPPOTrainer.init_workers``
and ``main_ppo.TaskRunnerV1``). This module's ``AgentLoopManager`` is verl's own manager with one
addition: after each ``generate_sequences`` it records the generated batch with
``otel_rollouts.adapters.verl.record_batch``. On verl's command line (``python -m
verl.trainer.main_ppo``) the override needs Hydra's ``+``: the key is in verl's ``RolloutConfig``
but in none of its yaml files::

    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=otel_rollouts.adapters.verl_loop.AgentLoopManager

It sees, on the trainer's process, what the agent loop returns: tokens and ``response_mask``,
``rm_scores`` and the reward terms the reward-loop workers streamed (verl's default layout, no
reward model or one with its own resource pool), ``__num_turns__``, the weights versions, and
from the input batch ``uid``, ``index``, ``data_source``, ``meta_info["global_steps"]`` (the step)
and ``["validate"]`` (the split), and each sample's ``AgentLoopMetrics`` (seconds in LLM calls,
tool calls and reward scoring: ``rl.stage.<stage>.seconds``), taken as verl's
``_performance_metrics`` reduces them to per-step figures. It numbers each sample's ``rollout_n`` exactly as the agent
loop's rollout traces do (the same chunks, before ``_balance_batch``).

Train–inference mismatch: the engine's logprobs (``rollout_log_probs``; the TQ worker's
``AgentLoopOutput.response_logprobs``) are passed on when the rollout computes them; the actor's
``old_log_probs`` are computed after the manager returns, so no ``rl.mismatch.*`` statistics
here (the ``record_batch`` line after ``old_log_probs`` has both).

What it cannot see: advantages (``compute_advantage`` runs on the trainer's batch after the
manager returns, on a copy the manager never holds), KL-penalised ``token_level_rewards``, and
rewards of a colocated reward model (scored after generation; warned once). For those, use the
two source lines of ``otel_rollouts.adapters.verl`` instead (not both: each records the episode).

Validation batches padded to the number of agent-loop workers (``pad_dataproto_to_divisor``) are
recorded without their padding copies; REMAX's greedy baselines (``__do_sample__`` false) are not
samples and are not recorded. Steps close (``otr.end_step``) when a later step's batch arrives.
otel_rollouts is configured from the environment in the trainer's process (a Ray actor) when
nothing configured it there. verl is imported only when the class is first looked up.

verl's default trainer (``trainer.use_v1=True``, ``main_ppo.TaskRunnerV1``) reads the same config
entry, but its batches never reach the manager: ``AgentLoopManagerTQ.generate_sequences`` only
dispatches, and each agent-loop worker (``AgentLoopWorkerTQ``, a Ray actor) puts every finished
session into TransferQueue itself. Under that trainer ``AgentLoopManager.create`` therefore returns
this module's ``AgentLoopManagerTQ`` (also nameable directly): verl's TQ manager whose workers are
verl's ``AgentLoopWorkerTQ`` plus one step, after each session is put into TransferQueue, recording
what was put there (``observe_session``), in the worker's process (configured from the
environment there). The episode id is ``{split}-{step}-{uid}-{session_id}``: v1 runs the ``n``
sessions of a prompt under one ``uid`` and keys them ``{uid}_{session_id}_{i}``. A worker closes a
(step, split) when none of its prompts is in flight and a later one was dispatched to it.

One training run is one run: the manager fixes the run id (``run_id``) and starts its workers with
it in their Ray ``runtime_env`` (``OTEL_ROLLOUTS_RUN_ID``). A session whose agent loop, reward or
TransferQueue put raised (verl logs it and marks the prompt ``failure``) is an error episode
(``failed_session``): the exception on its root, in its group, whose episodes all carry
``rl.group.expected_size`` (so ``rl.group.lost`` counts it). Under the batch trainer one failed
sample makes verl's ``generate_sequences`` raise and returns none of the batch: its samples are
counted (``COUNT_GENERATION_FAILED``).
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from collections.abc import Awaitable, Iterable, Mapping, Sequence, Sized
from typing import Any

from otel_rollouts import conventions as c
from otel_rollouts.adapters import verl as _verl
from otel_rollouts.adapters.kit import (
    check_release,
    count,
    current_instance,
    describe_framework,
    exception_text,
    field,
    first_time,
    guarded,
    lazy_text,
    scalar,
    set_policy,
    to_list,
    turns_from_mask,
    warn_unknown,
)

__all__ = [  # noqa: F822 - AgentLoopManager(TQ) built on lookup
    "AgentLoopManager", "AgentLoopManagerTQ", "COUNT_GENERATION_FAILED", "failed_session", "generation_failed",
    "observe", "observe_session", "run_id", "worker_runtime_env"]

_FRAMEWORK = _verl.FRAMEWORK
logger = logging.getLogger("otel_rollouts")


def __getattr__(name: str) -> Any:
    """``AgentLoopManager`` is built on first lookup (verl imported then, not at import)."""
    builders = {"AgentLoopManager": _build, "AgentLoopManagerTQ": _build_tq}
    if name in builders:
        cls = builders[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build() -> type:
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager as VerlAgentLoopManager

    class AgentLoopManager(VerlAgentLoopManager):
        """verl's ``AgentLoopManager`` that records each generated batch (results untouched)."""

        def generate_sequences(self, prompts: object) -> object:
            try:
                result = super().generate_sequences(prompts)
            except Exception as exc:  # a worker's agent loop or reward raised: the batch is lost
                generation_failed(self, prompts, exc)
                raise
            if inspect.isawaitable(result):  # called from a coroutine: verl's auto_await
                return _record_when_done(self, prompts, result)
            observe(self, prompts, result)
            return result

        def _performance_metrics(self, metrics: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
            """verl's per-step aggregation of the samples' ``AgentLoopMetrics``; the per-sample
            values it reads (one list per worker chunk, in the output's order) are kept for
            ``observe`` first: verl discards them after this call."""
            _keep_sample_metrics(self, metrics, output)
            return super()._performance_metrics(metrics, output, *args, **kwargs)

        @classmethod
        def create(cls, *args: object, **kwargs: object) -> object:
            """verl's ``create``; under the TransferQueue trainer, ``AgentLoopManagerTQ.create``."""
            if _uses_transfer_queue(kwargs.get("config", args[0] if args else None)):
                return __getattr__("AgentLoopManagerTQ").create(*args, **kwargs)
            return super().create(*args, **kwargs)

    AgentLoopManager.__module__ = __name__
    AgentLoopManager.__qualname__ = "AgentLoopManager"
    return AgentLoopManager


def _uses_transfer_queue(config: object) -> bool:
    """``TaskRunnerV1`` (picked by ``trainer.use_v1``) sets ``transfer_queue.enable`` before it
    builds the manager; the legacy trainer runs with ``use_v1`` false."""
    return (_config(config, "trainer", "use_v1") is True
            and _config(config, "transfer_queue", "enable") is True)


def _build_tq() -> type:
    import ray
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ as VerlManagerTQ
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ as VerlWorkerTQ

    base: Any = getattr(VerlWorkerTQ, "__ray_actor_class__", VerlWorkerTQ)  # the class under @ray.remote

    class RecordingAgentLoopWorkerTQ(base):  # type: ignore[misc, valid-type]
        """verl's ``AgentLoopWorkerTQ`` that records each session it puts into TransferQueue, and
        each session that failed (its agent loop, reward or put raised) as an error episode."""

        async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict,
                              *args: object, **kwargs: object) -> None:
            key = _step_key(trajectory)
            _dispatched(self, key)
            uid = _expect_group(self, prompt, trajectory)
            try:
                return await super()._run_prompt(prompt, sampling_params, trajectory, *args, **kwargs)
            finally:
                _settled(self, key)
                _forget_group(self, uid)

        async def _run_agent_loop(self, *args: Any, **kwargs: Any) -> object:
            try:
                return await super()._run_agent_loop(*args, **kwargs)
            except Exception as exc:  # verl's _run_prompt logs it and marks the group failed
                trajectory = kwargs.get("trajectory", args[1] if len(args) > 1 else None)
                validate = field(trajectory, "validate") is True
                failed_session(self, exc, None, validate, kwargs, stage="agent_loop")
                raise

        async def _agent_loop_postprocess(self, output: object, validate: object, **kwargs: object) -> object:
            try:
                result = await super()._agent_loop_postprocess(output, validate, **kwargs)
            except Exception as exc:  # verl scores the reward (and puts into TQ) in here
                failed_session(self, exc, output, validate, kwargs, stage="postprocess")
                raise
            observe_session(self, output, validate, kwargs)
            return result

    RecordingAgentLoopWorkerTQ.__module__ = __name__
    RecordingAgentLoopWorkerTQ.__qualname__ = "RecordingAgentLoopWorkerTQ"

    class AgentLoopManagerTQ(VerlManagerTQ):
        """verl's ``AgentLoopManagerTQ`` whose agent-loop workers record each session they put
        into TransferQueue (what they put there untouched)."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            # one training run, one run id: the workers (each recording in its own process)
            # get the run's id in their environment, as verl's own env vars reach them
            self.agent_loop_workers_class = ray.remote(runtime_env=worker_runtime_env())(
                RecordingAgentLoopWorkerTQ)

    AgentLoopManagerTQ.__module__ = __name__
    AgentLoopManagerTQ.__qualname__ = "AgentLoopManagerTQ"
    return AgentLoopManagerTQ


def _step_key(trajectory: Any) -> tuple[int, str] | None:
    try:
        return int(trajectory["step"]), "eval" if trajectory["validate"] else "train"
    except Exception:  # noqa: BLE001 - an unknown trajectory layout: steps are closed by the sampler
        warn_unknown(_FRAMEWORK, "trajectory", "no step/validate in the agent loop's trajectory info: "
                     "steps are closed by the sampler (step_lag, flush)")
        return None


@guarded
def _dispatched(worker: Any, key: tuple[int, str] | None) -> None:
    """A prompt of ``key`` starts on this worker: the idle (step, split)s before it are closed."""
    if key is None:
        return
    inflight = worker.__dict__.setdefault("_otr_inflight", {})
    for other in [k for k, n in inflight.items() if n == 0 and k != key]:
        _end_step(inflight, other)
    inflight[key] = inflight.get(key, 0) + 1
    worker._otr_latest = key


@guarded
def _settled(worker: object, key: tuple[int, str] | None) -> None:
    """A prompt of ``key`` settled (every session in TransferQueue, or failed)."""
    inflight = getattr(worker, "_otr_inflight", None)
    if key is None or inflight is None or key not in inflight:
        return
    inflight[key] -= 1
    if inflight[key] == 0 and key != getattr(worker, "_otr_latest", None):
        _end_step(inflight, key)


def _end_step(inflight: dict[tuple[int, str], int], key: tuple[int, str]) -> None:
    from otel_rollouts import end_step

    del inflight[key]
    end_step(key[0], split=key[1])


def run_id() -> str:
    """The training run's id, fixed once per agent-loop manager (one per training run, built in
    verl's ``TaskRunner``): ``OTEL_ROLLOUTS_RUN_ID`` when set, else the run id of otel_rollouts
    configured in that process, else a new one."""
    given = os.environ.get(c.ENV_RUN_ID)
    if given:
        return given
    return str(getattr(current_instance(), "run_id", None) or uuid.uuid4().hex[:12])


def worker_runtime_env() -> dict[str, dict[str, str]]:
    """The Ray ``runtime_env`` of the recording agent-loop workers: the run's id in their
    environment (Ray merges it into the job's ``env_vars``), so the episodes every worker records
    belong to one run (``rl.run.id``, the budget's run) however many workers record them."""
    return {"env_vars": {c.ENV_RUN_ID: run_id()}}


def _expect_group(worker: Any, prompt: Mapping[str, object], trajectory: object) -> object:
    """Note the group size ``_run_prompt`` will sample for this prompt (``__rollout_n__``, else
    ``rollout.n`` / ``val_kwargs.n``), read before verl pops it; returns the prompt's uid."""
    try:
        uid = prompt.get("uid")
        validate = field(trajectory, "validate") is True
        n: Any = prompt.get("__rollout_n__") or _repeats(getattr(worker, "config", None), validate)
        if uid is not None and n:
            worker.__dict__.setdefault("_otr_group_sizes", {})[_key(uid)] = int(n)
        return uid
    except Exception:  # noqa: BLE001 - the size stays unknown (the groups' expected size is left out)
        return None


def _forget_group(worker: Any, uid: object) -> None:
    sizes = getattr(worker, "__dict__", {}).get("_otr_group_sizes")
    if sizes is not None and uid is not None:
        sizes.pop(_key(uid), None)


def _group_size(worker: Any, uid: object) -> int | None:
    sizes = getattr(worker, "__dict__", {}).get("_otr_group_sizes")
    return None if sizes is None or uid is None else sizes.get(_key(uid))


def _key(value: object) -> object:
    """A uid as a dict key (numpy scalars and strings alike)."""
    return str(scalar(value))


_REMEMBERED_FAILURES = 1024  # exceptions recorded in _agent_loop_postprocess, awaiting _run_agent_loop


@guarded
def failed_session(worker: Any, exc: BaseException, output: Any, validate: object,
                   sample: Mapping[str, object], *, stage: str) -> int:
    """Record a session whose agent loop (``stage="agent_loop"``) or post-processing
    (``"postprocess"``: verl scores the reward there, and puts the session into TransferQueue) raised:
    one error episode carrying the exception, with the id, group and metadata its session would
    have had, the prompt, and the response when the agent loop returned one (``output``). verl
    logs the error and marks the whole prompt failed; the failed member still counts in its group
    (``rl.group.size``, ``rl.group.lost``). Returns 1, or 0 when already recorded (an exception
    of ``_agent_loop_postprocess`` passes through ``_run_agent_loop`` too)."""
    seen = worker.__dict__.setdefault("_otr_failed", {})
    if seen.get(id(exc)) is exc:
        del seen[id(exc)]
        return 0
    if stage == "postprocess":
        seen[id(exc)] = exc
        while len(seen) > _REMEMBERED_FAILURES:
            seen.pop(next(iter(seen)))
    check_release(_FRAMEWORK, "verl", _verl.TESTED)
    _ensure_configured()
    _describe(getattr(worker, "config", None))
    from otel_rollouts import episode

    step, session, uid = field(sample, "global_steps"), field(sample, "session_id"), field(sample, "uid")
    split = "eval" if validate else "train"
    step = int(step) if step is not None else None  # None: otel_rollouts' current step
    outputs = list(output) if isinstance(output, (list, tuple)) else [output] if output is not None else []
    final = outputs[-1] if outputs else None
    extra = dict(getattr(final, "extra_fields", None) or {})
    index, source = field(sample, "index"), field(sample, "data_source")
    metadata: dict[str, object] = {"sample_index": scalar(index), "rollout_n": scalar(session),
                                   "validate": split == "eval", "failed_in": stage}
    if source is not None:
        metadata["data_source"] = str(source)
    for name in _verl._METADATA_COLUMNS:
        if isinstance(extra.get(name), (int, float, str)):
            metadata[name] = extra[name]
    group = str(scalar(uid)) if uid is not None else None
    known = group is not None and step is not None and session is not None
    ep = episode(step=step, split=split, group_id=group,
                 sample_index=int(session) if session is not None else None,
                 episode_id=f"{split}-{step}-{group}-{session}" if known else None,
                 dataset_name=str(source) if source is not None else None, dataset_index=scalar(index),
                 framework=_FRAMEWORK, metadata={k: v for k, v in metadata.items() if v is not None})
    ep.__enter__()
    try:
        size = _group_size(worker, uid)
        if size:
            ep.set_attribute(c.RL_GROUP_EXPECTED_SIZE, size)
        version = extra.get("max_global_steps")
        set_policy(ep, version, step - 1 if split == "train" and step is not None else None)
        tokenizer = getattr(worker, "tokenizer", None)
        prompt = field(sample, "raw_prompt")
        prompt = to_list(prompt) if prompt is not None else None
        if prompt:
            ep.prompt(prompt)
        elif final is not None and tokenizer is not None:
            ep.prompt(lazy_text(tokenizer, list(final.prompt_ids)))
        if final is not None:
            turns_from_mask(ep, list(final.response_ids), list(final.response_mask), tokenizer)
            if final.num_turns:
                ep.set_attribute(c.RL_TURN_COUNT, int(final.num_turns))
        ep.finish(reason=c.FINISH_ERROR)
    finally:  # closed by the session's exception: rl.status error, the exception on the root
        ep.__exit__(type(exc), exc, exc.__traceback__)
    return 1


@guarded
def observe_session(worker: Any, output: Any, validate: object, sample: Mapping[str, object]) -> int:
    """Record the session ``AgentLoopWorkerTQ._agent_loop_postprocess`` just put into TransferQueue:
    ``output`` (an ``AgentLoopOutput`` or a list; the last one carries the reward), ``sample``: the
    prompt's fields with ``session_id``. Returns how many episodes (0 or 1)."""
    check_release(_FRAMEWORK, "verl", _verl.TESTED)
    _ensure_configured()
    _describe(getattr(worker, "config", None))
    outputs = list(output) if isinstance(output, (list, tuple)) else [output]
    if not outputs:
        return 0
    if len(outputs) > 1:
        warn_unknown(_FRAMEWORK, "AgentLoopOutput", f"{len(outputs)} outputs for one session: the last one "
                     "is recorded")
    final = outputs[-1]
    step, session = field(sample, "global_steps"), field(sample, "session_id")
    if step is None or session is None:
        warn_unknown(_FRAMEWORK, "global_steps", "the session has no global_steps or session_id: not recorded")
        return 0
    import numpy as np
    import torch

    prompt_ids = torch.tensor(list(final.prompt_ids), dtype=torch.int64)[None]
    response_ids = torch.tensor(list(final.response_ids), dtype=torch.int64)[None]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    tensors = {"prompts": prompt_ids, "responses": response_ids, "input_ids": input_ids,
               "attention_mask": torch.ones_like(input_ids),
               "response_mask": torch.tensor(list(final.response_mask), dtype=torch.int64)[None]}
    logprobs = getattr(final, "response_logprobs", None)  # the engine's (as_dict: rollout_log_probs)
    if logprobs is not None and len(logprobs) == response_ids.shape[1]:
        tensors["rollout_log_probs"] = torch.tensor(list(logprobs), dtype=torch.float32)[None]
    elif logprobs is not None:
        warn_unknown(_FRAMEWORK, "response_logprobs", f"{len(logprobs)} logprobs for {response_ids.shape[1]} "
                     "response tokens: not recorded")
    if final.reward_score is not None:  # as AgentLoopOutput.as_dict: the score on the last token
        rm_scores = torch.zeros(response_ids.shape, dtype=torch.float32)
        rm_scores[0, -1] = float(final.reward_score)
        tensors["rm_scores"] = rm_scores
    else:
        warn_unknown(_FRAMEWORK, "rm_scores", "the session has no reward (a colocated reward model scores "
                     "it later, from TransferQueue): episodes carry no rl.reward.score")
    extra = dict(getattr(final, "extra_fields", None) or {})
    reward_info = extra.get("reward_extra_info") or {}
    columns: dict[str, Sequence[object]] = {"uid": [field(sample, "uid")], "index": [field(sample, "index")],
                               _verl.ROLLOUT_N_COLUMN: [int(session)], "__num_turns__": [final.num_turns]}
    if field(sample, "data_source") is not None:
        columns["data_source"] = [field(sample, "data_source")]
    for name in ("min_global_steps", "max_global_steps", *_verl._METADATA_COLUMNS):
        if extra.get(name) is not None:
            columns[name] = [extra[name]]
    for name, value in reward_info.items():
        columns.setdefault(name, [value])
    metrics = getattr(final, "metrics", None)  # the session's AgentLoopMetrics (seconds per stage)
    if metrics is not None:
        for name, values in _verl.stage_columns([metrics]).items():
            columns.setdefault(name, values)
    non_tensor = {name: np.array(values, dtype=object) for name, values in columns.items()}
    meta = {"validate": bool(validate), "reward_extra_keys": list(reward_info)}
    return _verl.record_batch({"batch": tensors, "non_tensor_batch": non_tensor, "meta_info": meta},
                              step=int(step), tokenizer=worker.tokenizer,
                              split="eval" if validate else "train",
                              group_size=_group_size(worker, field(sample, "uid"))) or 0


_KEPT_METRICS = 8  # generations whose per-sample metrics wait for observe (normally 1)


@guarded
def _keep_sample_metrics(manager: object, metrics: Iterable[Iterable[object]], output: object) -> None:
    """Keep the per-sample ``AgentLoopMetrics`` dumps of one generation, flattened in the output's
    order (``DataProto.concat`` of the chunks), keyed by the output object until ``observe``
    takes them; bounded (the oldest dropped) should ``observe`` never run for some."""
    kept = manager.__dict__.setdefault("_otr_sample_metrics", {})
    kept[id(output)] = [m for chunk in metrics for m in chunk]
    while len(kept) > _KEPT_METRICS:
        kept.pop(next(iter(kept)))


def _sample_metrics(manager: object, output: object) -> list[object] | None:
    kept = getattr(manager, "__dict__", {}).get("_otr_sample_metrics")
    return None if not kept else kept.pop(id(output), None)


async def _record_when_done(manager: object, prompts: object, pending: Awaitable[object]) -> object:
    try:
        output = await pending
    except Exception as exc:
        generation_failed(manager, prompts, exc)
        raise
    observe(manager, prompts, output)
    return output


COUNT_GENERATION_FAILED = "adapters.verl.generation_failed"
"""``otr.stats()`` counter: samples of a batch ``AgentLoopManager.generate_sequences`` raised on
(one agent loop, reward or worker failed: verl returns none of the batch's samples)."""


@guarded
def generation_failed(manager: object, prompts: object, exc: BaseException) -> int:
    """The batch trainer's ``generate_sequences`` raised: verl's ``AgentLoopWorker`` gathers its
    samples without ``return_exceptions``, so one failed agent loop or reward loses the whole
    batch and no output says which sample failed. Its samples are counted
    (``COUNT_GENERATION_FAILED``, per step and split) and the failure reported once; returns
    how many."""
    meta = field(prompts, "meta_info", default={}) or {}
    step = field(meta, "global_steps")
    split = "eval" if field(meta, "validate") is True else "train"
    inputs = field(prompts, "non_tensor_batch", default={}) or {}
    index = _verl._dataset_index(inputs)
    size = len(index) if index is not None else 0
    _ensure_configured()
    count(COUNT_GENERATION_FAILED, size, step=int(step) if step is not None else None, split=split)
    if first_time(COUNT_GENERATION_FAILED):
        logger.warning("otel_rollouts: verl's generate_sequences raised %s: the batch's %d samples are not "
                       "recorded (counted %s in otr.stats())", exception_text(exc), size, COUNT_GENERATION_FAILED)
    return size


@guarded
def observe(manager: object, prompts: object, output: object) -> int:
    """Record the batch ``output`` the agent loop generated for ``prompts``; returns how many
    episodes. ``manager``: verl's agent-loop manager (its ``config`` and workers)."""
    check_release(_FRAMEWORK, "verl", _verl.TESTED)
    _ensure_configured()
    inputs = field(prompts, "non_tensor_batch", default={}) or {}
    meta = field(prompts, "meta_info", default={}) or {}
    step = field(meta, "global_steps")
    if step is None:
        warn_unknown(_FRAMEWORK, "global_steps", "the generation batch has no meta_info['global_steps']: "
                     "not recorded")
        return 0
    step = int(step)
    validate = field(meta, "validate") is True
    split = "eval" if validate else "train"
    config = getattr(manager, "config", None)
    _describe(config)
    workers = len(getattr(manager, "agent_loop_workers", None) or []) or _config(
        config, "actor_rollout_ref", "rollout", "agent", "num_workers")
    index = _verl._dataset_index(inputs)
    tensors = field(output, "batch")
    produced = field(output, "non_tensor_batch", default={}) or {}
    if tensors is None or index is None:
        return 0
    size = int(tensors["responses"].shape[0])
    if len(index) != size:
        warn_unknown(_FRAMEWORK, "generate_sequences", f"{size} outputs for {len(index)} prompts: not recorded")
        return 0
    import numpy as np

    columns: dict[str, Sized] = {}
    for name in list(inputs.keys()) + list(produced.keys()):  # outputs win (the non-reward-loop layout)
        source = produced if name in produced else inputs
        columns[name] = source[name]
    columns[_verl.ROLLOUT_N_COLUMN] = np.asarray(_verl.rollout_numbers(index, workers), dtype=np.int64)
    sample_metrics = _sample_metrics(manager, output)
    if sample_metrics is not None and len(sample_metrics) == size:
        for name, values in _verl.stage_columns(sample_metrics).items():
            columns.setdefault(name, np.asarray(values, dtype=object))
    keep = _samples(columns, size, _repeats(config, validate))
    out_meta = dict(field(output, "meta_info", default={}) or {})
    batch_meta: dict[str, object] = {"validate": validate}
    if out_meta.get("reward_extra_keys") is not None:
        batch_meta["reward_extra_keys"] = out_meta["reward_extra_keys"]
    if "rm_scores" not in tensors.keys():
        warn_unknown(_FRAMEWORK, "rm_scores", "the generated batch has no reward (a colocated reward model "
                     "scores it later): episodes carry no rl.reward.score; the record_batch line records them")
    names = [k for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "rm_scores",
                         "rollout_log_probs") if k in tensors.keys()]
    if len(keep) == size:
        batch_tensors = {k: tensors[k] for k in names}
        non_tensor = columns
    else:
        import torch

        rows = torch.as_tensor(keep, dtype=torch.long)
        batch_tensors = {k: tensors[k][rows.to(tensors[k].device)] for k in names}
        non_tensor = {k: np.asarray(v)[keep] for k, v in columns.items() if len(v) == size}
    tokenizer = _tokenizer(manager)
    _close_earlier_steps(manager, step, split)
    return _verl.record_batch({"batch": batch_tensors, "non_tensor_batch": non_tensor, "meta_info": batch_meta},
                              step=step, tokenizer=tokenizer, split=split,
                              group_size=_repeats(config, validate)) or 0


# verl's advantage estimators that name another algorithm (GAE is PPO's)
_ALGORITHM_OF = {"gae": "ppo"}


def _describe(config: object) -> None:
    """The run as verl's configuration describes it: the algorithm (``algorithm.adv_estimator``)
    and the policy model (``actor_rollout_ref.model.path``)."""
    estimator = _config(config, "algorithm", "adv_estimator")
    if estimator is not None:
        estimator = str(estimator).lower()
        estimator = _ALGORITHM_OF.get(estimator, estimator)
    describe_framework(_FRAMEWORK, "verl", algorithm=estimator,
                       model_name=_config(config, "actor_rollout_ref", "model", "path"))


def _config(config: object, *path: str) -> Any:
    node = config
    for key in path:
        if node is None:
            return None
        try:
            node = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
        except Exception:  # noqa: BLE001 - an OmegaConf struct without the key
            return None
    return node


def _repeats(config: object, validate: bool) -> int | None:
    """Samples per prompt: ``rollout.n`` (``val_kwargs.n`` for validation)."""
    path = ("actor_rollout_ref", "rollout", "val_kwargs", "n") if validate else ("actor_rollout_ref", "rollout", "n")
    value = _config(config, *path)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _samples(columns: Mapping[str, object], size: int, repeats: int | None) -> list[int]:
    """Rows that are samples: not REMAX's greedy baselines (``__do_sample__`` false) and not the
    copies ``pad_dataproto_to_divisor`` appends (a uid past its ``repeats`` samples)."""
    do_sample = to_list(columns.get("__do_sample__"))
    uid = to_list(columns.get("uid"))
    seen: dict[object, int] = {}
    keep = []
    for i in range(size):
        if do_sample is not None and i < len(do_sample) and not bool(do_sample[i]):
            continue
        if uid is not None and repeats and i < len(uid):
            seen[uid[i]] = seen.get(uid[i], 0) + 1
            if seen[uid[i]] > repeats:
                continue
        keep.append(i)
    return keep


def _tokenizer(manager: Any) -> object:
    """The policy's tokenizer, loaded once as verl's workers load it (``tokenizer_path``, else the
    model ``path``; ``custom_chat_template``)."""
    tok = getattr(manager, "_otr_tokenizer", None)
    if tok is not None:
        return tok
    model = _config(getattr(manager, "config", None), "actor_rollout_ref", "model")
    path = _config(model, "tokenizer_path") or _config(model, "path")
    from verl.utils import hf_tokenizer
    from verl.utils.fs import copy_to_local

    tok = hf_tokenizer(copy_to_local(path), trust_remote_code=bool(_config(model, "trust_remote_code")))
    template = _config(model, "custom_chat_template")
    if template is not None:
        tok.chat_template = template
    manager._otr_tokenizer = tok
    return tok


def _close_earlier_steps(manager: Any, step: int, split: str) -> None:
    """``otr.end_step`` for the (step, split) pairs recorded before this one (validation runs
    over several batches of one step; a step is closed when another one starts)."""
    from otel_rollouts import end_step

    current = (step, split)
    open_steps = getattr(manager, "_otr_open_steps", None)
    if open_steps is None:
        open_steps = manager._otr_open_steps = []
    for pair in [p for p in open_steps if p != current]:
        end_step(pair[0], split=pair[1])
        open_steps.remove(pair)
    if current not in open_steps:
        open_steps.append(current)


def _ensure_configured() -> None:
    """The trainer runs in a Ray actor: configure otel_rollouts there from the environment
    (``OTEL_*`` / ``OTEL_ROLLOUTS_*``) when nothing did."""
    if current_instance() is None:
        from otel_rollouts import configure

        configure()
