"""The shapes people train on, trained on: the ``messages`` dataset ``otel-rollouts dataset``
wrote trains a real TRL ``SFTTrainer`` (a tiny Qwen2 and a BPE tokenizer built here, CPU), and
the ``pairs`` dataset is TRL's conversational preference shape (``prompt``/``chosen``/
``rejected``, templated by TRL's own ``apply_chat_template``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from test_adapter_trl import build_tokenizer, require_trl, tiny_model_dir
from test_dataset import _run

import otel_rollouts as otr

datasets = pytest.importorskip("datasets")


def test_sft_trains_on_the_messages_rows_and_pairs_template_as_preferences(tmp_path: Path) -> None:
    require_trl()
    from trl import SFTConfig, SFTTrainer
    from trl.data_utils import apply_chat_template, is_conversational

    file, _ = _run(tmp_path, f"trl-{uuid.uuid4().hex[:6]}")
    otr.build_dataset([file], tmp_path / "sft", progress=False)
    otr.build_dataset([file], tmp_path / "prefs", format="pairs", progress=False)
    sft = datasets.load_from_disk(str(tmp_path / "sft" / "hf"))
    prefs = datasets.load_from_disk(str(tmp_path / "prefs" / "hf"))
    assert is_conversational(sft[0]) and is_conversational(prefs[0])

    tokenizer = build_tokenizer()
    templated = apply_chat_template({k: prefs[0][k] for k in ("prompt", "chosen", "rejected")}, tokenizer)
    assert prefs[0]["prompt"][-1]["content"] in templated["prompt"]
    assert prefs[0]["chosen"][-1]["content"] in templated["chosen"]
    assert prefs[0]["rejected"][-1]["content"] in templated["rejected"]

    model = tiny_model_dir(tmp_path, tokenizer)
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=sft.select_columns(["messages"]),
        args=SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                       logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                       dataloader_num_workers=0, max_length=256),
    )
    result = trainer.train()
    assert result.global_step == 2 and result.training_loss > 0
