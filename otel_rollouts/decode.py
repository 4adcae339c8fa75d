"""Token-id batches (what RL frameworks hold) recorded as episodes, decoded only when kept.

    summary = otr.record_token_batch(
        batch["input_ids"], tokenizer=tokenizer, step=step, loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"], rewards=batch["rewards"], versions=batch["versions"],
    )

(Work in progress: the signature below is the stable contract.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["record_token_batch", "TokenBatchSummary"]


@dataclass
class TokenBatchSummary:
    """What ``record_token_batch`` did with a batch."""

    recorded: int = 0  # episodes recorded (including error episodes for refused samples)
    refused: list[tuple[int, str]] = field(default_factory=list)  # (sample, reason): tokens unusable
    problems: list[str] = field(default_factory=list)  # batch-level notes (e.g. misaligned columns)


def record_token_batch(
    input_ids: Any,
    *,
    tokenizer: Any,
    step: int,
    loss_mask: Any,
    attention_mask: Any = None,
    rewards: Any = None,
    advantages: Any = None,
    group_ids: Any = None,
    versions: Any = None,
    split: str = "train",
    metadata: Mapping[str, Any] | Sequence[Mapping[str, Any] | None] | None = None,
    episode_ids: Any = None,
    sample_indices: Any = None,
    finish_reasons: Any = None,
    statuses: Any = None,
    reward_components: Any = None,
    dataset_name: str | None = None,
    dataset_indices: Any = None,
    framework: str | None = None,
    model: str | None = None,
    max_length: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    skip_special_tokens: bool = False,
) -> TokenBatchSummary:
    """Record one episode per sample of a token-id batch; decode only the kept ones."""
    return TokenBatchSummary()
