"""Tinker's preference, multiplayer and prompt-only distillation groups, made by the cookbook's
own environments (0.6.1) and recorded as linked episodes (``adapters._tinker_kinds``).

* preference: ``PairwisePreferenceGroupBuilder`` (``rl/preference_envs.py``) with its own
  ``compute_group_rewards``; the preference model is a scripted ``PreferenceModel`` subclass
  (prefers the shorter answer), wrapped in ``PreferenceVerdicts``;
* multiplayer: ``TwoPlayerEnvGroupBuilder`` (``recipes/multiplayer_rl/text_arena``) playing
  TextArena's real ``TicTacToe-v0`` in self-play;
* distillation: ``PromptOnlyEnv`` (``distillation/datasets.py``) in a ``ProblemGroupBuilder``,
  scored by the cookbook's own ``incorporate_kl_penalty`` against a scripted teacher client
  (``compute_logprobs(...).coroutine()`` for 0.6, ``compute_logprobs_async`` for 0.5, as
  Tinker's ``SamplingClient``), wrapped in
  ``TeacherLogprobs``.

The policy is ``FixedTokens`` (test_real_tinker.py): the token ids of fixed texts.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial

import pytest
from adapter_fixtures import episodes, messages_of
from frameworks import require
from test_real_tinker import fixed_tokens, renderer, rollout, tok, wrapped  # noqa: F401

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import _tinker_kinds as kinds
from otel_rollouts.adapters.tinker import (
    PreferenceVerdicts,
    TeacherLogprobs,
    record_trajectory_groups,
)


def links(span):
    return {(link.context.trace_id, link.attributes[c.RL_LINK_KIND]) for link in span.links}


def trace_of(ep):
    return ep["spans"][0].context.trace_id


# --- preference --------------------------------------------------------------------------------
def preference_group(tok, renderer, answers, pattern="all_pairs_both_ways"):  # noqa: F811
    pe = require("tinker_cookbook.rl.preference_envs")
    ptypes = require("tinker_cookbook.preference.types")
    renderers = require("tinker_cookbook.renderers")

    class Shorter(ptypes.PreferenceModel):
        """1.0 when B (the second answer) is shorter, −1.0 when longer, 0 for a tie."""

        async def __call__(self, comparison):
            a = len(renderers.get_text_content(comparison.completion_A[0]))
            b = len(renderers.get_text_content(comparison.completion_B[0]))
            return 0.0 if a == b else (1.0 if b < a else -1.0)

    verdicts = PreferenceVerdicts(Shorter())
    builder = pe.PairwisePreferenceGroupBuilder(
        convo_prefix=[{"role": "user", "content": "Name a colour."}], policy_renderer=renderer,
        tournament_pattern=pe.TournamentPattern(pattern), preference_model=verdicts,
        num_envs=len(answers))
    return builder, rollout(builder, fixed_tokens(tok, answers)), verdicts


@pytest.mark.matrix
def test_preference_pair_is_linked_both_ways_with_verdicts(tok, renderer, memory):  # noqa: F811
    builder, group, verdicts = preference_group(
        tok, renderer, ["The colour I name is red<|im_end|>", "Blue<|im_end|>"])
    # the cookbook's own scores: the shorter answer won both matchups
    assert group.final_rewards_G == [-1.0, 1.0]
    assert [m["win_minus_loss"] for m in group.metrics_G] == [-1.0, 1.0]
    record_trajectory_groups([wrapped(group, builder, 0)], step=0, tokenizer=tok,
                             preference_verdicts=verdicts)
    otr.flush()

    eps = episodes(memory)
    long, short = eps["train:0:0:0"], eps["train:0:0:1"]
    for me, other in ((long, short), (short, long)):
        (reward,) = me["by_kind"]["reward"]
        attrs = reward.attributes
        assert list(attrs[c.RL_PREFERENCE_OPPONENT_TRACE_IDS]) == [f"{trace_of(other):032x}"]
        assert list(attrs[c.RL_PREFERENCE_OPPONENT_EPISODE_IDS]) == [other["root"][c.RL_EPISODE_ID]]
        assert links(reward) == {(trace_of(other), c.LINK_OPPONENT)}
        assert attrs[c.RL_PREFERENCE_PATTERN] == "all_pairs_both_ways"
        assert me["root"][c.RL_COMPANIONS_ID] == other["root"][c.RL_COMPANIONS_ID]
    # matchups (0 vs 1) and (1 vs 0); the model's verdict is for B, seen here from each side
    assert list(long["by_kind"]["reward"][0].attributes[c.RL_PREFERENCE_VERDICTS]) == [-1.0, -1.0]
    assert list(short["by_kind"]["reward"][0].attributes[c.RL_PREFERENCE_VERDICTS]) == [1.0, 1.0]
    comparisons = json.loads(short["by_kind"]["reward"][0].attributes[c.RL_PREFERENCE_COMPARISONS])
    assert [(x["position"], x["verdict"]) for x in comparisons] == [("B", 1.0), ("A", 1.0)]
    # the reward is the cookbook's, its terms the builder's metrics
    assert short["root"][c.RL_REWARD] == 1.0 and long["root"][c.RL_REWARD] == -1.0
    assert short["root"][c.RL_REWARD_COMPONENT_PREFIX + "win_minus_loss"] == 1.0
    assert short["root"][c.RL_REWARD_COMPONENT_PREFIX + "format"] == 1.0
    msgs = messages_of(memory)
    assert msgs["train:0:0:1"] == [{"role": "user", "content": "Name a colour."},
                                   {"role": "assistant", "content": "Blue"}]


@pytest.mark.matrix
def test_preference_without_verdicts_records_pairs_only(tok, renderer, memory):  # noqa: F811
    builder, group, _ = preference_group(tok, renderer, ["Red<|im_end|>", "Green<|im_end|>", "Blue<|im_end|>"],
                                         pattern="all_pairs_one_way")
    kinds.record_preference_groups([group], step=0, tokenizer=tok, env_group_builders=[builder])
    otr.flush()
    eps = episodes(memory)
    middle = eps["train:0:0:1"]["by_kind"]["reward"][0]
    assert len(middle.links) == 2 and c.RL_PREFERENCE_VERDICTS not in middle.attributes
    entries = json.loads(middle.attributes[c.RL_PREFERENCE_COMPARISONS])
    assert [(x["opponent"], x["position"], x["verdict"]) for x in entries] == [
        ("train:0:0:0", "B", None), ("train:0:0:2", "A", None)]


# --- multiplayer -------------------------------------------------------------------------------
def tictactoe(renderer, self_play=True):  # noqa: F811
    require("textarena")
    arena = require("tinker_cookbook.recipes.multiplayer_rl.text_arena.env")
    return arena.TwoPlayerEnvGroupBuilder(game_name="TicTacToe-v0", renderer=renderer, num_envs=2,
                                          self_play=self_play)


@pytest.mark.matrix
def test_self_play_game_players_are_linked_episodes_with_roles(tok, renderer, memory):  # noqa: F811
    builder = tictactoe(renderer)
    # player 0 takes 4, 2, 6 (a diagonal); player 1 takes 0, 1
    group = rollout(builder, fixed_tokens(tok, ["[4]\n", "[0]\n", "[2]\n", "[1]\n", "[6]\n"]))
    totals = group.get_total_rewards()
    assert totals[0] > totals[1]  # TextArena's verdict: player 0 won
    record_trajectory_groups([wrapped(group, builder, 1)], step=1, tokenizer=tok)
    otr.flush()

    eps = episodes(memory)
    p0, p1 = eps["train:1:0:0"], eps["train:1:0:1"]
    assert p0["root"][c.RL_GAME_ROLE] == "player_0" and p1["root"][c.RL_GAME_ROLE] == "player_1"
    assert p0["root"][c.RL_GAME_ID] == p1["root"][c.RL_GAME_ID] == "train:1:0:game0"
    assert p0["root"][c.RL_COMPANIONS_ID] == p1["root"][c.RL_COMPANIONS_ID]
    for me, other in ((p0, p1), (p1, p0)):
        root = me["spans"][0]
        assert root.parent is None and links(root) == {(trace_of(other), c.LINK_PLAYER)}
        assert list(me["root"][c.RL_GAME_TRACE_IDS]) == [f"{trace_of(other):032x}"]
    assert p0["root"][c.RL_REWARD] == totals[0] and p1["root"][c.RL_REWARD] == totals[1]
    assert p0["root"][c.RL_TURN_COUNT] == 3 and p1["root"][c.RL_TURN_COUNT] == 2
    moves = [m["content"] for m in messages_of(memory)["train:1:0:0"] if m["role"] == "assistant"]
    assert [m.strip() for m in moves] == ["[4]", "[2]", "[6]"]


@pytest.mark.matrix
def test_the_sampler_keeps_a_game_whole(tok, renderer, otr_shutdown):  # noqa: F811
    """Cap 1, top reward: the winner is chosen, the loser comes with it; a second game whose
    players are both below the cap's choice is dropped whole."""
    from adapter_fixtures import configure_memory

    mem = configure_memory(cap=1, policy="top_bottom")
    moves = ["[4]\n", "[0]\n", "[2]\n", "[1]\n", "[6]\n"]
    builders = [tictactoe(renderer), tictactoe(renderer)]
    groups = [wrapped(rollout(b, fixed_tokens(tok, moves)), b, 0) for b in builders]
    record_trajectory_groups(groups, step=0, tokenizer=tok)
    otr.end_step(0)
    otr.flush()
    kept = episodes(mem)
    games = {ep["root"][c.RL_GAME_ID] for ep in kept.values()}
    assert len(games) == 1 and len(kept) == 2, sorted(kept)
    assert {ep["root"][c.RL_GAME_ROLE] for ep in kept.values()} == {"player_0", "player_1"}


