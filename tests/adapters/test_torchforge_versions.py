"""torchforge before and after its sample-logging change (PR #486), through the adapter.

Before it, ``Episode`` lived in the app (``apps/grpo/main.py`` of meta-pytorch/torchforge at
``6e77f0b37596ef4d4f31924fbc46eb77d0c8043d``, 2025-11-15) with no ``request``, ``response`` or
``reward_breakdown``: the prompt is only in ``completion.prompt``, which the generator's
``_to_completions`` builds with ``to_prompt(original_prompt)`` (one user ``Message`` whose chunk is
the chat-templated request), and in ``completion.prompt_ids``. Since then ``Episode`` is
``forge.rl.Episode`` (``src/forge/rl/types.py`` at ``cf02b132b078decc68b7f64f0dd51f70d603a073``)
with ``request`` (the same templated string) and ``to_dict``. ``forge`` is not imported; the
structures below follow those sources field by field.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from adapter_fixtures import episodes, messages_of
from test_adapter_torchforge import Completion
from test_adapter_torchforge import Episode as NewEpisode
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c
from otel_rollouts.adapters.torchforge import record_episodes

OLD_COMMIT = "6e77f0b37596ef4d4f31924fbc46eb77d0c8043d"  # apps/grpo/main.py, before PR #486


# --- forge/data_models/prompt.py ------------------------------------------------------------------
class Role(Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    NONE = "none"


@dataclass
class Message:
    chunks: Sequence[str]
    role: Role


@dataclass
class Prompt:
    messages: Sequence[Message]


def to_prompt(prompt: str, system_instruction: str | None = None) -> Prompt:
    messages = [] if system_instruction is None else [Message([system_instruction], Role.SYSTEM)]
    return Prompt(messages + [Message([prompt], Role.USER)])


# --- apps/grpo/main.py at OLD_COMMIT ------------------------------------------------------------
@dataclass
class OldEpisode:
    episode_id: str
    pad_id: int
    request_len: int
    response_len: int
    target: Any | None = None
    completion: Completion | None = None
    ref_logprobs: torch.Tensor | None = None
    reward: float | None = None
    advantage: float | None = None

    @property
    def policy_version(self) -> int | None:
        return self.completion.generator_version


TOK = build_tokenizer()
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 17 * 23?"}]
REQUEST = TOK.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)


def completion(text: str, prompt: Any = "default", version: int = 2) -> Completion:
    """What the generator's ``_to_completions`` returns for the templated request."""
    return Completion(prompt=to_prompt(REQUEST) if prompt == "default" else prompt, text=text,
                      prompt_ids=torch.tensor(TOK.encode(REQUEST, add_special_tokens=False)),
                      token_ids=torch.tensor(TOK.encode(text, add_special_tokens=False)),
                      stop_reason="stop", generator_version=version,
                      metadata={"num_cached_tokens": 0})


def old_group(prompt: Any = "default") -> list[OldEpisode]:
    group = []
    for i, (text, reward) in enumerate([("The answer is 391.<|im_end|>", 1.0), ("392<|im_end|>", 0.0)]):
        ep = OldEpisode(episode_id=f"old-{i}", pad_id=0, request_len=64, response_len=64, target="391",
                        completion=completion(text, prompt))
        ep.reward, ep.advantage = reward, reward - 0.5
        group.append(ep)
    return group


def test_an_old_episode_has_its_prompt_and_its_group(memory):
    record_episodes(old_group(), step=2, tokenizer=TOK)
    new = NewEpisode(episode_id="new-0", pad_id=0, request_len=64, response_len=64, target="391",
                     request=REQUEST, response="391", completion=completion("391<|im_end|>"))
    record_episodes([new], step=2, tokenizer=TOK)
    assert otr.flush()
    eps, msgs = episodes(memory), messages_of(memory)
    assert msgs["old-0"][:2] == QUESTION  # was one empty user message
    assert msgs["old-0"][2] == {"role": "assistant", "content": "The answer is 391."}
    groups = {eps[k]["root"].get(c.RL_GROUP_ID) for k in ("old-0", "old-1", "new-0")}
    assert len(groups) == 1 and None not in groups  # the same group as the request gives
    assert eps["old-0"]["root"][c.RL_POLICY_VERSION] == 2


def test_an_old_episode_without_a_tokenizer_shows_the_request_text(memory):
    record_episodes(old_group(), step=2)
    assert otr.flush()
    assert messages_of(memory)["old-0"][0] == {"role": "user", "content": REQUEST}


def test_a_prompt_of_several_messages_is_kept_as_messages(memory):
    prompt = to_prompt("What is 17 * 23?", system_instruction="You are a helpful assistant.")
    record_episodes(old_group(prompt), step=3, tokenizer=TOK)
    assert otr.flush()
    eps = episodes(memory)
    assert messages_of(memory)["old-0"][:2] == QUESTION
    assert eps["old-0"]["root"][c.RL_GROUP_ID] == eps["old-1"]["root"][c.RL_GROUP_ID]


def test_only_prompt_ids_are_decoded_and_grouped(memory):
    group = old_group(prompt=None)
    record_episodes(group, step=4, tokenizer=TOK)
    assert otr.flush()
    eps = episodes(memory)
    assert messages_of(memory)["old-1"][:2] == QUESTION
    assert eps["old-0"]["root"][c.RL_GROUP_ID] == eps["old-1"]["root"][c.RL_GROUP_ID] is not None


def test_nothing_to_read_the_prompt_from_is_warned_naming_the_fields(caplog, memory):
    group = old_group(prompt=None)
    for ep in group:
        ep.completion.prompt_ids = None
    with caplog.at_level(logging.WARNING, logger="otel_rollouts"):
        record_episodes(group, step=5)
    assert otr.flush()
    warned = [r.getMessage() for r in caplog.records if "adapters.torchforge: request" in r.getMessage()]
    assert len(warned) == 1 and "completion.prompt_ids" in warned[0]
    assert c.RL_GROUP_ID not in episodes(memory)["old-0"]["root"]


def test_readme_says_where_episode_lives():
    page = Path(__file__).resolve().parents[2] / "docs" / "adapters" / "torchforge.md"
    section = page.read_text(encoding="utf-8")
    assert "forge.rl" in section
    assert "lives in the app, not the package" not in section
