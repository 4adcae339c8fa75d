"""The Tinker adapter on data made by tinker-cookbook's own code (0.6.1 and 0.5.8: the version
matrix runs this file with both).

Groups come from ``tinker_cookbook.rl.rollouts.do_group_rollout`` with real environments: the
arithmetic ``ProblemEnv`` of ``recipes/math_rl`` (``ProblemGroupBuilder``) and a tool-using
message env (``tool_use.build_agent_tool_env`` around ``AgentToolMessageEnv``, a ``@tool``
calculator), rendered by ``renderers.get_renderer("qwen3", tokenizer)``. The tokenizer is the
offline byte-level BPE of ``tokenizer_fixture`` (ChatML, ``<|im_end|>`` EOS, Hermes tool tags):
the qwen3 renderer works with it as it is.

The only stand-in is the policy: there is no Tinker sampling server here, so ``FixedTokens`` is
the smallest real ``TokenCompleter`` subclass: it returns the token ids of fixed texts (what a
sampler would have returned) with their stop reason. Everything else — observations, parsing,
tool execution, rewards, metrics, stop reasons — is the cookbook's. Inkling models: the
cookbook's ``TmlRenderersTokenizerAdapter`` around a tokenizer built here with Inkling's markup,
and (when tml-renderers is installed; it ships its vocabulary) the real Inkling tokenizer and
``TmlV0Renderer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial
from typing import Annotated

import pytest
from adapter_fixtures import configure_memory, episodes, messages_of
from frameworks import require
from otr_helpers import trackio_rows, tree
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters.tinker import record_trajectory_groups

MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


# --- the cookbook's objects --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    require("tinker_cookbook.rl.rollouts")
    return build_tokenizer()


@pytest.fixture(scope="module")
def renderer(tok):
    renderers = require("tinker_cookbook.renderers")
    return renderers.get_renderer("qwen3", tok)


def fixed_tokens(tok, texts, stop_reason="stop"):
    """A ``TokenCompleter`` returning the ids of ``texts`` in turn (the sampler's stand-in)."""
    completers = require("tinker_cookbook.completers")

    class FixedTokens(completers.TokenCompleter):
        def __init__(self):
            self.texts = list(texts)

        async def __call__(self, model_input, stop, *, max_tokens=None):
            ids = tok.encode(self.texts.pop(0), add_special_tokens=False)
            return completers.TokensWithLogprobs(ids, [-0.25] * len(ids), stop_reason)

    return FixedTokens()


def rollout(builder, policy):
    rollouts = require("tinker_cookbook.rl.rollouts")
    return asyncio.run(rollouts.do_group_rollout(builder, policy))


def arithmetic_group(tok, renderer, answers):
    """``ArithmeticEnv`` (2 + 2, with the recipe's few-shot prefix), one env per answer."""
    arithmetic = require("tinker_cookbook.recipes.math_rl.arithmetic_env")
    problem_env = require("tinker_cookbook.rl.problem_env")
    builder = problem_env.ProblemGroupBuilder(
        env_thunk=partial(arithmetic.ArithmeticEnv, 2, 2, renderer=renderer,
                          convo_prefix=arithmetic.ArithmeticEnv.standard_fewshot_prefix()),
        num_envs=len(answers), dataset_name="arithmetic",
    )
    return builder, rollout(builder, fixed_tokens(tok, answers))


TOOL_CALL = ('<think>\nI should use the tool.\n</think>\n\n<tool_call>\n{"name": "calculator", '
             '"arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>')


def calculator_builder(renderer):
    """The cookbook's ``build_agent_tool_env`` with a calculator ``@tool`` asked 17 * 23, graded
    by a ``reward_fn``: one env per group."""
    types = require("tinker_cookbook.rl.types")
    tools = require("tinker_cookbook.tool_use.tools")
    agent = require("tinker_cookbook.tool_use.agent_tool_message_env")

    @tools.tool
    async def calculator(expression: Annotated[str, "an arithmetic expression"]):
        """Evaluate an arithmetic expression."""
        a, b = expression.split("*")
        return tools.simple_tool_result(str(int(a) * int(b)))

    async def reward_fn(history):
        correct = float("391" in str(history[-1]["content"]))
        return correct, {"correct": correct}

    class CalculatorGroup(types.EnvGroupBuilder):
        async def make_envs(self):
            return [agent.build_agent_tool_env(
                renderer, [calculator],
                [{"role": "system", "content": "Use the calculator tool."},
                 {"role": "user", "content": "What is 17 * 23?"}],
                reward_fn, max_turns=3)]

        def logging_tags(self):
            return ["calculator"]

    return CalculatorGroup()


def assert_calculator_episode(ep):
    """The calculator episode's tree (a turn with its ``execute_tool``, then the answer) and its
    one tool call, whose result is 391; returns the call's span."""
    assert tree(ep["spans"]) == [
        (0, "episode"), (1, "prompt"), (1, "turn"), (2, "chat"), (2, "execute_tool calculator"),
        (1, "turn"), (2, "chat"), (1, "reward")]
    (call,) = ep["by_kind"]["tool"]
    assert call.attributes[c.GEN_AI_TOOL_CALL_RESULT] == "391"
    return call


def tool_group(tok, renderer, texts, stop_reason="stop"):
    builder = calculator_builder(renderer)
    return builder, rollout(builder, fixed_tokens(tok, texts, stop_reason))


def wrapped(group, builder, sampling_client_step):
    train = require("tinker_cookbook.rl.train")
    return train.WrappedTrajectoryGroup(trajectory_group=group, env_group_builder=builder,
                                        sampling_client_step=sampling_client_step)


def all_text(messages):
    return repr(messages)


# --- rewards -----------------------------------------------------------------------------------
@pytest.mark.matrix
def test_problem_env_reward_terms_are_its_metrics_not_its_coefficients(tok, renderer, memory):
    """Regression: ``format_coef`` and other numbers were recorded as reward components while
    ProblemEnv's real terms (``metrics`` ``format`` and ``correct``) were dropped."""
    builder, group = arithmetic_group(tok, renderer, ["The answer is 4<|im_end|>",
                                                      "The answer is 5<|im_end|>"])
    assert [tr.transitions[0].metrics for tr in group.trajectories_G] == [
        {"format": 1.0, "correct": 1.0}, {"format": 1.0, "correct": 0.0}]  # the cookbook's own
    record_trajectory_groups([wrapped(group, builder, 0)], step=0, tokenizer=tok)
    otr.flush()

    eps = episodes(memory)
    right, wrong = eps["train:0:0:0"]["root"], eps["train:0:0:1"]["root"]
    assert right[c.RL_REWARD] == 1.0 and wrong[c.RL_REWARD] == 0.0
    assert right[c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 1.0 and wrong[c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 0.0
    assert right[c.RL_REWARD_COMPONENT_PREFIX + "format"] == 1.0
    rewards = {k for k in right if k.startswith(c.RL_REWARD_COMPONENT_PREFIX)}
    assert rewards == {c.RL_REWARD_COMPONENT_PREFIX + k for k in ("correct", "format", "transitions", "final")}
    # the metrics stay readable as the step's diagnostics
    assert json.loads(right[c.RL_METADATA_PREFIX + "steps"])[0]["metrics"] == {"format": 1.0, "correct": 1.0}
    assert list(right[c.RL_METADATA_PREFIX + "tags"]) == ["arithmetic"] and right[c.RL_TURN_COUNT] == 1


@pytest.mark.matrix
def test_tool_env_diagnostic_metrics_are_not_rewards(tok, renderer, memory):
    builder, group = tool_group(tok, renderer, [TOOL_CALL, "The answer is 391.<|im_end|>"])
    last = group.trajectories_G[0].transitions[-1]
    assert last.metrics == {"stop/completed": 1.0, "correct": 1.0}
    record_trajectory_groups([group], step=0, tokenizer=tok)
    otr.flush()
    (ep,) = episodes(memory).values()
    root = ep["root"]
    assert root[c.RL_REWARD] == 1.0 and root[c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 1.0
    assert not any("stop/" in k for k in root if k.startswith(c.RL_REWARD_COMPONENT_PREFIX))
    assert root[c.RL_FINISH_REASON] == "completed" and root[c.RL_STATUS] == "ok"
    assert root[c.RL_TURN_COUNT] == 2


# --- text --------------------------------------------------------------------------------------
@pytest.mark.matrix
@pytest.mark.parametrize("how", ["tokenizer", "renderer"])
def test_rendered_prompt_is_split_and_turns_carry_no_markup(tok, renderer, memory, how):
    """Regression: the prompt was one user message holding the whole rendered template, and the
    assistant turn ended with ``<|im_end|>``."""
    builder, group = arithmetic_group(tok, renderer, ["<think>\nadd them\n</think>\n\nThe answer is 4<|im_end|>"])
    kwargs = {"tokenizer": tok} if how == "tokenizer" else {"renderer": renderer}
    record_trajectory_groups([group], step=1, **kwargs)
    otr.flush()

    (msgs,) = messages_of(memory).values()
    assert [(m["role"], m["content"]) for m in msgs[:3]] == [
        ("user", "What is 4 + 5?"), ("assistant", "9"), ("user", "What is 2 + 2?")]
    assert msgs[3]["role"] == "assistant" and msgs[3]["content"].endswith("The answer is 4")
    assert "add them" in msgs[3]["content"]  # the model's reasoning is its output, kept
    assert not any(m in all_text(msgs) for m in MARKUP)
    (ep,) = episodes(memory).values()
    chat = ep["by_kind"]["generation"][0].attributes
    assert chat[c.GEN_AI_USAGE_OUTPUT_TOKENS] == len(group.trajectories_G[0].transitions[0].ac.tokens)


@pytest.mark.matrix
@pytest.mark.parametrize("how", ["tokenizer", "renderer"])
def test_tool_call_in_the_action_becomes_execute_tool_with_its_result(tok, renderer, otr_shutdown, how):
    """Regression: a ``<tool_call>`` in the action was not recognised: no ``execute_tool`` span,
    the tool result lost, Trackio showed user, assistant, assistant."""
    project = f"real-tinker-tool-{how}"
    mem = configure_memory(trackio_project=project)
    builder, group = tool_group(tok, renderer, [TOOL_CALL, "The answer is 391.<|im_end|>"])
    kwargs = {"tokenizer": tok} if how == "tokenizer" else {"renderer": renderer}
    record_trajectory_groups([wrapped(group, builder, 2)], step=2, **kwargs)
    otr.flush()

    (ep,) = episodes(mem).values()
    call = assert_calculator_episode(ep)
    assert "17 * 23" in str(call.attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS])

    (row,) = trackio_rows(project)
    msgs = row["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert msgs[3]["content"] == "391" and msgs[3]["tool_call_id"] == msgs[2]["tool_calls"][0]["id"]
    assert msgs[4]["content"] == "The answer is 391."
    assert not any(m in all_text(msgs) for m in MARKUP) and "tool_response" not in all_text(msgs)


@pytest.mark.matrix
def test_user_feedback_after_a_turn_keeps_its_role(tok, renderer, memory):
    """A wrong answer, then a retry: the env's user message between the turns stays ``user``."""
    message_env = require("tinker_cookbook.rl.message_env")
    types = require("tinker_cookbook.rl.types")

    class Retry(message_env.MessageEnv):
        def __init__(self):
            self.history = [{"role": "user", "content": "What is 2 + 2?"}]

        async def initial_observation(self):
            return list(self.history)

        async def step(self, message):
            self.history.append(message)
            done = "4" in message["content"]
            if not done:
                self.history.append({"role": "user", "content": "Please retry: try again."})
            return message_env.MessageStepResult(reward=float(done), episode_done=done,
                                                 next_messages=list(self.history))

    class Builder(types.EnvGroupBuilder):
        async def make_envs(self):
            return [message_env.EnvFromMessageEnv(renderer, Retry())]

    group = rollout(Builder(), fixed_tokens(tok, ["The answer is 5<|im_end|>", "The answer is 4<|im_end|>"]))
    record_trajectory_groups([group], step=0, tokenizer=tok)
    otr.flush()
    (msgs,) = messages_of(memory).values()
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("user", "What is 2 + 2?"), ("assistant", "The answer is 5"),
        ("user", "Please retry: try again."), ("assistant", "The answer is 4")]


@pytest.mark.matrix
def test_length_stop_is_a_truncated_episode(tok, renderer, memory):
    """``EnvFromMessageEnv`` ends the episode on a sampler ``length`` stop (max_tokens_reached)."""
    builder, group = tool_group(tok, renderer, ["The answer is"], stop_reason="length")
    assert group.trajectories_G[0].stop_reason == "max_tokens"
    record_trajectory_groups([group], step=0, tokenizer=tok)
    otr.flush()
    (ep,) = episodes(memory).values()
    assert ep["root"][c.RL_STATUS] == "truncated" and ep["root"][c.RL_FINISH_REASON] == "length"
    assert ep["root"][c.RL_REWARD] == -0.1  # the env's context_overflow_reward


@pytest.mark.matrix
@pytest.mark.parametrize("how", ["tokenizer", "renderer"])
def test_unparsable_tool_call_is_a_parse_error_and_its_text_stays(tok, renderer, memory, how):
    builder, group = tool_group(tok, renderer, ['<tool_call>\n{"name": broken</tool_call><|im_end|>'])
    assert group.trajectories_G[0].stop_reason == "parse_error"  # AgentToolMessageEnv's verdict
    kwargs = {"tokenizer": tok} if how == "tokenizer" else {"renderer": renderer}
    record_trajectory_groups([group], step=0, **kwargs)
    otr.flush()
    (ep,) = episodes(memory).values()
    root = ep["root"]
    assert root[c.RL_STATUS] == "error" and root[c.RL_FINISH_REASON] == "parse_error"
    assert root[c.RL_TOOL_PARSE_ERROR] and not ep["by_kind"]["tool"]
    (msgs,) = messages_of(memory).values()
    assert msgs[-1]["role"] == "assistant" and '"name": broken' in msgs[-1]["content"]


@pytest.mark.matrix
def test_rollout_summary_records_with_a_tokenizer_do_not_ask_for_one(tok, renderer, memory):
    """Regression: summary records (lengths, no token ids) said "pass tokenizer= to decode"
    although a tokenizer was passed."""
    logging_mod = require("tinker_cookbook.rl.rollout_logging")
    builder, group = arithmetic_group(tok, renderer, ["The answer is 4<|im_end|>"])
    records = logging_mod.serialize_rollout_summaries(
        split="train", iteration=3, trajectory_groups_P=[group], taglist_P=[builder.logging_tags()],
        sampling_client_steps_P=[3])
    record_trajectory_groups(records, step=3, tokenizer=tok)
    otr.flush()
    (ep,) = episodes(memory).values()
    assert "pass tokenizer" not in repr(messages_of(memory))
    root = ep["root"]
    assert root[c.RL_REWARD] == 1.0 and root[c.RL_REWARD_COMPONENT_PREFIX + "correct"] == 1.0
    assert root[c.RL_POLICY_VERSION] == 3 and root[c.RL_STALENESS] == 0
    chat = ep["by_kind"]["generation"][0].attributes
    assert chat[c.GEN_AI_USAGE_INPUT_TOKENS] == group.trajectories_G[0].transitions[0].ob.length


# --- policy version and staleness --------------------------------------------------------------
@pytest.mark.matrix
def test_policy_version_and_staleness(tok, renderer, memory):
    """``sampling_client_step`` = the iteration whose weights sampled; trained at ``step``:
    staleness = step − sampling_client_step (the cookbook's ``async/staleness``), 0 on-policy;
    in optimizer updates (× ``num_substeps``); eval samples are not trained: no staleness."""
    builder, group = arithmetic_group(tok, renderer, ["The answer is 4<|im_end|>"])
    record_trajectory_groups([wrapped(group, builder, 3)], step=3, tokenizer=tok)  # sync: on-policy
    record_trajectory_groups([wrapped(group, builder, 3)], step=5, tokenizer=tok)  # async, 2 behind
    record_trajectory_groups([wrapped(group, builder, 3)], step=4, tokenizer=tok, num_substeps=2)
    record_trajectory_groups([wrapped(group, builder, 3)], step=3, split="eval/arithmetic",
                             tokenizer=tok)
    otr.flush()
    eps = episodes(memory)
    on, off = eps["train:3:0:0"]["root"], eps["train:5:0:0"]["root"]
    assert on[c.RL_POLICY_VERSION] == 3 and on[c.RL_STALENESS] == 0
    assert off[c.RL_POLICY_VERSION] == 3 and off[c.RL_STALENESS] == 2
    sub = eps["train:4:0:0"]["root"]
    assert sub[c.RL_POLICY_VERSION] == 6 and sub[c.RL_STALENESS] == 2
    ev = eps["eval/arithmetic:3:0:0"]["root"]
    assert ev[c.RL_POLICY_VERSION] == 3 and c.RL_STALENESS not in ev


# --- structures the adapter does not know ------------------------------------------------------
def test_unknown_stop_reason_and_group_shape_are_warned(tok, renderer, memory, caplog, monkeypatch):
    import dataclasses

    builder, group = arithmetic_group(tok, renderer, ["The answer is 4<|im_end|>"])
    odd = dataclasses.replace(group.trajectories_G[0], stop_reason="asked_to_stop_by_judge")
    group.trajectories_G[0] = odd
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        record_trajectory_groups([group, object()], step=0, tokenizer=tok)
        record_trajectory_groups([group], step=1, tokenizer=tok)
    otr.flush()
    warnings = [r.getMessage() for r in caplog.records if "adapters.tinker" in r.getMessage()]
    assert len([w for w in warnings if "Trajectory.stop_reason" in w]) == 1  # once per field
    assert any("trajectory_group" in w for w in warnings)
    root = episodes(memory)["train:0:0:0"]["root"]
    assert root[c.RL_FINISH_REASON] == "asked_to_stop_by_judge" and root[c.RL_STATUS] == "ok"
    assert otr.stats()["totals"]["adapters.unknown_structure"] >= 3


# --- tool markers that the tokenizer marks special ---------------------------------------------
@pytest.fixture(scope="module")
def special_tags_tok():
    """The test tokenizer with ``<tool_call>``/``<tool_response>`` as special tokens (as some
    Qwen/Hermes vocabularies flag them)."""
    require("tinker_cookbook.rl.rollouts")
    from tokenizer_fixture import TOOL_TAGS

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *TOOL_TAGS]})
    assert set(TOOL_TAGS) <= set(tok.all_special_tokens)
    return tok