@pytest.mark.matrix
def test_game_against_a_fixed_opponent_names_it(tok, renderer, memory):  # noqa: F811
    completers = require("tinker_cookbook.completers")

    class Corner(completers.MessageCompleter):
        def __init__(self):
            self.moves = ["[0]", "[1]", "[3]", "[5]", "[7]"]

        async def __call__(self, messages):
            return {"role": "assistant", "content": self.moves.pop(0)}

    builder = tictactoe(renderer, self_play=False)
    builder.opponent_policy = Corner()
    group = rollout(builder, fixed_tokens(tok, ["[4]\n", "[2]\n", "[6]\n"] * 2))
    kinds.record_multiplayer_groups([wrapped(group, builder, 0)], step=0, tokenizer=tok)
    otr.flush()
    eps = episodes(memory)
    assert len(eps) == 2
    for ep in eps.values():
        assert ep["root"][c.RL_GAME_OPPONENT] == "Corner" and c.RL_COMPANIONS_ID not in ep["root"]
        assert not ep["spans"][0].links
    assert len({ep["root"][c.RL_GAME_ID] for ep in eps.values()}) == 2


# --- prompt-only distillation ------------------------------------------------------------------
class _Future:
    def __init__(self, value):
        self.value = value

    async def coroutine(self):
        return self.value

    def result(self, timeout=None):
        return self.value


