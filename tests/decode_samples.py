"""Token-id rollouts built with the test tokenizer, the way RL frameworks lay them out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizer_fixture import chat_ids, text_ids

SYSTEM = "You are a helpful assistant."


@dataclass
class Sample:
    """One rollout: ids, loss mask (1 = generated) and per-token policy versions (−1 = not)."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(self, ids: list[int], generated: bool, version: int = 0) -> Sample:
        self.ids += ids
        self.mask += [int(generated)] * len(ids)
        self.versions += [version if generated else -1] * len(ids)
        return self

    def segments(self) -> list[tuple[int, ...]]:
        """The loss-mask runs of the ids (what a decoder of this sample decodes)."""
        out: list[tuple[int, ...]] = []
        start = 0
        for j in range(1, len(self.ids) + 1):
            if j == len(self.ids) or self.mask[j] != self.mask[start]:
                out.append(tuple(self.ids[start:j]))
                start = j
        return out


def prompt(tokenizer, user: str, system: str | None = SYSTEM) -> Sample:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return Sample().add(chat_ids(tokenizer, messages, generation_prompt=True), False)


def completion(tokenizer, text: str, *, eos: bool = True) -> list[int]:
    return text_ids(tokenizer, text + ("<|im_end|>" if eos else ""))


def single_turn(tokenizer, user: str, answer: str, *, eos: bool = True, version: int = 0) -> Sample:
    return prompt(tokenizer, user).add(completion(tokenizer, answer, eos=eos), True, version)


def tool_episode(tokenizer) -> Sample:
    """Prompt; a turn calling a tool (Hermes/Qwen format); the tool result; the final answer."""
    s = prompt(tokenizer, "What is 17 * 23? Use the calculator tool.")
    s.add(completion(tokenizer, 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": '
                                '{"expression": "17 * 23"}}\n</tool_call>'), True, 3)
    s.add(text_ids(tokenizer, "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n"), False)
    s.add(completion(tokenizer, "The answer is 391."), True, 4)
    return s


def retry_episode(tokenizer) -> Sample:
    """A wrong answer, a user retry prompt (no tool call before it), a second answer."""
    s = prompt(tokenizer, "What is 2 + 2?")
    s.add(completion(tokenizer, "The answer is 5."), True, 1)
    s.add(text_ids(tokenizer, "\n<|im_start|>user\nPlease retry: your previous answer was wrong.<|im_end|>\n"
                              "<|im_start|>assistant\n"), False)
    s.add(completion(tokenizer, "The answer is 4."), True, 1)
    return s


def padded(samples: list[Sample], pad_id: int, *, left: bool = False):
    """Padded 2-D torch tensors (input_ids, attention_mask, loss_mask, versions)."""
    import torch

    width = max(len(s.ids) for s in samples)
    out = {k: [] for k in ("input_ids", "attention_mask", "loss_mask", "versions")}
    for s in samples:
        pad = width - len(s.ids)
        for key, row, fill in (("input_ids", s.ids, pad_id), ("attention_mask", [1] * len(s.ids), 0),
                               ("loss_mask", s.mask, 0), ("versions", s.versions, -1)):
            out[key].append([fill] * pad + row if left else row + [fill] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}