@pytest.mark.matrix
@pytest.mark.parametrize("how", ["tokenizer", "renderer"])
def test_tool_markers_that_are_special_tokens_still_give_tool_calls_and_results(special_tags_tok, otr_shutdown,
                                                                                how):
    """Regression: special tokens were removed before the tool markers were parsed: the
    ``<tool_call>`` was lost (no ``execute_tool``) and the ``<tool_response>`` became a user
    message; ``renderer=`` did not help."""
    renderers = require("tinker_cookbook.renderers")
    tok = special_tags_tok
    renderer = renderers.get_renderer("qwen3", tok)
    mem = configure_memory()
    builder, group = tool_group(tok, renderer, [TOOL_CALL, "The answer is 391.<|im_end|>"])
    assert group.trajectories_G[0].stop_reason == "completed"  # the cookbook parsed the call
    kwargs = {"tokenizer": tok} if how == "tokenizer" else {"renderer": renderer}
    record_trajectory_groups([wrapped(group, builder, 0)], step=0, **kwargs)
    otr.flush()
    (ep,) = episodes(mem).values()
    assert_calculator_episode(ep)
    (msgs,) = messages_of(mem).values()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[3]["content"] == "391" and "I should use the tool." in msgs[2]["content"]
    assert not any(m in all_text(msgs) for m in (*MARKUP, "tool_call>", "tool_response>"))