class ScriptedTeacher:
    """A teacher ``SamplingClient`` stand-in: log-probability −1.0 for every token but one."""

    def compute_logprobs(self, model_input):
        n = model_input.length
        return _Future([None] + [-1.0] * (n - 1))

    async def compute_logprobs_async(self, model_input):  # what cookbook 0.5 calls
        return self.compute_logprobs(model_input).value


@pytest.mark.matrix
def test_distillation_answer_carries_the_teachers_score(tok, renderer, memory):  # noqa: F811
    datasets = require("tinker_cookbook.distillation.datasets")
    problem_env = require("tinker_cookbook.rl.problem_env")
    on_policy = require("tinker_cookbook.distillation.train_on_policy")
    processing = require("tinker_cookbook.rl.data_processing")

    builder = problem_env.ProblemGroupBuilder(
        env_thunk=partial(datasets.PromptOnlyEnv, "Explain why the sky is blue.", renderer),
        num_envs=2, dataset_name="prompts")
    group = rollout(builder, fixed_tokens(tok, ["Rayleigh scattering.<|im_end|>",
                                                "Because of the air molecules.<|im_end|>"]))
    teacher = TeacherLogprobs(ScriptedTeacher(), name="teacher-8b")
    data, _meta = processing.assemble_training_data([group], processing.compute_advantages([group]))
    metrics = asyncio.run(on_policy.incorporate_kl_penalty(data, [teacher] * len(data), [0] * len(data),
                                                           kl_penalty_coef=1.0, kl_discount_factor=0.0))
    record_trajectory_groups([wrapped(group, builder, 0)], step=0, tokenizer=tok,
                             teacher=teacher, kl_penalty_coef=1.0)
    otr.flush()

    eps = episodes(memory)
    sizes = [len(tr.transitions[0].ac.tokens) for tr in group.trajectories_G]
    kls = []
    for t, size in enumerate(sizes):
        ep = eps[f"train:0:0:{t}"]
        reward = ep["by_kind"]["reward"][0].attributes
        assert reward[c.RL_DISTILL_TEACHER_NAME] == "teacher-8b" and reward[c.RL_DISTILL_KL_COEF] == 1.0
        assert list(reward[c.RL_DISTILL_TEACHER_LOGPROBS]) == [-1.0] * size
        assert list(reward[c.RL_DISTILL_STUDENT_LOGPROBS]) == [-0.25] * size
        assert reward[c.RL_DISTILL_REVERSE_KL] == pytest.approx(0.75)  # −0.25 − (−1.0)
        assert ep["root"][c.RL_DISTILL_REVERSE_KL] == reward[c.RL_DISTILL_REVERSE_KL]
        assert ep["root"][c.RL_REWARD] == 0.0  # PromptOnlyEnv's own reward
        kls.append(reward[c.RL_DISTILL_REVERSE_KL] * size)
    # the cookbook's batch figure is the token-weighted mean of the per-answer scores
    assert metrics["teacher_kl"] == pytest.approx(sum(kls) / sum(sizes))
    answers = [m[-1]["content"] for m in messages_of(memory).values()]
    assert sorted(answers) == ["Because of the air molecules.", "Rayleigh scattering."]


