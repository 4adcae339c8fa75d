"""Shared by the examples: a tiny real tokenizer and model, built here (nothing is downloaded).

The tokenizer is a byte-level BPE trained in a few milliseconds on the sentences below, wrapped
in ``transformers.PreTrainedTokenizerFast`` with a ChatML chat template (``<|im_start|>`` /
``<|im_end|>``, the latter the EOS) as Qwen models use: the adapters take the template markup
out of the recorded text with it, exactly as with a real model's tokenizer. Not an example.
"""

from __future__ import annotations

from typing import Any

CORPUS = ["You are a helpful assistant. Think step by step and answer briefly.",
          "What is 2 + 2? The answer is 4. What is 17 * 23? The answer is 391.",
          "Use the calculator tool when you need arithmetic. The result was returned by the tool."]
CHATML = ("{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def tokenizer() -> Any:
    """A real ``PreTrainedTokenizerFast`` with a ChatML template (EOS ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML
    return tok


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ready for the assistant."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def text_ids(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` (markup such as ``<|im_end|>`` becomes its special token)."""
    return list(tok.encode(text, add_special_tokens=False))