# --- Inkling models: get_tokenizer returns TmlRenderersTokenizerAdapter ------------------------
INKLING = "thinkingmachines/Inkling"
INK_SPECIAL = ["endoftext", "begin_of_text", "message_system", "message_user", "message_model", "message_tool",
               "content_text", "content_thinking", "content_invoke_tool_json", "content_model_end_sampling",
               "end_message"]


class InklingMarkupTokenizer:
    """A tml-renderers style tokenizer built here (the interface ``TmlRenderersTokenizerAdapter``
    wraps: ``encode_ordinary``, ``decode``, ``encode_special``, ``special_tokens``): the test's
    byte-level BPE for text, Inkling's ``<|message_*|>``/``<|content_*|>`` special tokens."""

    bos_token, eos_token = "begin_of_text", "endoftext"

    def __init__(self):
        self.bpe = build_tokenizer()
        self.base = 100_000
        self.ids = {name: self.base + i for i, name in enumerate(INK_SPECIAL)}

    def special_tokens(self):
        return list(INK_SPECIAL)

    def encode_special(self, name):
        return self.ids[name]

    def encode_ordinary(self, text):
        return self.bpe.encode(text, add_special_tokens=False)

    def encode(self, text):
        """Text with ``<|name|>`` markup: specials by id, the rest ordinary (the test's helper)."""
        import re

        out = []
        for part in re.split(r"(<\|[a-z_]+\|>)", text):
            name = part[2:-2] if part.startswith("<|") else None
            out += [self.ids[name]] if name in self.ids else self.encode_ordinary(part) if part else []
        return out

    def decode(self, ids):
        text, run = [], []
        for i in list(ids) + [None]:
            if i is None or i >= self.base:
                text.append(self.bpe.decode(run)) if run else None
                run = []
                if i is not None:
                    text.append(f"<|{INK_SPECIAL[i - self.base]}|>")
            else:
                run.append(i)
        return "".join(text)


