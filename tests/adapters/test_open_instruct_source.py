"""Open-Instruct's data-preparation output, rebuilt field by field from its source, through the
adapter (issue 30).

Open-Instruct is not on the package registry (git-only, with vLLM, DeepSpeed and Ray), so it is
not imported: the structures below follow its source at allenai/open-instruct
``e6c3044aa6201c8bfa4573c1b03142af599e730d`` (2026-08-20) field by field, and the helpers rebuild
what its data-preparation path hands the adapter, step by step:

* ``dataset_row``: the default transform (``rlvr_tokenize_v1`` → ``rlvr_tokenize_v3`` in
  ``dataset_transformation.py``): the prompt ids are the chat template applied with the
  generation prompt; a single verifier's ``dataset`` name and its ``ground_truth`` are wrapped
  in lists; ``prompt`` (``raw_queries``) joins ``"{role}: {content}"`` lines.
* ``Engine.sample``: ``vllm_utils.process_request``: each generation's tokens (EOS included,
  mask 1), then for each executed call one ``ToolCallStats`` and one reward in ``RolloutState``,
  and its output formatted by the tool parser with the tool's response role (``tool``; ``user``
  for a text environment), tokenized and appended with mask 0 (``mask_tool_use``). The Hermes
  parser's role templates and generation-prompt postfix are those of ``VLLM_PARSERS
  ["vllm_hermes"]``, the legacy parser's ``<output>`` wrapping that of
  ``OpenInstructLegacyToolParser``.
* ``Engine.result``: ``process_completed_request`` (``RequestInfo`` lists from the rollout
  states); ``prepare``: ``process_group`` (``batch_decode`` with special tokens) and
  ``make_batch_from_groups`` (per-group fields repeated n times), then the centered advantages of
  ``_data_preparation_loop``.

The tokenizer is a real byte-level BPE built here (``tokenizer_fixture``) with a ChatML template
in which tool messages render as ``<|im_start|>tool`` (Hermes); nothing is downloaded. The only
stand-in is the inference engine (the scripted model texts).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adapter_fixtures import episodes, messages_of
from tokenizer_fixture import build_tokenizer, chat_ids

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters import open_instruct

SOURCE_COMMIT = "e6c3044aa6201c8bfa4573c1b03142af599e730d"  # allenai/open-instruct, 2026-08-20
MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


# --- open_instruct/data_types.py, model_utils.py, environments/base.py, field for field --------
@dataclass
class TokenStatistics:
    num_prompt_tokens: int
    num_response_tokens: int
    generation_time: float
    earliest_start_time: float | None = None


@dataclass
class ToolCallStats:
    tool_name: str
    success: bool
    runtime: float


@dataclass
class RequestInfo:
    num_calls: list[int]
    timeouts: list[int]
    tool_errors: list[str]
    tool_outputs: list[str]
    tool_runtimes: list[float]
    tool_calleds: list[bool]
    tool_call_stats: list[list[ToolCallStats]] = field(default_factory=list)
    rollout_states: list[dict] = field(default_factory=list)


@dataclass
class GenerationResult:
    responses: list[list[int]]
    finish_reasons: list[str]
    masks: list[list[int]]
    request_info: RequestInfo
    index: int | None
    prompt_id: str | None
    token_statistics: TokenStatistics | None = None
    start_time: float = 0.0
    logprobs: list[list[float]] = field(default_factory=list)
    reward_scores: list[float] | None = None
    reward_metrics: dict[str, Any] | None = None
    model_step: int = 0


@dataclass
class Batch:
    queries: list[list[int]]
    ground_truths: list[list[int]]
    datasets: list[str]
    raw_queries: list[str] | None
    decoded_responses: list[str] | None
    indices: list[int] | None
    scores: list[float] | None
    active_tools: list[list[str] | None] | None = None
    model_steps: list[int] = field(default_factory=list)

    def __getitem__(self, key: list[int]) -> Batch:
        """``batch[[1, 3]]`` (what ``maybe_mask_truncated_completions`` uses)."""
        def pick(values):
            return None if values is None else [values[i] for i in key]
        return Batch(queries=pick(self.queries), ground_truths=pick(self.ground_truths),
                     datasets=pick(self.datasets), raw_queries=pick(self.raw_queries),
                     decoded_responses=pick(self.decoded_responses), indices=pick(self.indices),
                     scores=pick(self.scores), active_tools=pick(self.active_tools),
                     model_steps=pick(self.model_steps))


@dataclass
class RolloutState:
    rewards: list[float] = field(default_factory=list)
    step_count: int = 0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    tool_output: str = ""
    tool_error: str = ""
    tool_runtime: float = 0.0
    timeout: bool = False
    tool_call_stats: list[ToolCallStats] = field(default_factory=list)


# --- the tokenizer: ChatML, tools in the system prompt, tool messages as <|im_start|>tool ------
CHATML_HERMES = (
    "{%- if tools -%}{{ '<|im_start|>system\\nYou may call these tools:\\n' }}"
    "{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# vllm_hermes: one template per response role, then the next generation prompt
HERMES_ROLE_TEMPLATES = {
    "tool": "<|im_start|>tool\n<tool_response>\n{output}\n</tool_response>\n<|im_end|>\n",
    "user": "<|im_start|>user\n{output}<|im_end|>\n",
}
HERMES_POSTFIX = "<|im_start|>assistant\n"


def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHATML_HERMES
    return tok


TOK = tokenizer()


def dataset_row(messages: list[dict[str, str]], ground_truth: Any, dataset: str) -> dict[str, Any]:
    """One row of the default transform (``rlvr_tokenize_v3``)."""
    prompt = messages[:-1] if len(messages) > 1 and messages[-1]["role"] == "assistant" else messages
    return {
        "input_ids_prompt": chat_ids(TOK, prompt, generation_prompt=True),
        "ground_truth": [ground_truth],  # a single verifier's answer, wrapped like its name
        "dataset": [dataset],
        "prompt": "\n".join(f"{m['role']}: {m['content']}" for m in prompt),
    }


@dataclass
class Call:
    """One executed call: the tool (or text environment) and what it returned."""

    name: str
    output: str
    role: str = "tool"  # the env's response_role: "user" for a text environment
    success: bool = True
    runtime: float = 0.1
    reward: float = 0.0


def hermes_call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Engine:
    """What ``process_request`` builds for one sample, from scripted model texts."""

    def __init__(self, parser: str = "hermes", mask_tool_use: bool = True) -> None:
        self.parser, self.mask_tool_use = parser, mask_tool_use

    def format(self, output: str, role: str) -> str:
        if self.parser == "hermes":
            return HERMES_ROLE_TEMPLATES[role].format(output=output) + HERMES_POSTFIX
        return f"<output>\n{output}\n</output>\n"  # legacy: the role is not rendered

    def sample(self, turns: list[tuple[str, list[Call]]], finish: str = "stop",
               budget: int | None = None) -> dict[str, Any]:
        """``turns``: (model text, the calls executed after it). The model's tokens end in its
        EOS (``<|im_end|>``); each call's output is appended after all calls of the turn ran.
        ``budget``: response tokens allowed (an output past it is cut and the rollout ends)."""
        tokens: list[int] = []
        mask: list[int] = []
        state = RolloutState()
        for text, calls in turns:
            ids = TOK.encode(text + "<|im_end|>", add_special_tokens=False)
            tokens += ids
            mask += [1] * len(ids)
            for call in calls:
                state.step_count += 1
                state.tool_output += call.output
                state.rewards.append(call.reward)
                state.tool_runtime += call.runtime
                if not call.success:
                    state.tool_error += call.output
                state.tool_call_stats.append(ToolCallStats(call.name, call.success, call.runtime))
            for call in calls:
                ids = TOK.encode(self.format(call.output, call.role), add_special_tokens=False)
                excess = 0 if budget is None else max(0, len(tokens) + len(ids) - budget)
                ids = ids[: len(ids) - excess]
                tokens += ids
                mask += [0 if self.mask_tool_use else 1] * len(ids)
                if excess:
                    break
        return {"token_ids": tokens, "mask": mask, "finish_reason": finish,
                "rollout_state": dataclasses.asdict(state)}

    @staticmethod
    def result(outputs: list[dict[str, Any]], index: int, row: dict[str, Any], scores: list[float],
               model_step: int) -> GenerationResult:
        """``process_completed_request`` with tools: ``RequestInfo`` from the rollout states."""
        states = [o["rollout_state"] for o in outputs]
        return GenerationResult(
            responses=[list(o["token_ids"]) for o in outputs],
            finish_reasons=[o["finish_reason"] for o in outputs],
            masks=[o["mask"] for o in outputs],
            request_info=RequestInfo(
                num_calls=[s.get("step_count", 0) for s in states],
                timeouts=[s.get("timeout", False) for s in states],
                tool_errors=[s.get("tool_error", "") for s in states],
                tool_outputs=[s.get("tool_output", "") for s in states],
                tool_runtimes=[s.get("tool_runtime", 0.0) for s in states],
                tool_calleds=[s.get("step_count", 0) > 0 for s in states],
                tool_call_stats=[[ToolCallStats(**t) for t in s.get("tool_call_stats", [])] for s in states],
                rollout_states=states,
            ),
            index=index, prompt_id=f"0_{index}",
            token_statistics=TokenStatistics(len(row["input_ids_prompt"]),
                                             sum(len(o["token_ids"]) for o in outputs), 1.0),
            logprobs=[[0.0] * len(o["token_ids"]) for o in outputs],
            reward_scores=scores, reward_metrics={}, model_step=model_step,
        )


def prepare(groups: list[tuple[dict[str, Any], GenerationResult]]
            ) -> tuple[Batch, GenerationResult, np.ndarray]:
    """``process_group`` + ``make_batch_from_groups`` + the centered advantages."""
    batch = Batch(queries=[], ground_truths=[], datasets=[], raw_queries=[], decoded_responses=[],
                  indices=[], scores=[], active_tools=None, model_steps=[])
    combined = GenerationResult(responses=[], finish_reasons=[], masks=[],
                                request_info=RequestInfo([], [], [], [], [], []), index=None,
                                prompt_id=groups[0][1].prompt_id)
    for row, result in groups:
        n = len(result.responses)
        batch.queries += [row["input_ids_prompt"]] * n
        batch.ground_truths += [row["ground_truth"]] * n
        batch.datasets += [row["dataset"]] * n
        batch.raw_queries += [row["prompt"]] * n
        batch.indices += [result.index] * n
        batch.decoded_responses += TOK.batch_decode(result.responses, skip_special_tokens=False)
        batch.scores += list(result.reward_scores)
        batch.model_steps += [result.model_step] * n
        combined.responses += result.responses
        combined.finish_reasons += result.finish_reasons
        combined.masks += result.masks
        combined.logprobs += result.logprobs
        for name in ("num_calls", "timeouts", "tool_errors", "tool_outputs", "tool_runtimes",
                     "tool_calleds", "tool_call_stats", "rollout_states"):
            getattr(combined.request_info, name).extend(getattr(result.request_info, name))
    scores = np.array(batch.scores)
    n = len(groups[0][1].responses)
    means = np.repeat(scores.reshape(-1, n).mean(axis=-1), n)
    return batch, combined, scores - means


QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 17 * 23?"}]


def one_group(turns_per_sample: list[list[tuple[str, list[Call]]]], *, engine: Engine | None = None,
              messages=QUESTION, truth: Any = "391", dataset: str = "gsm8k", index: int = 7,
              model_step: int = 3, budget: int | None = None):
    engine = engine or Engine()
    row = dataset_row(messages, truth, dataset)
    outputs = [engine.sample(turns, budget=budget) for turns in turns_per_sample]
    scores = [float(k == 0) for k in range(len(outputs))]
    return prepare([(row, Engine.result(outputs, index, row, scores, model_step))])


def record(memory, batch, result, adv, *, step=4, tokenizer=TOK, **kw):
    n = open_instruct.record_batch(batch, result, step=step, advantages=adv, tokenizer=tokenizer,
                                   num_samples_per_prompt=len(result.responses), **kw)
    assert n == len(result.responses) and otr.flush()
    return episodes(memory), messages_of(memory)


def tools_of(ep) -> list[tuple[str, Any]]:
    return [(s.attributes[c.GEN_AI_TOOL_NAME], s.attributes.get(c.GEN_AI_TOOL_CALL_RESULT))
            for s in sorted(ep["by_kind"][c.KIND_TOOL], key=lambda s: s.start_time)]


def assert_no_markup(msgs):
    for m in msgs:
        for mark in MARKUP:
            assert mark not in str(m.get("content")), (mark, m)


# --- the six defects of issue 30 --------------------------------------------------------------
def test_the_structures_are_what_the_source_path_produces():
    """The rebuilt path gives what the source gives: list-wrapped dataset names and answers,
    EOS-terminated generations, mask-0 Hermes results with their role markup."""
    batch, result, adv = one_group([[("The answer is 391.", [])]])
    assert batch.datasets == [["gsm8k"]] and batch.ground_truths == [["391"]]
    assert batch.raw_queries[0] == "system: You are a helpful assistant.\nuser: What is 17 * 23?"
    assert batch.decoded_responses[0].endswith("<|im_end|>")
    assert TOK.decode(batch.queries[0]).endswith("<|im_start|>assistant\n")
    _, result2, _ = one_group([[(hermes_call("calc", expression="17 * 23"), [Call("calc", "391")]),
                               ("391", [])]])
    tool_text = TOK.decode([t for t, m in zip(result2.responses[0], result2.masks[0], strict=True) if not m])
    assert tool_text.startswith("<|im_start|>tool\n<tool_response>\n391")
    assert [f.name for f in dataclasses.fields(GenerationResult)][:6] == [
        "responses", "finish_reasons", "masks", "request_info", "index", "prompt_id"]


def test_dataset_name_is_the_name_not_the_text_of_a_list(memory):
    batch, result, adv = one_group([[("The answer is 391.", [])], [("390", [])]])
    eps, _ = record(memory, batch, result, adv)
    assert {e["root"][c.RL_DATASET_NAME] for e in eps.values()} == {"gsm8k"}  # was "['gsm8k']"
    # a multi-verifier row keeps both names
    batch.datasets = [["gsm8k", "ifeval"]] * 2
    batch.ground_truths = [["391", '{"func_name": "validate_lowercase"}']] * 2
    open_instruct.record_batch(batch, result, step=5, advantages=adv, tokenizer=TOK)
    assert otr.flush()
    root = episodes(memory)["train-5-0"]["root"]
    assert root[c.RL_DATASET_NAME] == "gsm8k,ifeval"
    assert list(root[c.RL_METADATA_PREFIX + "ground_truth"]) == ["391", '{"func_name": "validate_lowercase"}']


def test_ground_truth_given_as_a_list_is_recorded(memory):
    batch, result, adv = one_group([[("The answer is 391.", [])]])
    eps, _ = record(memory, batch, result, adv)
    assert eps["train-4-0"]["root"][c.RL_METADATA_PREFIX + "ground_truth"] == "391"  # was dropped


def test_no_chat_markup_or_eos_in_any_role(memory):
    batch, result, adv = one_group([
        [(hermes_call("calc", expression="17 * 23"), [Call("calc", "391")]),
         ("The answer is 391.", [])],
        [("The answer is 390.", [])],
    ])
    _, msgs = record(memory, batch, result, adv)
    for conversation in msgs.values():
        assert_no_markup(conversation)
    tool_run = msgs["train-4-0"]
    assert tool_run[:2] == QUESTION
    assert tool_run[2]["role"] == "assistant" and tool_run[2]["content"] == ""
    assert json.loads(tool_run[2]["tool_calls"][0]["function"]["arguments"]) == {"expression": "17 * 23"}
    assert tool_run[3]["role"] == "tool" and tool_run[3]["content"] == "391"
    assert tool_run[4] == {"role": "assistant", "content": "The answer is 391."}
    assert msgs["train-4-1"][2] == {"role": "assistant", "content": "The answer is 390."}


def test_several_calls_in_one_turn_each_get_their_own_output(memory):
    calls = [Call("calc", "391", runtime=0.1), Call("search", "Paris is sunny", runtime=0.2),
             Call("calc", "4", success=False, runtime=0.3)]
    text = hermes_call("calc", expression="17 * 23") + hermes_call("search", q="weather Paris") + \
        hermes_call("calc", expression="2 + 2")
    batch, result, adv = one_group([[(text, calls), ("Done: 391, sunny, 4.", [])]])
    eps, msgs = record(memory, batch, result, adv)
    ep = eps["train-4-0"]
    assert tools_of(ep) == [("calc", "391"), ("search", "Paris is sunny"), ("calc", None)]  # 3, not 2
    spans = sorted(ep["by_kind"][c.KIND_TOOL], key=lambda s: s.start_time)
    assert [s.attributes[c.RL_TOOL_RUNTIME] for s in spans] == [0.1, 0.2, 0.3]
    assert spans[2].status.status_code.name == "ERROR"
    assert json.loads(spans[1].attributes[c.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"q": "weather Paris"}
    turns = sorted(ep["by_kind"][c.KIND_TURN], key=lambda s: s.start_time)
    assert len(turns) == 2 and all(s.parent.span_id == turns[0].context.span_id for s in spans)
    conversation = msgs["train-4-0"]
    assert [m["role"] for m in conversation[2:]] == ["assistant", "tool", "tool", "tool", "assistant"]
    assert [m["content"] for m in conversation[3:5]] == ["391", "Paris is sunny"]
    assert conversation[5]["content"].startswith("error")
    assert_no_markup(conversation)


def test_a_few_shot_prompt_is_split_by_the_template_not_by_role_lines(memory):
    few_shot = [{"role": "system", "content": "Solve it."},
                {"role": "user", "content": "Examples:\nuser: 2 + 2?\nassistant: 4\nNow: What is 17 * 23?"}]
    batch, result, adv = one_group([[("391", [])]], messages=few_shot)
    _, msgs = record(memory, batch, result, adv)
    assert msgs["train-4-0"][:2] == few_shot  # no invented assistant message
    assert [m["role"] for m in msgs["train-4-0"]] == ["system", "user", "assistant"]


def test_a_text_environment_talking_to_the_user_role_is_user_feedback(memory):
    engine = Engine()
    turns = [("I guess 50.", [Call("guess_number", "Too high. Try again.", role="user", reward=0.0)]),
             ("I guess 25.", [Call("guess_number", "Correct!", role="user", reward=1.0)]),
             ("Done.", [])]
    batch, result, adv = one_group([turns], engine=engine)
    eps, msgs = record(memory, batch, result, adv)
    ep = eps["train-4-0"]
    assert not ep["by_kind"][c.KIND_TOOL]  # was two tool results
    feedback = [s for s in ep["spans"] if s.attributes.get(c.RL_FEEDBACK_ROLE) is not None]
    assert [s.attributes[c.RL_FEEDBACK_ROLE] for s in feedback] == ["user", "user"]
    conversation = msgs["train-4-0"]
    assert conversation[2:] == [
        {"role": "assistant", "content": "I guess 50."}, {"role": "user", "content": "Too high. Try again."},
        {"role": "assistant", "content": "I guess 25."}, {"role": "user", "content": "Correct!"},
        {"role": "assistant", "content": "Done."}]
    assert ep["root"]["rl.reward.component.env_step_1"] == 1.0


# --- the other shapes the path produces -------------------------------------------------------
def test_legacy_parser_outputs_back_to_back_are_split(memory):
    """The legacy parser (no role markup): each output is an ``<output>`` block."""
    engine = Engine(parser="legacy")
    turns = [("<python>print(17 * 23)</python><python>print(2 + 2)</python>",
              [Call("python", "391"), Call("python", "4")]), ("391 and 4", [])]
    batch, result, adv = one_group([turns], engine=engine)
    eps, msgs = record(memory, batch, result, adv)
    assert tools_of(eps["train-4-0"]) == [("python", "391"), ("python", "4")]
    assert_no_markup(msgs["train-4-0"])


def test_unmasked_tool_outputs_are_split_by_the_role_markers(memory):
    """``mask_tool_use=False``: every token has mask 1, the markers still separate the turns."""
    engine = Engine(mask_tool_use=False)
    turns = [(hermes_call("calc", expression="17 * 23"), [Call("calc", "391")]), ("391", [])]
    batch, result, adv = one_group([turns], engine=engine)
    eps, msgs = record(memory, batch, result, adv)
    assert tools_of(eps["train-4-0"]) == [("calc", "391")]
    assert [m["role"] for m in msgs["train-4-0"][2:]] == ["assistant", "tool", "assistant"]
    assert msgs["train-4-0"][-1]["content"] == "391"


def test_outputs_cut_by_the_context_budget(memory):
    """``process_tool_tokens`` cuts an output that runs past the budget and the rollout ends: a
    cut output is the (shortened) result of its call; a call none of whose output fits is a
    span without a result."""
    calls = [Call("calc", "391"), Call("calc", "x" * 400)]
    text = hermes_call("calc", expression="17 * 23") + hermes_call("calc", expression="9 ** 99")
    probe = len(Engine().sample([(text, calls[:1])])["token_ids"])
    groups = [one_group([[(text, calls)]], budget=probe + extra, index=extra) for extra in (5, 12)]
    for step, (batch, result, adv) in enumerate(groups):
        open_instruct.record_batch(batch, result, step=step, advantages=adv, tokenizer=TOK)
    assert otr.flush()
    eps, msgs = episodes(memory), messages_of(memory)
    assert tools_of(eps["train-0-0"]) == [("calc", "391"), ("calc", None)]  # executed, never shown
    (first, cut) = tools_of(eps["train-1-0"])
    assert first == ("calc", "391") and cut[1].startswith("xxx") and len(cut[1]) < 400
    for conversation in msgs.values():
        assert_no_markup(conversation)
        assert not any("<tool_response>" in str(m.get("content")) for m in conversation)


def test_truncation_filter_then_record_pairs_nothing_wrongly(memory):
    """``maybe_mask_truncated_completions`` filters responses and batch, not ``request_info``."""
    batch, result, adv = one_group([
        [(hermes_call("calc", expression="1 + 1"), [Call("calc", "2")]), ("2", [])],
        [("no tools", [])], [("also none", [])]])
    result.finish_reasons[0] = "length"
    keep = [i for i, f in enumerate(result.finish_reasons) if f == "stop"]
    for name in ("responses", "masks", "finish_reasons", "logprobs"):
        setattr(result, name, [getattr(result, name)[i] for i in keep])
    batch = batch[keep]
    eps, _ = record(memory, batch, result, adv[keep])
    assert all(not e["by_kind"][c.KIND_TOOL] for e in eps.values())
    assert all(e["root"][c.RL_ALIGNMENT_KIND] == "partial" for e in eps.values())


# --- the docs name the real hook point and the real module ------------------------------------
ADAPTER_PAGE = Path(__file__).resolve().parents[2] / "docs" / "adapters" / "open-instruct.md"


def _section(title: str) -> str:
    text = ADAPTER_PAGE.read_text(encoding="utf-8")
    assert text.startswith(f"# {title}\n")
    return text


def test_readme_names_the_function_that_exists():
    section = _section("Open-Instruct")
    assert "_run_data_preparation_loop" not in section
    assert "DataPreparationActor._data_preparation_loop" in section
    assert re.search(r"\b[0-9a-f]{8,40}\b", section), "the source commit tested is named"


@pytest.mark.parametrize("name", ["datasets", "ground_truths"])
def test_unknown_shapes_of_list_fields_are_warned_not_guessed(name, caplog, memory):
    import logging

    batch, result, adv = one_group([[("391", [])]])
    setattr(batch, name, [[{"nested": ["x"]}]] if name == "datasets" else [[{"a": 1}, ["b"]]])
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        open_instruct.record_batch(batch, result, step=1, advantages=adv, tokenizer=TOK)
    assert otr.flush()
    root = episodes(memory)["train-1-0"]["root"]
    if name == "datasets":
        assert any("datasets" in r.getMessage() for r in caplog.records)
        assert "nested" in root[c.RL_DATASET_NAME]
    else:
        assert json.loads(root[c.RL_METADATA_PREFIX + "ground_truth"]) == [{"a": 1}, ["b"]]
