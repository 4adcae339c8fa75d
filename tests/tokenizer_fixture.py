"""A small but real Hugging Face tokenizer, built offline for the decoding tests and benchmark.

A byte-level BPE is trained with the ``tokenizers`` library on a few sentences (unicode included)
and wrapped in ``transformers.PreTrainedTokenizerFast`` with a ChatML chat template in the style
of Qwen: ``<|im_start|>``/``<|im_end|>`` are special tokens (``<|im_end|>`` is the EOS), and
``<tool_call>``/``</tool_call>``/``<tool_response>``/``</tool_response>`` are added, non-special
tokens as in Qwen's and Hermes' vocabularies. Nothing is downloaded.

``CountingTokenizer`` is the same tokenizer class with instrumentation: it records every token
sequence it decodes, so tests can prove that dropped episodes were never decoded.
"""

from __future__ import annotations

import threading
from typing import Any

CORPUS = [
    "You are a helpful assistant. Think step by step and answer briefly.",
    "What is 2 + 2? The answer is 4. What is 17 * 23? The answer is 391.",
    "Use the calculator tool when you need arithmetic. The result was returned by the tool.",
    'Call {"name": "calculator", "arguments": {"expression": "17 * 23"}} and wait for it.',
    "The weather in Paris is sunny; the café is open. Naïve résumé façade.",
    "日本語のテキストも扱えます。東京は晴れです。",
    "Emoji work too 🙂🚀 and Greek: Ω λ π, and maths ∑ ∫ √.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Please retry: your previous answer was wrong. Try again carefully.",
]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with Hermes/Qwen tool calls: the assistant's tool calls are <tool_call>{json}</tool_call>
# blocks, tool results go back in a user turn inside <tool_response> tags.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user\\n' }}{%- endif -%}"
    "{{ '<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if message.tool_calls is defined and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + call.function.arguments + '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_lock = threading.Lock()
_cache: dict[tuple[str, int], Any] = {}


def _trained(vocab_size: int, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tokenizer(cls: type | None = None, *, vocab_size: int = 600, corpus: list[str] | None = None):
    """A fresh ``PreTrainedTokenizerFast`` (or subclass ``cls``) with chat template and roles."""
    from transformers import AddedToken, PreTrainedTokenizerFast

    corpus = CORPUS if corpus is None else corpus
    key = (repr(corpus[:3]) + str(len(corpus)), vocab_size)
    with _lock:
        raw = _cache.get(key)
        if raw is None:
            raw = _cache[key] = _trained(vocab_size, corpus).to_str()
    from tokenizers import Tokenizer

    cls = cls or PreTrainedTokenizerFast
    tokenizer = cls(
        tokenizer_object=Tokenizer.from_str(raw),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class DecodeLog:
    """Every sequence a ``CountingTokenizer`` decoded (shared by copies of the tokenizer)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sequences: list[tuple[int, ...]] = []
        self.calls = 0

    def add(self, ids: Any) -> None:
        with self.lock:
            self.calls += 1
            self.sequences.append(tuple(int(i) for i in ids))


def counting_tokenizer(log: DecodeLog):
    """A real tokenizer whose ``_decode`` (the per-sequence decode every path ends in) is logged."""
    from transformers import PreTrainedTokenizerFast

    class CountingTokenizer(PreTrainedTokenizerFast):
        decode_log = log  # a class attribute: survives copies of the tokenizer

        def _decode(self, token_ids, *args, **kwargs):
            type(self).decode_log.add([token_ids] if isinstance(token_ids, int) else token_ids)
            return super()._decode(token_ids, *args, **kwargs)

    return build_tokenizer(CountingTokenizer)


def chat_ids(tokenizer, messages: list[dict[str, Any]], *, generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