def inkling_wrapper(tml_tokenizer):
    """The cookbook's own ``TmlRenderersTokenizerAdapter`` (what ``get_tokenizer`` returns for
    Inkling) around ``tml_tokenizer``: 0.6.1 takes the tokenizer; 0.5.8 builds tml-renderers'
    o200k tokenizer itself, so its instance is given the test's one the way its __init__ sets it."""
    import inspect

    tokenizer_utils = require("tinker_cookbook.tokenizer_utils")
    cls = tokenizer_utils.TmlRenderersTokenizerAdapter
    if "tml_tokenizer" in inspect.signature(cls.__init__).parameters:
        return cls(INKLING, tml_tokenizer)
    wrapper = cls.__new__(cls)
    wrapper.name_or_path, wrapper.tml_tokenizer = INKLING, tml_tokenizer
    wrapper.bos_token, wrapper.eos_token = tml_tokenizer.bos_token, tml_tokenizer.eos_token
    wrapper.eos_token_id = tml_tokenizer.encode_special(tml_tokenizer.eos_token)
    return wrapper


def inkling_markup_renderer(tok):
    """A cookbook ``Renderer`` writing Inkling's TMLv0 layout (as ``TmlV0Renderer`` does through
    tml-renderers, which needs its own Rust tokenizer): ``<|message_<author>|>[name]<|content_<kind>|>
    ...<|end_message|>``, ``<|content_model_end_sampling|>`` closing the model's turn."""
    base = require("tinker_cookbook.renderers.base")
    tinker = require("tinker")
    import re

    tml = tok.tml_tokenizer
    authors = {"system": "system", "user": "user", "assistant": "model", "tool": "tool"}

    class InklingMarkup(base.Renderer):
        def get_stop_sequences(self):
            return [tml.encode_special("content_model_end_sampling")]

        def render_message(self, message, ctx):
            raise NotImplementedError("renders whole conversations")

        def build_generation_prompt(self, messages, role="assistant", prefill=None):
            text = ""
            for k, m in enumerate(messages):
                author = authors[m["role"]]
                if m.get("content"):
                    name = m.get("name", "") if m["role"] == "tool" else ""
                    text += f"<|message_{author}|>{name}<|content_text|>{m['content']}<|end_message|>"
                for call in m.get("tool_calls") or []:
                    body = json.dumps({"name": call.function.name, "args": json.loads(call.function.arguments)})
                    text += f"<|message_model|>{call.function.name}<|content_invoke_tool_json|>{body}<|end_message|>"
                nxt = messages[k + 1]["role"] if k + 1 < len(messages) else None
                if m["role"] == "assistant" and nxt != "assistant":
                    text += "<|content_model_end_sampling|>"
            return tinker.ModelInput.from_ints(tml.encode(text))

        def parse_response(self, response):
            text = tml.decode(response)
            calls, content = [], []
            pattern = r"<\|message_model\|>([^<]*)<\|content_(\w+)\|>(.*?)<\|end_message\|>"
            for name, kind, body in re.findall(pattern, text, re.DOTALL):
                if kind == "invoke_tool_json":
                    args = json.loads(body)["args"]
                    calls.append(base.ToolCall(function=base.ToolCall.FunctionBody(
                        name=name, arguments=json.dumps(args)), id=f"functions.{name}:{len(calls)}"))
                else:
                    content.append(body)
            message = {"role": "assistant", "content": "\n".join(content)}
            if calls:
                message["tool_calls"] = calls
            return message, base.ParseTermination.STOP_SEQUENCE

    return InklingMarkup(tok)