@pytest.mark.matrix
def test_distillation_without_the_teachers_logprobs_records_the_answer(tok, renderer, memory):  # noqa: F811
    datasets = require("tinker_cookbook.distillation.datasets")
    problem_env = require("tinker_cookbook.rl.problem_env")
    builder = problem_env.ProblemGroupBuilder(
        env_thunk=partial(datasets.PromptOnlyEnv, "Say hi.", renderer), num_envs=1)
    group = rollout(builder, fixed_tokens(tok, ["Hi.<|im_end|>"]))
    teacher = TeacherLogprobs(ScriptedTeacher(), name="t")  # never asked (coef 0)
    kinds.record_distillation_groups([group], step=0, tokenizer=tok, teacher=teacher)
    otr.flush()
    (ep,) = episodes(memory).values()
    reward = ep["by_kind"]["reward"][0].attributes
    assert c.RL_DISTILL_REVERSE_KL not in reward and reward[c.RL_DISTILL_TEACHER_NAME] == "t"
    assert ep["root"][c.RL_STATUS] == "ok"


def test_kind_of_tells_the_builders_apart(tok, renderer):  # noqa: F811
    builder, group, _ = preference_group(tok, renderer, ["A<|im_end|>", "B<|im_end|>"])
    assert kinds.kind_of(wrapped(group, builder, 0)) == kinds.PREFERENCE
    assert kinds.kind_of(wrapped(group, tictactoe(renderer), 0)) == kinds.MULTIPLAYER
    assert kinds.kind_of(group) is None and kinds.kind_of(group, teacher=object()) == kinds.DISTILLATION
