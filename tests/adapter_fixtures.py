"""Shared pieces of the adapter tests: a real tokenizer built offline, and read-back helpers.

The tokenizer is a real ``transformers.PreTrainedTokenizerFast`` over a word-level vocabulary
built here with the ``tokenizers`` library (no download): ``encode("user: 2 + 2")`` and
``decode(ids)`` round-trip, with chat special tokens kept by ``skip_special_tokens=False``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>", "<eos>"]
WORDS = (
    "user assistant system tool what is 2 + 3 4 5 6 7 the answer call python calc print result "
    "ok error let me think compute : = ( ) , . ? hello world again try final"
).split()


@functools.lru_cache(maxsize=1)
def tokenizer():
    """A small real fast tokenizer (word level; special tokens for chat and tool tags)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<eos>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[2:8]})
    return tok


def ids(text: str) -> list[int]:
    """Token ids of ``text`` (no special tokens added)."""
    return tokenizer()(text, add_special_tokens=False)["input_ids"]


def configure_memory(cap: int = 1000, policy: str = "first", trackio_project: str | None = None):
    """``otr.configure`` with a real InMemorySpanExporter (and Trackio when a project is given);
    returns the in-memory exporter. Kept here because the adapter tests import it by this name; it
    is ``otr_helpers.configure_memory`` with a TrackioExporter added after the in-memory one."""
    import otr_helpers

    also = []
    if trackio_project is not None:
        from otel_rollouts.exporters import TrackioExporter

        also.append(TrackioExporter(trackio_project))
    return otr_helpers.configure_memory(cap, policy, also=also)


def episodes(exporter) -> dict[str, dict[str, Any]]:
    """Exported episodes by ``rl.episode.id``: ``{"root": attrs, "spans": [...], "by_kind": {...}}``."""
    from otel_rollouts import conventions as c

    traces: dict[int, list] = defaultdict(list)
    for span in exporter.get_finished_spans():
        traces[span.context.trace_id].append(span)
    out = {}
    for spans in traces.values():
        spans.sort(key=lambda s: s.start_time)
        roots = [s for s in spans if s.parent is None]
        assert len(roots) == 1, [s.name for s in roots]
        root = roots[0]
        by_kind: dict[str, list] = defaultdict(list)
        for s in spans:
            by_kind[s.attributes.get(c.RL_SPAN_KIND)].append(s)
        out[root.attributes[c.RL_EPISODE_ID]] = {"root": dict(root.attributes), "spans": spans,
                                                 "by_kind": by_kind}
    return out


def messages_of(exporter) -> dict[str, list[dict[str, Any]]]:
    """The conversation of each exported episode, as the Trackio exporter renders it."""
    from otel_rollouts.exporters._trackio_rows import episode_messages

    return {eid: episode_messages(ep["spans"]) for eid, ep in episodes(exporter).items()}


def counting_tensor_class():
    """A real ``torch.Tensor`` subclass that counts host transfers, on itself and every slice.

    Built on first use so that importing this module does not import torch.
    """
    import torch

    class CountingTensor(torch.Tensor):
        calls: dict[str, int] = {}

        def _count(self, name):
            CountingTensor.calls[name] = CountingTensor.calls.get(name, 0) + 1

        def cpu(self, *a, **k):
            self._count("cpu")
            return super().cpu(*a, **k)

        def to(self, *a, **k):
            self._count("to")
            return super().to(*a, **k)

        def numpy(self, *a, **k):
            self._count("numpy")
            return super().numpy(*a, **k)

        def tolist(self):
            self._count("tolist")
            return super().tolist()

        def item(self):
            self._count("item")
            return super().item()

    return CountingTensor


def count_prompts(monkeypatch) -> list:
    """The episodes whose prompt gets recorded from now on (``Episode.prompt`` still runs): an
    adapter on the batch path records content only for the samples the sampler may keep."""
    from otel_rollouts.record.episode import Episode

    prompted: list = []
    real_prompt = Episode.prompt

    def prompt(self, *args, **kwargs):
        prompted.append(self)
        return real_prompt(self, *args, **kwargs)

    monkeypatch.setattr(Episode, "prompt", prompt)
    return prompted