INK_CALL = ('<|message_model|><|content_thinking|>I should use the tool.<|end_message|><|message_model|>calculator'
            '<|content_invoke_tool_json|>{"name":"calculator","args":{"expression":"17 * 23"}}<|end_message|>'
            '<|content_model_end_sampling|>')
INK_ANSWER = '<|message_model|><|content_text|>The answer is 391.<|end_message|><|content_model_end_sampling|>'


def real_inkling():
    """The real Inkling tokenizer and renderer (tml-renderers ships its BPE: nothing downloaded)."""
    pytest.importorskip("tml_renderers")
    tokenizer_utils = require("tinker_cookbook.tokenizer_utils")
    renderers = require("tinker_cookbook.renderers")
    tok = tokenizer_utils.get_tokenizer(INKLING)
    import re

    tml = tok.tml_tokenizer

    def encode(text):
        out = []
        for part in re.split(r"(<\|[a-z_0-9]+\|>)", text):
            if part.startswith("<|"):
                out.append(tml.encode_special(part[2:-2]))
            elif part:
                out += list(tml.encode_ordinary(part))
        return out

    return tok, renderers.get_renderer("tml_v0", tok), encode


def inkling_tool_group(tok, renderer, encode, texts):
    completers = require("tinker_cookbook.completers")

    class Fixed(completers.TokenCompleter):
        def __init__(self):
            self.texts = list(texts)

        async def __call__(self, model_input, stop, *, max_tokens=None):
            ids = encode(self.texts.pop(0))
            return completers.TokensWithLogprobs(ids, [-0.25] * len(ids), "stop")

    builder = calculator_builder(renderer)
    return builder, rollout(builder, Fixed())


def assert_inkling_episode(mem, system_messages):
    (ep,) = episodes(mem).values()
    assert_calculator_episode(ep)
    (msgs,) = messages_of(mem).values()
    assert [(m["role"], m["content"]) for m in msgs[: len(system_messages) + 1]] == [
        *(("system", s) for s in system_messages), ("user", "What is 17 * 23?")]
    assert [m["role"] for m in msgs[len(system_messages) + 1:]] == ["assistant", "tool", "assistant"]
    assert msgs[-3]["tool_calls"][0]["function"]["name"] == "calculator"
    assert msgs[-2]["content"] == "391" and msgs[-1]["content"] == "The answer is 391."
    assert "<|" not in all_text(msgs)
    assert ep["root"][c.RL_REWARD] == 1.0


@pytest.mark.matrix
@pytest.mark.parametrize("how", ["tokenizer", "renderer"])
def test_inkling_real_tokenizer_and_renderer(otr_shutdown, how):
    """Regression (real Inkling tokenizer and TmlV0Renderer, offline): the prompt was raw
    ``<|message_*|>`` markup and the tool result was dropped, with or without ``renderer=``."""
    tok, renderer, encode = real_inkling()
    mem = configure_memory()
    builder, group = inkling_tool_group(tok, renderer, encode, [INK_CALL, INK_ANSWER])
    assert group.trajectories_G[0].stop_reason == "completed"
    kwargs = {"tokenizer": tok} if how == "tokenizer" else {"renderer": renderer}
    record_trajectory_groups([wrapped(group, builder, 1)], step=1, **kwargs)
    otr.flush()
    assert_inkling_episode(mem, ["Use the calculator tool.", "Thinking effort level: 0.9"])


@pytest.mark.matrix
def test_inkling_wrapper_with_the_renderer_splits_prompt_and_keeps_tool_results(otr_shutdown):
    """The cookbook's ``TmlRenderersTokenizerAdapter`` around a tokenizer built here, with the
    environment's renderer: the layout is learned from ``renderer.build_generation_prompt``."""
    tok = inkling_wrapper(InklingMarkupTokenizer())
    renderer = inkling_markup_renderer(tok)
    mem = configure_memory()
    builder, group = inkling_tool_group(tok, renderer, tok.tml_tokenizer.encode, [INK_CALL, INK_ANSWER])
    assert group.trajectories_G[0].stop_reason == "completed"
    record_trajectory_groups([wrapped(group, builder, 0)], step=0, tokenizer=tok, renderer=renderer)
    otr.flush()
    assert_inkling_episode(mem, ["Use the calculator tool."])


@pytest.mark.matrix
def test_inkling_wrapper_without_a_renderer_warns_once_and_drops_nothing(otr_shutdown, caplog):
    """Only the wrapper, and no renderer the cookbook can build for it: what is lost is warned
    once, by name; the observation after the action is still recorded (as the tool's result)."""
    tok = inkling_wrapper(InklingMarkupTokenizer())
    renderer = inkling_markup_renderer(tok)
    mem = configure_memory()
    builder, group = inkling_tool_group(tok, renderer, tok.tml_tokenizer.encode, [INK_CALL, INK_ANSWER])
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        record_trajectory_groups([group], step=0, tokenizer=tok)
        record_trajectory_groups([group], step=1, tokenizer=tok)
    otr.flush()
    warnings = [r.getMessage() for r in caplog.records if "adapters.tinker: tokenizer" in r.getMessage()]
    assert len(warnings) == 1 and "Lost:" in warnings[0] and "renderer=" in warnings[0]
    msgs = messages_of(mem)["train:0:0:0"]
    assert msgs[0]["role"] == "user" and "What is 17 * 23?" in msgs[0]["content"]
    assert "<|" not in all_text(msgs)
    assert any("391" in str(m["content"]) for m in msgs[1:] if m["role"] != "assistant")
